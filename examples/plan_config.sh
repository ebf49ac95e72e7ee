#!/usr/bin/env bash
# Parameters and memory per GPU of every pipeline stage of a cluster config, built on the
# meta device (no GPU needed), with Megatron's mock data standing in for the corpus:
#   bash examples/plan_config.sh CONFIG DEFAULT_WORLD_SIZE [--json PATH] [--gpu-gb GB]
# (examples/*/plan.sh call it with their own config; WORLD_SIZE overrides the default;
# EXTRA_ARGS, split on spaces, go after the config's flags: another split, say.)
set -euo pipefail
CONFIG=$1 DEFAULT_WORLD=$2
shift 2
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export RUN_DIR=${RUN_DIR:-/tmp/$(basename "$(dirname "$CONFIG")")_plan} MOCK_DATA=${MOCK_DATA:-1}
# shellcheck source=examples/moe_10b/flags.sh
source "$CONFIG"
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
exec "$PYTHON" -m megatron_async.planning.plan --world-size "${WORLD_SIZE:-$DEFAULT_WORLD}" "$@" -- "${TRAIN_ARGS[@]}" \
  "${EXTRA[@]}"
