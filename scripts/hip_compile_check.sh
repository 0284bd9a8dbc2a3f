#!/usr/bin/env bash
# Compile check of the ROCm build: the portable device sources (CUDA and HIP
# from one source, see ops_cuda/include/fusedattn/gpu_runtime.h) through
# Debian's hipcc for AMD CDNA targets. Installs hipcc with apt when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v hipcc >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc >/dev/null
fi
ffi_include=$(python -c "import jax.ffi; print(jax.ffi.include_dir())")
for source in ops_cuda/cuda/small_seq.cu; do
  HIP_PLATFORM=amd hipcc -x hip -std=c++17 -O3 -fPIC --offload-arch=gfx90a --offload-arch=gfx940 \
    -Iops_cuda/include -I"$ffi_include" -c "$source" -o "/tmp/$(basename "$source").hip.o"
  echo "hipcc compile check ok: $source"
done
