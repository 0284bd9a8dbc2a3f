"""fusedattn: fused multi-head attention for Flax (linen, NNX) and Equinox."""

from fusedattn import configs, layers, ops

__version__ = "0.1.0"
__all__ = ["configs", "layers", "ops", "__version__"]
