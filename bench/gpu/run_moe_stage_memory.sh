#!/usr/bin/env bash
# Device command for the 10B MoE stage's memory check (bench/gpu/moe_stage_memory.py), with the wheels carried
# in .whl/ (megatron-core 0.19.2, emerging-optimizers 0.3.0); results in $OUT:
#   bash bench/gpu/run_moe_stage_memory.sh [TIMEOUT_S] [ARGS for moe_stage_memory...]
set -o pipefail
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"; LIMIT=${1:-420}; shift $(( $# > 0 ))
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${SITE:=/tmp/site}" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys,torch,megatron.core as m;print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda, 'mcore', m.__version__)"
} > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
timeout "$LIMIT" python3 -m bench.gpu.moe_stage_memory --json "$OUT/moe_stage_memory.json" "$@" 2>&1 | tee "$OUT/log.txt"
echo "rc=$?"
