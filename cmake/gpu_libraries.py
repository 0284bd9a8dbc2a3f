"""Configure-time probes of CMakeLists.txt: which GPU op libraries to build, where the headers are.

Run by CMake with the build's interpreter (no fusedattn import, standard library only):

    python cmake/gpu_libraries.py decide --cuda SETTING --rocm SETTING --out FILE.cmake
    python cmake/gpu_libraries.py ffi-headers
    python cmake/gpu_libraries.py cudnn-headers
    python cmake/gpu_libraries.py cutlass-headers

`decide` writes a CMake file of set() commands (FUSEDATTN_BUILD_CUDA / _ROCM ON or OFF,
FUSEDATTN_CUDA_FORCED / _ROCM_FORCED, FUSEDATTN_GPU_LIBRARIES_STATUS: one line saying what
is built, what is skipped, why, and how to force it). Each platform's setting is ON (build
it; CMake stops if its compiler is missing), OFF (skip it) or AUTO (the default): taken from
-DFUSEDATTN_ENABLE_CUDA / -DFUSEDATTN_ENABLE_ROCM, and where that is AUTO from the
environment variable FUSEDATTN_GPU_LIBRARIES (all = ON, none = OFF, auto = AUTO).
AUTO builds a platform's library where it can be used: a JAX plugin of that platform in
the environment being installed into, or a GPU of that platform on this machine.

Packages are found by path, not by import: pip's build isolation runs the build with a
sys.path that hides the target environment's packages, but sysconfig still names its
site-packages. `ffi-headers` prints jaxlib's include folder (what jax.ffi.include_dir()
names: xla/ffi/api/ffi.h and the headers it includes), from the build's own packages (pip's
build isolation installed jaxlib there) or else the target environment's (an empty line
where neither has it); build_backend.py asks pip for jaxlib only in that last case.
`cudnn-headers` prints the folder of cudnn_frontend.h and of cuDNN's cudnn.h
(an empty line where not found), searched the same way; `cutlass-headers` the include folder
of the nvidia-cutlass wheel (cutlass_library/source/include, holding cute/ and cutlass/).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from typing import Callable, Sequence

PLATFORMS = ("CUDA", "ROCM")
ENV_VARIABLE = "FUSEDATTN_GPU_LIBRARIES"
_ENV_SETTINGS = {"all": "ON", "none": "OFF", "auto": "AUTO"}
_TRUE = {"ON", "1", "TRUE", "YES", "Y"}
_FALSE = {"OFF", "0", "FALSE", "NO", "N", ""}

# Per platform: the JAX plugin packages (jax[cuda12] installs jax_cuda12_plugin and
# jax_plugins/xla_cuda12), the GPU's device files and the tool that lists its GPUs.
_PLUGIN_PATTERNS = {
    "CUDA": ("jax_cuda*_plugin", os.path.join("jax_plugins", "xla_cuda*")),
    "ROCM": ("jax_rocm*_plugin", os.path.join("jax_plugins", "xla_rocm*")),
}
_DEVICE_FILES = {"CUDA": ("/dev/nvidia0",), "ROCM": ("/dev/kfd",)}
_GPU_LISTERS = {
    # (command, a line of its output that names a GPU)
    "CUDA": (("nvidia-smi", "-L"), re.compile(r"^GPU \d+:")),
    "ROCM": (("rocminfo",), re.compile(r"^\s*Name:\s+gfx\w+")),
}
_VENDOR = {"CUDA": "NVIDIA", "ROCM": "AMD"}
_LABEL = {"CUDA": "CUDA", "ROCM": "ROCm"}
_SKIPPED = {"CUDA": "CUDA and cuDNN libraries", "ROCM": "ROCm library"}


class SettingError(ValueError):
    """A setting that is none of the accepted values."""


def site_roots() -> list[str]:
    """Every folder the target environment's packages may live in, the build's sys.path first."""
    roots = [p for p in sys.path if p]
    roots += [sysconfig.get_paths()[key] for key in ("purelib", "platlib")]
    try:
        roots += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # an old virtualenv's site module
        pass
    unique: list[str] = []
    for root in roots:
        if root not in unique:
            unique.append(root)
    return unique


def normalize(setting: str, source: str) -> str:
    """ON, OFF or AUTO for a -D value (any CMake boolean spelling, or AUTO)."""
    value = setting.strip().upper()
    if value == "AUTO":
        return "AUTO"
    if value in _TRUE:
        return "ON"
    if value in _FALSE:
        return "OFF"
    raise SettingError(f"{source}={setting!r}: expected ON, OFF or AUTO")


def setting_from(cmake_value: str, platform: str, environ: dict[str, str]) -> tuple[str, str]:
    """(ON/OFF/AUTO, where it came from): the -D value, else FUSEDATTN_GPU_LIBRARIES."""
    setting = normalize(cmake_value, f"-DFUSEDATTN_ENABLE_{platform}")
    if setting != "AUTO":
        return setting, f"-DFUSEDATTN_ENABLE_{platform}={setting}"
    env_value = environ.get(ENV_VARIABLE, "")
    if not env_value.strip():
        return "AUTO", "the default"
    if env_value.strip().lower() not in _ENV_SETTINGS:
        raise SettingError(f"{ENV_VARIABLE}={env_value!r}: expected one of all, auto, none")
    env_key = env_value.strip().lower()
    return _ENV_SETTINGS[env_key], f"{ENV_VARIABLE}={env_key}"


def find_plugins(platform: str, roots: Sequence[str]) -> list[str]:
    """The JAX plugin packages of `platform` in `roots`, as paths."""
    found: list[str] = []
    for root in roots:
        for pattern in _PLUGIN_PATTERNS[platform]:
            found += sorted(p for p in glob.glob(os.path.join(root, pattern)) if os.path.isdir(p))
    return found


def _run_lister(command: Sequence[str]) -> str:
    """The lister's stdout, or "" when it is absent, fails or hangs."""
    if shutil.which(command[0]) is None:
        return ""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout if result.returncode == 0 else ""


def find_gpu(platform: str, exists: Callable[[str], bool] = os.path.exists,
             run: Callable[[Sequence[str]], str] = _run_lister) -> str:
    """What shows a GPU of `platform` on this machine (a device file or a listed GPU), or ""."""
    for path in _DEVICE_FILES[platform]:
        if exists(path):
            return path
    command, names_gpu = _GPU_LISTERS[platform]
    for line in run(command).splitlines():
        if names_gpu.match(line):
            return f"{command[0]}: {line.strip()}"
    return ""


@dataclass(frozen=True)
class Decision:
    platform: str
    build: bool
    forced: bool  # the setting was ON: a missing compiler is an error
    reason: str
    source: str  # where the setting came from: "-DFUSEDATTN_ENABLE_...", the variable, the default


def decide(platform: str, cmake_value: str, environ: dict[str, str], roots: Sequence[str],
           gpu: Callable[[str], str] = find_gpu) -> Decision:
    """Whether to build `platform`'s library, and why."""
    setting, source = setting_from(cmake_value, platform, environ)
    if setting == "ON":
        return Decision(platform, True, True, f"forced by {source}", source)
    if setting == "OFF":
        return Decision(platform, False, False, f"disabled by {source}", source)
    plugins = find_plugins(platform, roots)
    if plugins:
        return Decision(platform, True, False, f"JAX plugin {plugins[0]}", source)
    device = gpu(platform)
    if device:
        return Decision(platform, True, False, f"{_VENDOR[platform]} GPU ({device})", source)
    pattern = _PLUGIN_PATTERNS[platform][0]
    return Decision(platform, False, False,
                    f"no {pattern} in the target environment and no {_VENDOR[platform]} GPU "
                    f"({_DEVICE_FILES[platform][0]}, {' '.join(_GPU_LISTERS[platform][0])})", source)


def status_line(decisions: Sequence[Decision]) -> str:
    """One line: what is built, what is skipped and why, and how to build a skipped one."""
    parts = [f"{_LABEL[d.platform]} library: building it ({d.reason})" if d.build
             else f"{_SKIPPED[d.platform]} skipped ({d.reason})" for d in decisions]
    skipped = [d for d in decisions if not d.build]
    head = "host op library only" if len(skipped) == len(decisions) else "GPU op libraries"
    line = f"fusedattn: {head}; " + "; ".join(parts)
    if skipped:
        flags = " ".join(f"-DFUSEDATTN_ENABLE_{d.platform}=ON" for d in skipped)
        line += f". To build {'them' if len(skipped) > 1 else 'it'} anyway: CMAKE_ARGS=\"{flags}\""
        # The variable counts only where -D left the setting at AUTO.
        if not any(d.source.startswith("-D") for d in skipped):
            line += f" or {ENV_VARIABLE}=all"
    return line


def _cmake_quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
    return f'"{escaped}"'


def render_cmake(decisions: Sequence[Decision]) -> str:
    """The set() commands CMakeLists.txt includes."""
    lines = []
    for d in decisions:
        lines.append(f"set(FUSEDATTN_BUILD_{d.platform} {'ON' if d.build else 'OFF'})")
        lines.append(f"set(FUSEDATTN_{d.platform}_FORCED {'ON' if d.forced else 'OFF'})")
        lines.append(f"set(FUSEDATTN_{d.platform}_REASON {_cmake_quote(d.reason)})")
    lines.append(f"set(FUSEDATTN_GPU_LIBRARIES_STATUS {_cmake_quote(status_line(decisions))})")
    return "\n".join(lines) + "\n"


def ffi_headers(roots: Sequence[str]) -> str:
    """jaxlib's include folder holding the XLA FFI headers (xla/ffi/api/ffi.h), "" where absent."""
    for root in roots:
        include = os.path.join(root, "jaxlib", "include")
        if os.path.isfile(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
            return include
    return ""


# The FFI headers' package, as the runtime dependency on jax>=0.6 bounds it.
JAXLIB_REQUIREMENT = "jaxlib>=0.6"


def ffi_headers_requirement(roots: Sequence[str]) -> list[str]:
    """The build requirement that brings the FFI headers: [JAXLIB_REQUIREMENT] where no root
    holds them (a fresh environment), else [] (build_backend.py)."""
    return [] if ffi_headers(roots) else [JAXLIB_REQUIREMENT]


def cudnn_headers(roots: Sequence[str]) -> tuple[str, str]:
    """(folder of cudnn_frontend.h, folder of nvidia/cudnn/include/cudnn.h), "" where absent."""
    def first(*parts: str) -> str:
        for root in roots:
            if os.path.isfile(os.path.join(root, *parts)):
                return os.path.join(root, *parts[:-1])
        return ""
    return first("include", "cudnn_frontend.h"), first("nvidia", "cudnn", "include", "cudnn.h")


def cutlass_headers(roots: Sequence[str]) -> str:
    """The include folder of the nvidia-cutlass wheel's CUTLASS/CuTe headers, "" where absent."""
    parts = ("cutlass_library", "source", "include")
    for root in roots:
        if os.path.isfile(os.path.join(root, *parts, "cute", "arch", "mma_sm90_gmma.hpp")):
            return os.path.join(root, *parts)
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    decide_parser = commands.add_parser("decide")
    decide_parser.add_argument("--cuda", default="AUTO")
    decide_parser.add_argument("--rocm", default="AUTO")
    decide_parser.add_argument("--out", required=True)
    commands.add_parser("ffi-headers")
    commands.add_parser("cudnn-headers")
    commands.add_parser("cutlass-headers")
    args = parser.parse_args(argv)
    roots = site_roots()
    if args.command == "ffi-headers":
        print(ffi_headers(roots))
        return 0
    if args.command == "cudnn-headers":
        print("\n".join(cudnn_headers(roots)))
        return 0
    if args.command == "cutlass-headers":
        print(cutlass_headers(roots))
        return 0
    try:
        decisions = [decide(p, value, dict(os.environ), roots)
                     for p, value in zip(PLATFORMS, (args.cuda, args.rocm))]
    except SettingError as error:
        print(f"fusedattn: {error}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as out:
        out.write(render_cmake(decisions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
