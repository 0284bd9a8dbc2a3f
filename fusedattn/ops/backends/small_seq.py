"""The small-sequence backend (one query per segment, <= 16 keys): registered, not built yet."""

from __future__ import annotations

from fusedattn.ops.backends.base import CallShapes, CanonicalArgs
from fusedattn.ops.spec import AttentionSpec


class SmallSeqBackend:
    name = "small_seq"

    def supports(self, spec: AttentionSpec, shapes: CallShapes, platform: str) -> str | None:
        return "small_seq: the small-sequence kernels are not built yet in this version"

    def attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float):
        raise NotImplementedError(self.supports(spec, None, "cpu"))


BACKEND = SmallSeqBackend()
