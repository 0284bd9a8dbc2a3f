"""Attention backends; each says whether it can serve a call (`supports`) and serves it."""
