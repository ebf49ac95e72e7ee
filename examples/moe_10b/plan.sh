#!/usr/bin/env bash
# Parameters and memory per GPU of every pipeline stage of the 10B MoE configuration,
# built on the meta device (no GPU needed):   bash examples/moe_10b/plan.sh [--json PATH]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
export RUN_DIR=${RUN_DIR:-/tmp/moe_10b_plan} MOCK_DATA=${MOCK_DATA:-1}
# shellcheck source=examples/moe_10b/flags.sh
source examples/moe_10b/flags.sh
exec "$PYTHON" -m megatron_async.planning.plan --world-size "${WORLD_SIZE:-32}" "$@" -- "${TRAIN_ARGS[@]}"
