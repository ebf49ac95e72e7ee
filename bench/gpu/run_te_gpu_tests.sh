#!/usr/bin/env bash
# The GPU suite's Transformer Engine cases (pytest markers te and fp8), in a device call after
# bench/gpu/te_device_setup.sh on the same warm machine: nothing to carry, TE, megatron-core and
# emerging-optimizers are in $SITE (/tmp/site) from the setup. Report and log in $OUT:
#   bash bench/gpu/run_te_gpu_tests.sh [TIMEOUT_S] [PYTEST_ARGS...]      # e.g. 280 -k "interleaving or loop"
set -o pipefail
OUT=${OUT:-out/gpu}; SITE=${SITE:-/tmp/site}; LIMIT=${1:-480}; shift $(( $# > 0 ))
mkdir -p "$OUT"
ls "$SITE"/transformer_engine/wheel_lib/transformer_engine_torch*.so > /dev/null 2>&1 || {
  echo "run_te_gpu_tests: error: no Transformer Engine in $SITE: run bench/gpu/te_device_setup.sh first" \
       "(docs/gpu_te.md); a machine given back loses /tmp" >&2; exit 2; }
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
ARGS="-m 'te or fp8' -v -rs --durations=20 -p no:cacheprovider"
for a in "$@"; do ARGS+=" '${a//\'/\'\\\'\'}'"; done
timeout "$LIMIT" make test-gpu GPU_REPORT="$OUT" PYTEST_ARGS="$ARGS" 2>&1 | tee "$OUT/log.txt"
echo "rc=$?"
