#!/usr/bin/env bash
# Parameters and memory per GPU of every pipeline stage of the 10B MoE configuration,
# built on the meta device (no GPU needed):   bash examples/moe_10b/plan.sh [--json PATH]
exec bash "$(dirname "$0")/../plan_config.sh" examples/moe_10b/flags.sh 32 "$@"
