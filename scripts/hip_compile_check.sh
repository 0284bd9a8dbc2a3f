#!/usr/bin/env bash
# Compile check of the ROCm build: the portable device sources (CUDA and HIP
# from one source, see ops_cuda/include/fusedattn/gpu_runtime.h) through
# Debian's hipcc for AMD CDNA targets. Installs hipcc with apt when missing.
# Each target compiles in a process of its own, side by side: hipcc handles the
# offload targets of one call one after another, and CI has two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v hipcc >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc >/dev/null
fi
ffi_include=$(python -c "import jax.ffi; print(jax.ffi.include_dir())")
for source in ops_cuda/cuda/small_seq.cu; do
  pids=()
  for arch in gfx90a gfx940; do
    HIP_PLATFORM=amd hipcc -x hip -std=c++17 -O3 -fPIC --offload-arch="$arch" \
      -Iops_cuda/include -I"$ffi_include" -c "$source" -o "/tmp/$(basename "$source").$arch.hip.o" &
    pids+=("$!")
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: a failed compile fails the check
  echo "hipcc compile check ok: $source (gfx90a, gfx940)"
done
