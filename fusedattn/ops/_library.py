"""Loading the compiled op set and registering its XLA FFI handlers with JAX.

The op set is built by CMake (scikit-build-core) into plain shared libraries
of FFI handler symbols, without any Python ABI:

    fusedattn/_lib/libfusedattn_host.so   always; platform "cpu"
    fusedattn/_lib/libfusedattn_cuda.so   built where usable (cmake/gpu_libraries.py); "CUDA"
    fusedattn/_lib/libfusedattn_rocm.so   likewise, with hipcc; platform "ROCM"

The CUDA and ROCm libraries are built from the same sources (ops_cuda/cuda),
so they export the same handlers (the flash kernels under names of their platform),
except the paged decode kernel (ops_cuda/cuda/paged_decode.cu), which the CUDA library
alone has.

`load(platform)` opens the platform's library once with ctypes and registers
its handlers under the target names below with `jax.ffi.register_ffi_target`;
`available(platform)` says why a platform cannot be served (or None). Nothing
happens at import time.

With an editable install (scikit-build-core's redirect mode) the libraries sit
in site-packages/fusedattn/_lib while the Python sources stay in the checkout,
so the search covers every `fusedattn` package directory and then each
`sys.path` entry's `fusedattn/_lib`. `FUSEDATTN_LIB_DIR` (a directory) is
searched first when set.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

# FFI target name -> exported C symbol, per library.
HOST_TARGETS = {
    "fusedattn_flash_fwd": "FusedattnFlashFwdHost",
    "fusedattn_flash_bwd": "FusedattnFlashBwdHost",
    "fusedattn_dropout_mask": "FusedattnDropoutMaskHost",
    "fusedattn_philox": "FusedattnPhiloxHost",
    "fusedattn_small_seq_fwd": "FusedattnSmallSeqFwdHost",
    "fusedattn_small_seq_bwd": "FusedattnSmallSeqBwdHost",
    "fusedattn_paged_decode_fwd": "FusedattnPagedDecodeFwdHost",
}
GPU_TARGETS = {
    "fusedattn_dropout_mask": "FusedattnDropoutMaskGpu",
    "fusedattn_philox": "FusedattnPhiloxGpu",
    "fusedattn_small_seq_fwd": "FusedattnSmallSeqFwdGpu",
    "fusedattn_small_seq_bwd": "FusedattnSmallSeqBwdGpu",
}

# The paged decode kernel is CUDA only (cp.async): the ROCm library lacks it. The flash
# kernels are one source over a tensor-core layer per vendor (ops_cuda/cuda/flash/tensor_core.cuh).
CUDA_TARGETS = {
    **GPU_TARGETS,
    "fusedattn_flash_fwd": "FusedattnFlashFwdCuda",
    "fusedattn_flash_bwd": "FusedattnFlashBwdCuda",
    "fusedattn_paged_decode_fwd": "FusedattnPagedDecodeFwdCuda",
}
ROCM_TARGETS = {
    **GPU_TARGETS,
    "fusedattn_flash_fwd": "FusedattnFlashFwdRocm",
    "fusedattn_flash_bwd": "FusedattnFlashBwdRocm",
}

# JAX platform name for register_ffi_target -> (library stem, targets, the compiler that
# builds it and its toolkit).
_LIBRARIES = {
    "cpu": ("fusedattn_host", HOST_TARGETS, None),
    "CUDA": ("fusedattn_cuda", CUDA_TARGETS, ("nvcc", "the CUDA toolkit")),
    "ROCM": ("fusedattn_rocm", ROCM_TARGETS, ("hipcc", "ROCm (HIP)")),
}

_lock = threading.Lock()
_loaded: dict[str, str | None] = {}  # platform -> None (registered) or the reason it is not
_handles: dict[str, ctypes.CDLL] = {}  # keeps the libraries open


def _ffi_platform(platform: str) -> str:
    """"cpu", "CUDA" or "ROCM" for the names JAX and users use ("gpu" means CUDA)."""
    p = platform.lower()
    if p in ("gpu", "cuda"):
        return "CUDA"
    if p in ("rocm", "hip"):
        return "ROCM"
    return p


def _library_filename(stem: str) -> str:
    if sys.platform == "darwin":
        return f"lib{stem}.dylib"
    if sys.platform == "win32":
        return f"{stem}.dll"
    return f"lib{stem}.so"


def _search_dirs() -> list[Path]:
    dirs: list[Path] = []
    override = os.environ.get("FUSEDATTN_LIB_DIR")
    if override:
        dirs.append(Path(override))
    import fusedattn

    package_dirs = list(getattr(fusedattn, "__path__", []) or [])
    if getattr(fusedattn, "__file__", None):
        package_dirs.insert(0, str(Path(fusedattn.__file__).parent))
    dirs.extend(Path(d) / "_lib" for d in package_dirs)
    dirs.extend(Path(entry or ".") / "fusedattn" / "_lib" for entry in sys.path)
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def library_path(stem: str) -> Path | None:
    """The first existing file of library `stem` on the search path, or None."""
    name = _library_filename(stem)
    for directory in _search_dirs():
        candidate = directory / name
        if candidate.is_file():
            return candidate
    return None


def _has_jax_backend(ffi_platform: str) -> bool:
    import jax

    try:
        return bool(jax.devices(ffi_platform.lower()))
    except RuntimeError:
        return False


def _load(ffi_platform: str) -> str | None:
    if ffi_platform not in _LIBRARIES:
        return f"no compiled op library exists for platform {ffi_platform!r}"
    stem, targets, builder = _LIBRARIES[ffi_platform]
    if ffi_platform != "cpu" and not _has_jax_backend(ffi_platform):
        return f"jax has no {ffi_platform} backend in this process"
    path = library_path(stem)
    if path is None:
        if ffi_platform == "cpu":
            return ("the host library was not built (libfusedattn_host not found next to the "
                    "fusedattn package): reinstall with pip install .")
        compiler, toolkit = builder
        return (f"the {ffi_platform} library was not built (at install time no {compiler} was "
                f"found, or no GPU or GPU JAX plugin was seen): reinstall on a machine with "
                f"{toolkit}, with FUSEDATTN_GPU_LIBRARIES=all pip install . to build it anyway")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        return f"could not load {path}: {error}; reinstall with pip install ."
    import jax

    try:
        for target, symbol in targets.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform=ffi_platform)
    except (AttributeError, ValueError, RuntimeError) as error:
        return f"could not register the handlers of {path}: {error}; reinstall with pip install ."
    _handles[ffi_platform] = lib
    return None


def available(platform: str) -> str | None:
    """None when the op library of `platform` ("cpu", "gpu", "cuda", "rocm") is
    loaded and registered (loading it if needed), else the reason it is not."""
    ffi_platform = _ffi_platform(platform)
    with _lock:
        if ffi_platform not in _loaded:
            _loaded[ffi_platform] = _load(ffi_platform)
        return _loaded[ffi_platform]


def load(platform: str) -> bool:
    """Loads and registers the op library of `platform` once; True on success."""
    return available(platform) is None


def _head_dims(platform: str, symbol: str) -> frozenset[int]:
    """The head dims of a bit mask (D / 64) that the loaded library's `symbol` returns."""
    if available(platform) is not None:
        return frozenset()
    mask = getattr(_handles[_ffi_platform(platform)], symbol)()
    return frozenset(d for d in (64, 128, 256) if mask & (d // 64))


def flash_head_dims(platform: str = "cuda") -> frozenset[int]:
    """The head dims the loaded CUDA or ROCm library's flash kernels were built for (empty
    when the library is not loaded)."""
    symbol = ("FusedattnFlashRocmHeadDims" if _ffi_platform(platform) == "ROCM"
              else "FusedattnFlashCudaHeadDims")
    return _head_dims(platform, symbol)


def flash_sm90_head_dims(platform: str = "cuda") -> frozenset[int]:
    """The head dims of the loaded CUDA library's sm_90a (wgmma) flash forward kernel (empty
    when the library is not loaded or was built without sm_90)."""
    return _head_dims(platform, "FusedattnFlashCudaSm90HeadDims")


def flash_sm90_backward_head_dims(platform: str = "cuda") -> frozenset[int]:
    """The head dims of the loaded CUDA library's sm_90a (wgmma) flash backward kernel (empty
    when the library is not loaded or was built without sm_90)."""
    return _head_dims(platform, "FusedattnFlashCudaSm90BackwardHeadDims")


def _opened(ffi_platform: str) -> ctypes.CDLL:
    """The platform's library, registered or not (its plain C queries need no device)."""
    if ffi_platform in _handles:
        return _handles[ffi_platform]
    stem, _, _ = _LIBRARIES[ffi_platform]
    path = library_path(stem)
    if path is None:
        raise RuntimeError(f"fusedattn: lib{stem} was not built; reinstall with pip install . on a "
                           "machine with its compiler")
    with _lock:
        _handles.setdefault(ffi_platform, ctypes.CDLL(str(path)))
    return _handles[ffi_platform]


def flash_workspace_bytes(platform: str, *, token_rows: int, batch: int, heads: int, seqlen_q: int,
                          seqlen_kv: int, head_dim: int, backward: bool, sm90_backward: bool,
                          alibi: bool, bias_batch: int = 0, bias_heads: int = 0) -> int:
    """The bytes of the uint8 workspace result a flash call needs on "cuda" or "rocm": the
    library's own layout (ops_cuda/cuda/flash/flash.cu: workspace_of), which its handlers
    check, so that the size given when the call is traced cannot drift from it.
    sm90_backward: the backward runs the sm_90a kernel (flash_gpu.cuda_backward_kernel);
    bias_batch, bias_heads: the bias array's leading dims (0, 0 without one)."""
    ffi_platform = _ffi_platform(platform)
    query = getattr(_opened(ffi_platform), "FusedattnFlashRocmWorkspaceBytes" if ffi_platform == "ROCM"
                    else "FusedattnFlashCudaWorkspaceBytes")
    query.restype = ctypes.c_int64
    query.argtypes = [ctypes.c_int64] * 6 + [ctypes.c_int32] * 3 + [ctypes.c_int64] * 2
    return int(query(token_rows, batch, heads, seqlen_q, seqlen_kv, head_dim, int(backward),
                     int(sm90_backward), int(alibi), bias_batch, bias_heads))
