#!/usr/bin/env bash
# Device command for make test-gpu-ranks (several NCCL ranks on one GPU),
# with the wheels carried in .whl/ (megatron-core 0.19.2, emerging-optimizers 0.3.0); the
# report (ranks.json, rewritten after each case) and the log in $OUT:
#   bash bench/gpu/run_gpu_ranks.sh [TIMEOUT_S] [PYTEST_ARGS...]
# e.g. `bash bench/gpu/run_gpu_ranks.sh 200 -k "empty and syncs"` for one case.
set -o pipefail
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"; LIMIT=${1:-480}; shift $(( $# > 0 ))
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${SITE:=/tmp/site}" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc
  python3 -c "import sys,torch,megatron.core as m;print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'mcore', m.__version__)"
} > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
ARGS="-rs --durations=20 -p no:cacheprovider"
for a in "$@"; do ARGS+=" '${a//\'/\'\\\'\'}'"; done
timeout "$LIMIT" make test-gpu-ranks GPU_REPORT="$OUT" PYTEST_ARGS="$ARGS" 2>&1 | tee "$OUT/log.txt"
echo "rc=$?"
