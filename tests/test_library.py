"""The compiled op libraries against the handler tables of fusedattn/ops/_library.py.

A library that was built must load and register, with JAX, every handler of its
platform (each symbol resolved and taken as an XLA FFI handler). That needs no
device: the CUDA and ROCm libraries are checked on any machine that built them
(CI builds both).
Libraries that were not built skip, unless FUSEDATTN_REQUIRE_LIBRARIES names
their platform ("cpu CUDA ROCM" in CI), where a missing library fails.
"""

from __future__ import annotations

import os

import pytest

from fusedattn.ops import _library

REQUIRED = set(os.environ.get("FUSEDATTN_REQUIRE_LIBRARIES", "cpu").replace(",", " ").split())


@pytest.mark.parametrize("platform", sorted(_library._LIBRARIES))
def test_built_library_registers_every_handler_of_its_platform(platform, monkeypatch):
    stem, _, _ = _library._LIBRARIES[platform]
    if _library.library_path(stem) is None:
        assert platform not in REQUIRED, f"lib{stem} was not built (FUSEDATTN_REQUIRE_LIBRARIES)"
        pytest.skip(f"lib{stem} was not built on this machine")
    # JAX keeps registrations for a platform it has no backend for until one appears.
    monkeypatch.setattr(_library, "_has_jax_backend", lambda platform: True)
    assert _library._load(platform) is None


def test_unbuilt_library_names_the_missing_compiler(monkeypatch):
    monkeypatch.setattr(_library, "library_path", lambda stem: None)
    monkeypatch.setattr(_library, "_has_jax_backend", lambda platform: True)
    assert "no hipcc was found" in _library._load("ROCM")
    assert "no nvcc was found" in _library._load("CUDA")
    assert "host library was not built" in _library._load("cpu")


def test_rocm_library_holds_the_flash_kernels(monkeypatch):
    """The ROCm library's flash handlers (fusedattn_flash_fwd/bwd under ROCM) and their head dims:
    those of FUSEDATTN_FLASH_HEAD_DIMS it can build (64, 128; never 256)."""
    assert _library.ROCM_TARGETS["fusedattn_flash_fwd"] == "FusedattnFlashFwdRocm"
    assert _library.ROCM_TARGETS["fusedattn_flash_bwd"] == "FusedattnFlashBwdRocm"
    if _library.library_path("fusedattn_rocm") is None:
        assert "ROCM" not in REQUIRED, "libfusedattn_rocm was not built (FUSEDATTN_REQUIRE_LIBRARIES)"
        pytest.skip("libfusedattn_rocm was not built on this machine")
    monkeypatch.setattr(_library, "_has_jax_backend", lambda platform: True)
    assert _library._load("ROCM") is None
    monkeypatch.setattr(_library, "available", lambda platform: None)
    head_dims = _library.flash_head_dims("rocm")
    assert head_dims and head_dims <= {64, 128}, head_dims
