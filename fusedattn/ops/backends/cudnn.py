"""The cuDNN backend (cuDNN frontend SDPA graphs): registered, not built yet."""

from __future__ import annotations

from fusedattn.ops.backends.base import CallShapes, CanonicalArgs
from fusedattn.ops.spec import AttentionSpec


class CudnnBackend:
    name = "cudnn"

    def supports(self, spec: AttentionSpec, shapes: CallShapes, platform: str) -> str | None:
        if platform != "cuda":
            return f"cudnn: needs a CUDA GPU; this computation runs on {platform}"
        return "cudnn: the cuDNN kernels are not built yet in this version; use backend='xla'"

    def attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float):
        raise NotImplementedError(self.supports(spec, None, "cuda"))


BACKEND = CudnnBackend()
