"""Which GPU op libraries an install builds (cmake/gpu_libraries.py, run by CMakeLists.txt).

The decision: a JAX plugin of the platform in the target environment, or a GPU of the
platform on the machine, builds it (AUTO); -DFUSEDATTN_ENABLE_<P>=ON/OFF forces either way;
FUSEDATTN_GPU_LIBRARIES=all|auto|none applies where the -D setting is AUTO. The last tests
configure the project with CMake itself (skipped where no cmake is on the PATH). Also the
other configure-time probes (the FFI, cuDNN and CUTLASS headers) and the build backend that
asks pip for jaxlib only where the build sees no FFI headers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_libraries", ROOT / "cmake" / "gpu_libraries.py")
gpu_libraries = importlib.util.module_from_spec(_spec)
sys.modules["gpu_libraries"] = gpu_libraries  # dataclasses look their module up there
_spec.loader.exec_module(gpu_libraries)


def no_gpu(platform):
    return ""


def gpu_of(which):
    return lambda platform: f"/dev/{which}" if platform == which else ""


@pytest.fixture
def empty_site(tmp_path):
    site = tmp_path / "site-packages"
    (site / "jax").mkdir(parents=True)
    (site / "jaxlib").mkdir()
    return site


@pytest.mark.parametrize("platform,package", [
    ("CUDA", "jax_cuda12_plugin"), ("CUDA", "jax_cuda13_plugin"),
    ("CUDA", os.path.join("jax_plugins", "xla_cuda12")),
    ("ROCM", "jax_rocm60_plugin"), ("ROCM", os.path.join("jax_plugins", "xla_rocm7")),
])
def test_a_plugin_in_the_target_environment_builds_its_platform(empty_site, platform, package):
    (empty_site / package).mkdir(parents=True)
    roots = ["/nonexistent", str(empty_site)]
    built = gpu_libraries.decide(platform, "AUTO", {}, roots, gpu=no_gpu)
    assert built.build and not built.forced
    assert str(empty_site / package) in built.reason
    other = "ROCM" if platform == "CUDA" else "CUDA"
    assert not gpu_libraries.decide(other, "AUTO", {}, roots, gpu=no_gpu).build


@pytest.mark.parametrize("platform", ["CUDA", "ROCM"])
def test_a_gpu_on_the_machine_builds_its_platform(empty_site, platform):
    decision = gpu_libraries.decide(platform, "AUTO", {}, [str(empty_site)], gpu=gpu_of(platform))
    assert decision.build and not decision.forced
    assert "GPU" in decision.reason and f"/dev/{platform}" in decision.reason


def test_neither_plugin_nor_gpu_builds_the_host_library_only_and_says_how_to_force(empty_site):
    decisions = [gpu_libraries.decide(p, "AUTO", {}, [str(empty_site)], gpu=no_gpu)
                 for p in gpu_libraries.PLATFORMS]
    assert [d.build for d in decisions] == [False, False]
    line = gpu_libraries.status_line(decisions)
    assert "\n" not in line
    assert line.startswith("fusedattn: host op library only")
    assert "no jax_cuda*_plugin" in line and "no NVIDIA GPU" in line
    assert "no jax_rocm*_plugin" in line and "no AMD GPU" in line
    assert '-DFUSEDATTN_ENABLE_CUDA=ON -DFUSEDATTN_ENABLE_ROCM=ON' in line
    assert "FUSEDATTN_GPU_LIBRARIES=all" in line


@pytest.mark.parametrize("cmake_value,environ", [
    ("ON", {}), ("on", {}), ("1", {}), ("TRUE", {}), ("AUTO", {"FUSEDATTN_GPU_LIBRARIES": "all"}),
    ("ON", {"FUSEDATTN_GPU_LIBRARIES": "none"}),   # -D wins over the variable
])
def test_forced_on_builds_without_plugin_or_gpu(empty_site, cmake_value, environ):
    decision = gpu_libraries.decide("CUDA", cmake_value, environ, [str(empty_site)], gpu=no_gpu)
    assert decision.build and decision.forced
    assert decision.reason.startswith("forced by")


@pytest.mark.parametrize("cmake_value,environ", [
    ("OFF", {}), ("0", {}), ("no", {}), ("AUTO", {"FUSEDATTN_GPU_LIBRARIES": "none"}),
    ("OFF", {"FUSEDATTN_GPU_LIBRARIES": "all"}),
])
def test_forced_off_skips_despite_plugin_and_gpu(empty_site, cmake_value, environ):
    (empty_site / "jax_cuda12_plugin").mkdir()
    decision = gpu_libraries.decide("CUDA", cmake_value, environ, [str(empty_site)],
                                    gpu=gpu_of("CUDA"))
    assert not decision.build and not decision.forced
    assert decision.reason.startswith("disabled by")


def test_auto_in_the_variable_detects(empty_site):
    environ = {"FUSEDATTN_GPU_LIBRARIES": " Auto "}
    assert not gpu_libraries.decide("CUDA", "AUTO", environ, [str(empty_site)], gpu=no_gpu).build
    assert gpu_libraries.decide("CUDA", "AUTO", environ, [str(empty_site)], gpu=gpu_of("CUDA")).build


def test_a_skip_forced_by_cmake_does_not_offer_the_variable(empty_site):
    decisions = [gpu_libraries.decide("CUDA", "AUTO", {"FUSEDATTN_GPU_LIBRARIES": "all"},
                                      [str(empty_site)], gpu=no_gpu),
                 gpu_libraries.decide("ROCM", "OFF", {}, [str(empty_site)], gpu=no_gpu)]
    line = gpu_libraries.status_line(decisions)
    assert line.startswith("fusedattn: GPU op libraries; CUDA library: building it")
    assert line.endswith('To build it anyway: CMAKE_ARGS="-DFUSEDATTN_ENABLE_ROCM=ON"')


@pytest.mark.parametrize("cmake_value,environ,named", [
    ("maybe", {}, "-DFUSEDATTN_ENABLE_CUDA='maybe'"),
    ("AUTO", {"FUSEDATTN_GPU_LIBRARIES": "cuda"}, "FUSEDATTN_GPU_LIBRARIES='cuda'"),
])
def test_a_bad_setting_raises_naming_it_and_the_accepted_values(empty_site, cmake_value, environ, named):
    with pytest.raises(gpu_libraries.SettingError) as error:
        gpu_libraries.decide("CUDA", cmake_value, environ, [str(empty_site)], gpu=no_gpu)
    assert named in str(error.value)
    assert "expected" in str(error.value)


def test_gpu_listers_need_a_listed_gpu():
    never = lambda path: False  # noqa: E731
    assert gpu_libraries.find_gpu("CUDA", exists=never, run=lambda c: "") == ""
    listed = "GPU 0: NVIDIA H200 (UUID: GPU-1234)\n"
    assert "GPU 0: NVIDIA H200" in gpu_libraries.find_gpu("CUDA", exists=never, run=lambda c: listed)
    cpu_only = "Agent 1\n  Name:                    AMD EPYC 7763\n"
    assert gpu_libraries.find_gpu("ROCM", exists=never, run=lambda c: cpu_only) == ""
    with_gpu = cpu_only + "Agent 2\n  Name:                    gfx90a\n"
    assert "gfx90a" in gpu_libraries.find_gpu("ROCM", exists=never, run=lambda c: with_gpu)
    assert gpu_libraries.find_gpu("ROCM", exists=lambda p: p == "/dev/kfd", run=lambda c: "") == "/dev/kfd"


def test_cudnn_headers_are_found_in_any_root(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    (first / "include").mkdir(parents=True)
    (first / "include" / "cudnn_frontend.h").write_text("")
    (second / "nvidia" / "cudnn" / "include").mkdir(parents=True)
    (second / "nvidia" / "cudnn" / "include" / "cudnn.h").write_text("")
    assert gpu_libraries.cudnn_headers([str(first), str(second)]) == (
        str(first / "include"), str(second / "nvidia" / "cudnn" / "include"))
    assert gpu_libraries.cudnn_headers([str(tmp_path / "none")]) == ("", "")


def _ffi_root(root: Path) -> Path:
    """root with jaxlib's FFI headers, as a jaxlib wheel installs them; returns the include."""
    api = root / "jaxlib" / "include" / "xla" / "ffi" / "api"
    api.mkdir(parents=True)
    (api / "ffi.h").write_text("")
    return root / "jaxlib" / "include"


def test_ffi_headers_are_found_in_any_root_and_jaxlib_is_asked_for_only_without_them(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    (first / "jaxlib" / "include").mkdir(parents=True)  # a jaxlib without the headers
    include = _ffi_root(second)
    assert gpu_libraries.ffi_headers([str(first), str(second)]) == str(include)
    assert gpu_libraries.ffi_headers([str(first)]) == ""
    assert gpu_libraries.ffi_headers_requirement([str(first), str(second)]) == []
    assert gpu_libraries.ffi_headers_requirement([str(first)]) == ["jaxlib>=0.6"]


def test_the_build_backend_adds_jaxlib_to_scikit_build_cores_requirements(monkeypatch, tmp_path):
    """cmake/build_backend.py over a stand-in scikit_build_core.build (not installed outside
    pip's build environment): its own hooks pass through, the two get_requires hooks add
    jaxlib where the build sees no FFI headers."""
    scikit_build = types.ModuleType("scikit_build_core.build")
    for hook in ("build_editable", "build_sdist", "build_wheel", "get_requires_for_build_sdist",
                 "prepare_metadata_for_build_editable", "prepare_metadata_for_build_wheel"):
        setattr(scikit_build, hook, lambda *args, _name=hook, **kw: _name)
    scikit_build.get_requires_for_build_wheel = lambda settings=None: ["ninja"]
    scikit_build.get_requires_for_build_editable = lambda settings=None: ["cmake>=3.24"]
    package = types.ModuleType("scikit_build_core")
    package.build = scikit_build
    monkeypatch.setitem(sys.modules, "scikit_build_core", package)
    monkeypatch.setitem(sys.modules, "scikit_build_core.build", scikit_build)
    spec = importlib.util.spec_from_file_location("build_backend", ROOT / "cmake" / "build_backend.py")
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    assert backend.build_editable("out") == "build_editable"
    assert backend.get_requires_for_build_sdist() == "get_requires_for_build_sdist"
    monkeypatch.setattr(gpu_libraries, "site_roots", lambda: [str(tmp_path / "empty")])
    assert backend.get_requires_for_build_wheel() == ["ninja", "jaxlib>=0.6"]
    assert backend.get_requires_for_build_editable() == ["cmake>=3.24", "jaxlib>=0.6"]
    _ffi_root(tmp_path / "env")
    monkeypatch.setattr(gpu_libraries, "site_roots", lambda: [str(tmp_path / "env")])
    assert backend.get_requires_for_build_wheel() == ["ninja"]
    assert backend.get_requires_for_build_editable() == ["cmake>=3.24"]


def test_cutlass_headers_are_found_in_any_root(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    (first / "cutlass_library").mkdir(parents=True)  # a wheel without the headers
    include = second / "cutlass_library" / "source" / "include"
    (include / "cute" / "arch").mkdir(parents=True)
    (include / "cute" / "arch" / "mma_sm90_gmma.hpp").write_text("")
    assert gpu_libraries.cutlass_headers([str(first), str(second)]) == str(include)
    assert gpu_libraries.cutlass_headers([str(first)]) == ""


def test_the_rendered_cmake_quotes_the_reasons():
    decision = gpu_libraries.Decision("CUDA", False, False, 'a "quoted" $path\\x', "the default")
    text = gpu_libraries.render_cmake([decision])
    assert 'set(FUSEDATTN_BUILD_CUDA OFF)' in text
    assert 'set(FUSEDATTN_CUDA_REASON "a \\"quoted\\" \\$path\\\\x")' in text


# ---- the project's own configure -----------------------------------------------------------

def _configure(tmp_path, *args, env=None):
    environ = {k: v for k, v in os.environ.items() if k != "FUSEDATTN_GPU_LIBRARIES"}
    environ.update(env or {})
    return subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"),
                           f"-DPython_EXECUTABLE={sys.executable}", *args],
                          capture_output=True, text=True, env=environ, timeout=300, check=False)


needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake on the PATH")


@needs_cmake
def test_configure_prints_one_status_line_and_reads_the_setting_afresh(tmp_path):
    skipped = _configure(tmp_path, env={"FUSEDATTN_GPU_LIBRARIES": "none"})
    assert skipped.returncode == 0, skipped.stderr
    lines = [l for l in skipped.stdout.splitlines() if "host op library only" in l]
    assert len(lines) == 1
    assert "disabled by FUSEDATTN_GPU_LIBRARIES=none" in lines[0]
    assert "building the CUDA op library" not in skipped.stdout
    # ON is not remembered: the next configure without -D is AUTO again.
    nvcc_missing = _configure(tmp_path, "-DFUSEDATTN_ENABLE_CUDA=ON", "-DFUSEDATTN_ENABLE_ROCM=OFF",
                              env={"CUDACXX": "/nonexistent/nvcc"})
    assert nvcc_missing.returncode != 0
    assert ("the CUDA library was asked for (forced by -DFUSEDATTN_ENABLE_CUDA=ON) but no CUDA "
            "compiler (nvcc) was found") in " ".join(nvcc_missing.stderr.split())
    again = _configure(tmp_path, "-DFUSEDATTN_ENABLE_ROCM=OFF",
                       env={"CUDACXX": "/nonexistent/nvcc", "FUSEDATTN_GPU_LIBRARIES": "auto"})
    assert again.returncode == 0, again.stderr
    expected_cuda = "CUDA library: building it" if _machine_can_use("CUDA") else \
        "CUDA and cuDNN libraries skipped"
    assert expected_cuda in again.stdout


def _machine_can_use(platform):
    decision = gpu_libraries.decide(platform, "AUTO", {}, gpu_libraries.site_roots())
    return decision.build


@needs_cmake
def test_configure_fails_on_a_bad_variable(tmp_path):
    bad = _configure(tmp_path, env={"FUSEDATTN_GPU_LIBRARIES": "some"})
    assert bad.returncode != 0
    assert "FUSEDATTN_GPU_LIBRARIES='some': expected one of all, auto, none" in bad.stderr
