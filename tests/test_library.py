"""The compiled op libraries against the handler tables of fusedattn/ops/_library.py.

A library that was built must export every handler its platform registers, as an
XLA FFI handler JAX can take. Loading a library needs no device: the CUDA and ROCm
libraries are checked here on any machine that built them (CI builds both).
Libraries that were not built skip, unless FUSEDATTN_REQUIRE_LIBRARIES names
their platform ("cpu CUDA ROCM" in CI), where a missing library fails.
"""

from __future__ import annotations

import ctypes
import os

import jax
import pytest

from fusedattn.ops import _library

REQUIRED = set(os.environ.get("FUSEDATTN_REQUIRE_LIBRARIES", "cpu").replace(",", " ").split())


@pytest.mark.parametrize("platform", sorted(_library._LIBRARIES))
def test_built_library_exports_every_handler_of_its_platform(platform):
    stem, targets, _ = _library._LIBRARIES[platform]
    path = _library.library_path(stem)
    if path is None:
        assert platform not in REQUIRED, f"lib{stem} was not built (FUSEDATTN_REQUIRE_LIBRARIES)"
        pytest.skip(f"lib{stem} was not built on this machine")
    library = ctypes.CDLL(str(path))
    for target, symbol in targets.items():
        handler = getattr(library, symbol, None)
        assert handler is not None, f"{path.name} lacks {symbol} (FFI target {target})"
        assert type(jax.ffi.pycapsule(handler)).__name__ == "PyCapsule"


def test_unbuilt_library_names_the_missing_compiler(monkeypatch):
    monkeypatch.setattr(_library, "library_path", lambda stem: None)
    monkeypatch.setattr(_library, "_has_jax_backend", lambda platform: True)
    assert "no hipcc was found" in _library._load("ROCM")
    assert "no nvcc was found" in _library._load("CUDA")
    assert "host library was not built" in _library._load("cpu")
