#!/usr/bin/env bash
# The GPU suite's Transformer Engine cases (pytest markers te and fp8) on a node where
# docker/te_offline/te_node_setup.sh installed TE, megatron-core and emerging-optimizers into
# $SITE (/tmp/site). Report and log in $OUT:
#   bash docker/te_offline/run_te_gpu_tests.sh [TIMEOUT_S] [PYTEST_ARGS...]      # e.g. 280 -k "interleaving or loop"
set -o pipefail
OUT=${OUT:-out/gpu}; SITE=${SITE:-/tmp/site}; LIMIT=${1:-480}; shift $(( $# > 0 ))
mkdir -p "$OUT"
ls "$SITE"/transformer_engine/wheel_lib/transformer_engine_torch*.so > /dev/null 2>&1 || {
  echo "run_te_gpu_tests: error: no Transformer Engine in $SITE: run docker/te_offline/te_node_setup.sh first" \
       "(docs/cluster.md), or set SITE to the folder it installed into" >&2; exit 2; }
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
ARGS="-m 'te or fp8' -v -rs --durations=20 -p no:cacheprovider"
for a in "$@"; do ARGS+=" '${a//\'/\'\\\'\'}'"; done
timeout "$LIMIT" make test-gpu GPU_REPORT="$OUT" PYTEST_ARGS="$ARGS" 2>&1 | tee "$OUT/log.txt"
echo "rc=$?"
