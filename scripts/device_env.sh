# Sourced by the GPU machine's scripts that run after scripts/device.sh built the tree: the
# repository root as working directory, $OUT (results) and $LOGS, and the wheels device.sh
# installed under /tmp/site on the Python path.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/fusedattn-out}
LOGS=${LOGS:-/tmp/device-logs}
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
