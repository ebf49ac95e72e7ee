#!/usr/bin/env bash
# Parameters and memory per GPU of every pipeline stage of the SmolLM-360M configuration,
# built on the meta device (no GPU needed):   bash examples/smollm_360m/plan.sh [--json PATH]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
export RUN_DIR=${RUN_DIR:-/tmp/smollm_360m_plan} MOCK_DATA=${MOCK_DATA:-1}
# shellcheck source=examples/smollm_360m/flags.sh
source examples/smollm_360m/flags.sh
exec "$PYTHON" -m megatron_async.planning.plan --world-size "${WORLD_SIZE:-8}" "$@" -- "${TRAIN_ARGS[@]}"
