"""Loading the cuDNN backend's library and libcudnn, and asking them about graphs.

libfusedattn_cudnn (ops_cuda/cudnn/cudnn_sdpa.cc) is a library of its own, built
when the nvidia-cudnn-frontend and nvidia-cudnn-cu13 headers are found at install
time. libcudnn itself is loaded at run time by that library: the libcudnn.so.9
JAX's CUDA plugin already loaded, else the one of the nvidia-cudnn wheel. Besides
the four FFI handlers it registers (bf16/fp16 and FP8, forward and backward), the library answers, through ctypes, whether
cuDNN can build a configuration's graphs (`check`, with cuDNN's reason) and how
much workspace a call needs (`workspace_bytes`); both build the graphs and cache
them in the library, so a step pays no graph build after the first.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import sys
import threading
from pathlib import Path

import jax

from fusedattn.ops import _library

FWD_TARGET = "fusedattn_cudnn_fwd"
BWD_TARGET = "fusedattn_cudnn_bwd"
FP8_FWD_TARGET = "fusedattn_cudnn_fp8_fwd"
FP8_BWD_TARGET = "fusedattn_cudnn_fp8_bwd"
TARGETS = {FWD_TARGET: "FusedattnCudnnFwd", BWD_TARGET: "FusedattnCudnnBwd",
           FP8_FWD_TARGET: "FusedattnCudnnFp8Fwd", FP8_BWD_TARGET: "FusedattnCudnnFp8Bwd"}
LIBRARY_STEM = "fusedattn_cudnn"
_MESSAGE_BYTES = 4096


class _State:
    lock = threading.Lock()
    reason: str | None = "not loaded yet"
    loaded = False
    lib: ctypes.CDLL | None = None
    version = 0


def _site_dirs() -> list[Path]:
    """sys.path entries, then the locations of an importable `nvidia` namespace package."""
    dirs = [Path(p) for p in sys.path if p]
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        parent = Path(location).parent
        if parent not in dirs:
            dirs.append(parent)
    return dirs


def _wheel_libraries(pattern: str) -> list[str]:
    """Files matching nvidia/<pattern> in every sys.path entry (the CUDA wheels' layout)."""
    found: list[str] = []
    for d in _site_dirs():
        found.extend(sorted(glob.glob(str(d / "nvidia" / pattern))))
    return found


def _loaded_libraries(name_prefix: str) -> list[str]:
    """Paths of already-mapped shared objects whose file name starts with name_prefix."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(name_prefix))


def _choose_cudart() -> None:
    """Points the cuDNN frontend's own libcudart loader at the runtime JAX uses.

    The frontend (dynamic loading) dlopens libcudart.so.12 or .13 by itself and takes
    the first it finds; CUDNN_FRONTEND_CUDART_LIB_NAME selects one explicitly.
    """
    if os.environ.get("CUDNN_FRONTEND_CUDART_LIB_NAME"):
        return
    candidates = (_loaded_libraries("libcudart.so.13") + _loaded_libraries("libcudart.so.12")
                  + _wheel_libraries("cu13/lib/libcudart.so.13")
                  + _wheel_libraries("cuda_runtime/lib/libcudart.so.1*"))
    for path in candidates:
        if os.path.isfile(path):
            os.environ["CUDNN_FRONTEND_CUDART_LIB_NAME"] = path
            return


def _load() -> str | None:
    if not _library._has_jax_backend("CUDA"):
        return "jax has no CUDA backend in this process"
    path = _library.library_path(LIBRARY_STEM)
    if path is None:
        return ("the cuDNN backend library was not built (lib" + LIBRARY_STEM + " not found: it "
                "needs nvcc and the headers of the nvidia-cudnn-frontend and nvidia-cudnn-cu13 "
                "wheels at install time); pip install nvidia-cudnn-frontend nvidia-cudnn-cu13, "
                "then reinstall fusedattn")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        return f"could not load {path}: {error}"
    lib.FusedattnCudnnLoad.restype = ctypes.c_int64
    lib.FusedattnCudnnLoad.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64]
    lib.FusedattnCudnnCheck.restype = ctypes.c_int64
    lib.FusedattnCudnnCheck.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                                        ctypes.c_float, ctypes.c_float, ctypes.c_int64,
                                        ctypes.c_char_p, ctypes.c_int64]
    lib.FusedattnCudnnWorkspace.restype = ctypes.c_int64
    lib.FusedattnCudnnWorkspace.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                                            ctypes.c_float, ctypes.c_float, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_char_p,
                                            ctypes.c_int64]
    _choose_cudart()
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    version = lib.FusedattnCudnnLoad(None, message, _MESSAGE_BYTES)
    errors = [message.value.decode(errors="replace")]
    if not version:
        for candidate in _wheel_libraries("cudnn/lib/libcudnn.so.9"):
            version = lib.FusedattnCudnnLoad(candidate.encode(), message, _MESSAGE_BYTES)
            if version:
                break
            errors.append(message.value.decode(errors="replace"))
    if not version:
        return "could not load libcudnn: " + "; ".join(errors)
    try:
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="CUDA")
    except (AttributeError, ValueError, RuntimeError) as error:
        return f"could not register the handlers of {path}: {error}"
    _State.lib, _State.version = lib, int(version)
    return None


def available() -> str | None:
    """None when the cuDNN backend library and libcudnn are loaded, else why not."""
    with _State.lock:
        if not _State.loaded:
            _State.reason = _load()
            _State.loaded = True
        return _State.reason


def cudnn_version() -> int:
    """cuDNN's version as loaded (e.g. 91000 for 9.10.0); 0 when not loaded."""
    return _State.version if available() is None else 0


def version_string(version: int) -> str:
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


@functools.lru_cache(maxsize=4096)
def check(params: tuple[int, ...], scale: float, dropout: float, device: int) -> str | None:
    """Builds the forward and backward graphs (cached in the library); None or cuDNN's reason."""
    values = (ctypes.c_int64 * len(params))(*params)
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    ok = _State.lib.FusedattnCudnnCheck(values, len(params), scale, dropout, device, message,
                                        _MESSAGE_BYTES)
    return None if ok else message.value.decode(errors="replace")


@functools.lru_cache(maxsize=4096)
def workspace_bytes(params: tuple[int, ...], scale: float, dropout: float, inference: bool,
                     backward: bool, device: int) -> int:
    """The workspace bytes of one FFI call (its graph built and cached in the library)."""
    values = (ctypes.c_int64 * len(params))(*params)
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    size = _State.lib.FusedattnCudnnWorkspace(values, len(params), scale, dropout, int(inference),
                                              int(backward), device, message, _MESSAGE_BYTES)
    if size < 0:
        raise RuntimeError(f"cudnn: cannot size the call's workspace: "
                           f"{message.value.decode(errors='replace')}. Set config.backend to "
                           f"'flash' or 'xla' for this call.")
    return size
