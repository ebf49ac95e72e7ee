#!/usr/bin/env bash
# One device call for two GPU checks: the MoE stage's memory (bench/gpu/moe_stage_memory.py) in the
# background, each in its own site dir and $OUT folder, while make test-gpu-ranks runs in front
# (its time is then an upper bound, the GPU and cores being shared with the MoE run):
#   bash bench/gpu/run_ranks_and_moe.sh [RANKS_TIMEOUT_S] [MOE_TIMEOUT_S] [PYTEST_ARGS...]   # carry: .whl
OUT=${OUT:-out/gpu}; RANKS_LIMIT=${1:-480}; MOE_LIMIT=${2:-400}; shift $(( $# > 2 ? 2 : $# )); mkdir -p "$OUT/ranks" "$OUT/moe"
OUT=$OUT/moe SITE=/tmp/site_moe bash bench/gpu/run_moe_stage_memory.sh "$MOE_LIMIT" > "$OUT/moe/stdout.txt" 2>&1 &
MOE=$!
OUT=$OUT/ranks SITE=/tmp/site_ranks bash bench/gpu/run_gpu_ranks.sh "$RANKS_LIMIT" "$@"
wait "$MOE"; echo "moe: $(tail -n 1 "$OUT/moe/stdout.txt")"
tail -n 30 "$OUT/moe/stdout.txt"
