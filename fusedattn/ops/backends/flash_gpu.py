"""The flash backend's GPU-kernel rules: which compiled kernels serve a call on which GPU.

On CUDA: whether the library holds kernels for the call's dtype and head dim, and which
forward and backward kernels a device of a given compute capability runs (sm_90a wgmma
or sm_80 mma.sync, the rules of ops_cuda/cuda/flash/flash.cu), unless the environment
variable FUSEDATTN_FLASH_KERNEL=sm80 names the sm_80 kernels. On ROCm: the CDNA targets
(gfx90a, gfx94x) the same kernel text serves over MFMA. Each refusal is a reason string
for explain() and for a named backend's error; flash.py asks here and builds the calls.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from fusedattn.ops import _library
from fusedattn.ops.backends.base import CallShapes, compute_capability, cuda_library_reason
from fusedattn.ops.enums import BiasType, MaskType, SoftmaxType
from fusedattn.ops.spec import AttentionSpec

# Head dims and element types the GPU kernels serve (which head dims a build holds:
# _library.flash_head_dims).
_GPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_GPU_HEAD_DIMS = {"cuda": (64, 128, 256), "rocm": (64, 128)}  # ROCm: 64 KB of LDS
_PLATFORM_NAMES = {"cuda": "CUDA", "rocm": "ROCm"}

# The AMD targets the ROCm kernels are written for (MFMA 32x32x8 bf16_1k/f16, wave64):
# CDNA2 and CDNA3.
ROCM_ARCHS = ("gfx90a", "gfx940", "gfx941", "gfx942")

# The environment variable that names the CUDA kernels (tests, benchmarks): unset or empty,
# the device decides (cuda_forward_kernel); "sm80", the sm_80 kernels on every device.
KERNEL_VARIABLE = "FUSEDATTN_FLASH_KERNEL"


def named_kernel() -> str:
    """"" or "sm80": what FUSEDATTN_FLASH_KERNEL names. Read when a call is traced (the call
    carries it to flash.cu as its "kernel" attribute), so a function jitted before the
    variable changed keeps the kernels it was traced with."""
    value = os.environ.get(KERNEL_VARIABLE, "")
    if value not in ("", "sm80"):
        raise ValueError(f"{KERNEL_VARIABLE} must be unset, empty or 'sm80', got {value!r}; "
                         "unset it to let the device pick the flash kernels")
    return value


def rocm_arch() -> str:
    """The default device's gfx target name ("" when JAX does not say)."""
    return str(getattr(jax.devices()[0], "compute_capability", "") or "").split(":")[0]


def _rocm_library_reason() -> str | None:
    """Why the ROCm library cannot run the flash kernels on the default device (None: it can)."""
    reason = _library.available("rocm")
    if reason is not None:
        return f"flash: {reason}"
    arch = rocm_arch()
    if arch and arch not in ROCM_ARCHS:
        return (f"flash: the ROCm kernels are written for CDNA GPUs ({', '.join(ROCM_ARCHS)}: "
                f"MFMA, wave64), this GPU is {arch}; use backend='xla'")
    return None


def gpu_reason(shapes: CallShapes | None, platform: str) -> str | None:
    """Why the CUDA or ROCm kernels cannot serve a call (None: they can)."""
    reason = cuda_library_reason("flash") if platform == "cuda" else _rocm_library_reason()
    if reason is not None or shapes is None:
        return reason
    name = _PLATFORM_NAMES[platform]
    if jnp.dtype(shapes.dtype) not in _GPU_DTYPES:
        return (f"flash: the {name} kernels take bfloat16 or float16 inputs, got "
                f"{jnp.dtype(shapes.dtype).name}; cast q, k and v, or use backend='cudnn' or 'xla'")
    if shapes.head_dim_v != shapes.head_dim_qk:
        return (f"flash: the {name} kernels need v's head dim equal to q's, got "
                f"{shapes.head_dim_v} and {shapes.head_dim_qk}; use backend='xla'")
    built = _library.flash_head_dims(platform)
    if shapes.head_dim_qk not in built:
        exist = ", ".join(map(str, _GPU_HEAD_DIMS[platform]))
        return (f"flash: no {name} kernel for head dim {shapes.head_dim_qk} in this build (built: "
                f"{sorted(built)}; the kernels exist for {exist}, see FUSEDATTN_FLASH_HEAD_DIMS in "
                "the README); use backend='cudnn' or 'xla'")
    return None


def cuda_forward_kernel(head_dim: int, seqlen_kv: int) -> str:
    """"sm90" or "sm80": the forward kernel of a CUDA call. The rule of
    ops_cuda/cuda/flash/flash.cu (forward_kernel_of): the sm_80 (mma.sync) kernel when
    FUSEDATTN_FLASH_KERNEL=sm80 names it; else the sm_90a (wgmma) kernel on a device of
    compute capability 9.0 where the library holds it for the head dim and there is at least
    one key (TMA describes no empty tensor), else the sm_80 kernel."""
    if named_kernel() == "sm80":
        return "sm80"
    if (compute_capability() == (9, 0) and head_dim in _library.flash_sm90_head_dims("cuda")
            and seqlen_kv > 0):
        return "sm90"
    return "sm80"


def cuda_backward_kernel(head_dim: int, seqlen_q: int, seqlen_kv: int, deterministic: bool) -> str:
    """"sm90" or "sm80": the backward kernel of a CUDA call. The rule of
    ops_cuda/cuda/flash/flash.cu (backward_kernel_of): the sm_90a (wgmma) kernel on a device
    of compute capability 9.0 where the library holds it for the head dim (64, 128 and 256),
    the call has queries and keys, config.deterministic_backward is False (its dQ sums with
    float32 reductions, in no fixed order) and FUSEDATTN_FLASH_KERNEL does not name the sm_80
    kernels; else the sm_80 kernels (bitwise repeatable)."""
    if named_kernel() == "sm80":
        return "sm80"
    if (not deterministic and compute_capability() == (9, 0) and seqlen_q > 0 and seqlen_kv > 0
            and head_dim in _library.flash_sm90_backward_head_dims("cuda")):
        return "sm90"
    return "sm80"


# Where backend "auto" takes flash ahead of cudnn: the calls the committed benchmark measured
# flash faster on (benchmarks/results/flash_long_causal.json, H200, bf16: causal d128
# self-attention of 8192-32768 tokens, 16 heads; fwd+bwd 1.01-1.07x, fwd 1.05-1.15x cudnn's
# speed). Shorter, non-causal, GQA, dropout and deterministic calls measured cudnn faster or
# were not measured (benchmarks/results/flash.json), so they stay with cudnn.
AUTO_MIN_TOKENS = 8192
AUTO_RULE = ("auto: flash chosen over cudnn for causal d128 bf16 self-attention of >= "
             f"{AUTO_MIN_TOKENS} tokens on sm90 (benchmarks/results/flash_long_causal.json: "
             "fwd+bwd 1.01-1.07x, fwd 1.05-1.15x cudnn)")


def auto_preference(spec: AttentionSpec, shapes: CallShapes | None, platform: str) -> str | None:
    """AUTO_RULE where a CUDA call is one the rule covers (flash then runs its sm_90a
    kernels both ways), else None."""
    if shapes is None or (platform or "").lower() not in ("gpu", "cuda"):
        return None
    measured = (spec.mask == MaskType.CAUSAL and spec.window_size == (-1, -1)
                and not spec.uses_segments and spec.softmax == SoftmaxType.VANILLA
                and spec.bias == BiasType.NO_BIAS and not shapes.dropout
                and not spec.deterministic_backward and not spec.fp8_enabled
                and spec.context_axis is None and not spec.qkv_layout.is_paged
                and shapes.head_dim_qk == shapes.head_dim_v == 128
                and shapes.seqlen_q == shapes.seqlen_kv >= AUTO_MIN_TOKENS
                and shapes.num_heads == shapes.num_kv_heads
                and jnp.dtype(shapes.dtype) == jnp.dtype(jnp.bfloat16))
    if not measured or cuda_forward_kernel(128, shapes.seqlen_kv) != "sm90":
        return None
    if cuda_backward_kernel(128, shapes.seqlen_q, shapes.seqlen_kv, False) != "sm90":
        return None
    return AUTO_RULE


def _kernels_text(forward: str, backward: str, deterministic: bool) -> str:
    """explain()'s words for the kernels a CUDA call gets ("sm90" or "sm80" each)."""
    if forward == backward == "sm80":
        text = "flash: sm80 mma.sync forward and backward"
    else:
        text = f"flash: sm90 wgmma forward, {'sm90 wgmma' if backward == 'sm90' else 'sm80'} backward"
    return text + " (deterministic_backward)" if deterministic and backward == "sm80" else text


# explain()'s words for a call with ALiBi or a bias array: the kernels add the term themselves.
_ALIBI_TEXT = ", ALiBi in the kernels (slopes' gradient summed in a fixed order)"
_BIAS_TEXT = ", the bias array in the kernels (its gradient's terms summed in a fixed order)"


def kernels(spec: AttentionSpec, shapes: CallShapes | None, platform: str) -> str | None:
    """Which kernels serve a call on CUDA or ROCm (for explain); None elsewhere."""
    platform = (platform or "").lower()
    if shapes is None or platform not in ("gpu", "cuda", "rocm"):
        return None
    bias = spec.bias in (BiasType.PRE_SCALE_BIAS, BiasType.POST_SCALE_BIAS)
    term = _ALIBI_TEXT if spec.bias == BiasType.ALIBI else _BIAS_TEXT if bias else ""
    if platform == "rocm":
        return (f"flash: MFMA forward and backward{term} (the sm80 kernels' text, "
                "gfx90a/gfx94x; compile-checked only, never run on AMD hardware)")
    d = shapes.head_dim_qk
    deterministic = bool(spec.deterministic_backward)
    text = _kernels_text(cuda_forward_kernel(d, shapes.seqlen_kv),
                         cuda_backward_kernel(d, shapes.seqlen_q, shapes.seqlen_kv, deterministic),
                         deterministic) + term
    if named_kernel() == "sm80":
        return f"{text} (named by {KERNEL_VARIABLE}=sm80)"
    return text
