#!/usr/bin/env bash
# Sets up a virtual environment in .venv, installs fusedattn with its test
# extras (building the compiled op set), and runs the test suite.
# GPU tests are marked and skip on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Headers only, for compiling the cuDNN backend (libcudnn itself is loaded at run time) and
# the sm_90 flash kernels (CUTLASS/CuTe).
python -m pip install -q --no-deps nvidia-cudnn-frontend nvidia-cudnn-cu13 nvidia-cutlass
# jax first: the build then reads jaxlib's FFI headers from .venv instead of installing jaxlib,
# scipy and numpy into pip's isolated build environment too (docs/architecture.md#builds).
python -m pip install -q jax
python -m pip install -q -e ".[test]"
# One test process per core, at most four (each holds its own JAX runtime); a test file
# stays in one process, so the computations its tests share compile once.
workers=$(python -c "import os; print(min(4, os.cpu_count() or 1))")
set +e
python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile "$@"
status=$?
set -e
# pytest exit 5 means "no tests collected": a broken suite, not a pass.
if [ "$status" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$status"
