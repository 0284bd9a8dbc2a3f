#!/usr/bin/env bash
# Debug helper (GPU machine): builds only libfusedattn_cudnn into /tmp/b with the
# device's headers and runs one graph check with FUSEDATTN_CUDNN_TRACE=1, then
# symbolizes a native crash stack.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
cat > /tmp/dbg.py <<'PY'
import jax
from fusedattn.ops.backends import cudnn
print(cudnn.available(), cudnn.cudnn_version(), cudnn._library.library_path("fusedattn_cudnn"), flush=True)
p = (2, 4, 4, 64, 64, 64, 64, 1, 1, 0, -1, -1, 0, 0, 0, 0, 0)
print(cudnn._check(p, 0.125, 0.0, 0), flush=True)
PY
g++ --version | head -1
src=$PWD
rm -rf /tmp/b && mkdir /tmp/b && cd /tmp/b && cmake "$src" -G Ninja -DFUSEDATTN_CUDA_ARCHS=90 -DCMAKE_CXX_FLAGS=-g1 ${EXTRA:-} > cmake.log 2>&1 && ninja fusedattn_cudnn > ninja.log 2>&1 || { tail -30 cmake.log ninja.log; exit 1; }
grep -i "cudnn\|nvrtc" cmake.log
cd "$src"
FUSEDATTN_LIB_DIR=/tmp/b FUSEDATTN_CUDNN_TRACE=1 timeout 120 python3 /tmp/dbg.py > /tmp/dbg.log 2>&1
grep -v "^\[cudnn_frontend\]\|^===\|^Tag\|^$" /tmp/dbg.log | tail -45
grep -o "libfusedattn_cudnn.so+0x[0-9a-f]*" /tmp/dbg.log | sed 's/.*+//' | head -25 | xargs -r addr2line -f -C -i -e /tmp/b/libfusedattn_cudnn.so | paste - - | cut -c1-250 | head -40
