"""The build backend of pyproject.toml: scikit-build-core's, asking pip for jaxlib only when
the build needs it.

The compiled op set includes jaxlib's XLA FFI headers (gpu_libraries.py ffi-headers). Under
pip's build isolation a static build requirement on jax would install jax, jaxlib, scipy and
numpy (about 500 MB) into a throwaway environment at every `pip install`, also into an
environment that holds jaxlib already. So the wheel and editable builds ask for jaxlib only
where neither the build's own packages nor the target environment's hold its headers (a
fresh environment); otherwise CMake reads the target environment's, the jaxlib that will
load the library. Everything else is scikit-build-core's.
"""

from __future__ import annotations

from scikit_build_core import build as _scikit_build

import gpu_libraries

build_editable = _scikit_build.build_editable
build_sdist = _scikit_build.build_sdist
build_wheel = _scikit_build.build_wheel
get_requires_for_build_sdist = _scikit_build.get_requires_for_build_sdist
prepare_metadata_for_build_editable = _scikit_build.prepare_metadata_for_build_editable
prepare_metadata_for_build_wheel = _scikit_build.prepare_metadata_for_build_wheel


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return (_scikit_build.get_requires_for_build_wheel(config_settings)
            + gpu_libraries.ffi_headers_requirement(gpu_libraries.site_roots()))


def get_requires_for_build_editable(config_settings=None) -> list[str]:
    return (_scikit_build.get_requires_for_build_editable(config_settings)
            + gpu_libraries.ffi_headers_requirement(gpu_libraries.site_roots()))
