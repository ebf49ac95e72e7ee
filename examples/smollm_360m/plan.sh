#!/usr/bin/env bash
# Parameters and memory per GPU of every pipeline stage of the SmolLM-360M configuration,
# built on the meta device (no GPU needed):   bash examples/smollm_360m/plan.sh [--json PATH]
exec bash "$(dirname "$0")/../plan_config.sh" examples/smollm_360m/flags.sh 8 "$@"
