#!/usr/bin/env bash
# One rank of a Slurm job: srun starts one per GPU (examples/slurm/pretrain_2bw.sbatch).
# Rendezvous comes from the allocation (first node, a port from the job id); the training
# flags from CONFIG, a file that sets TRAIN_ARGS (e.g. examples/moe_10b/flags.sh).
#
#   LAUNCHER=patched (default): python $PRETRAIN ...   (the image's Megatron-LM carries patches/)
#   LAUNCHER=launch:            python -m megatron_async.launch $PRETRAIN ...   (any checkout, a venv)
#   EXTRA_ARGS="--flag value ...": appended to TRAIN_ARGS
#   DRY_RUN=1: print this rank's rendezvous and exact command, then check the command with
#              Megatron's argument validation and megatron-async's (no GPU, no training)
set -euo pipefail

: "${CONFIG:?set CONFIG to a flags file that sets TRAIN_ARGS (e.g. examples/moe_10b/flags.sh)}"
: "${SLURM_PROCID:?run under srun (or set the SLURM_* variables for a dry run)}"
PRETRAIN=${PRETRAIN:-/workspace/megatron-lm/pretrain_gpt.py}
PYTHON=${PYTHON:-python}
LAUNCHER=${LAUNCHER:-patched}
# shellcheck source=/dev/null
source "$CONFIG"
read -ra EXTRA <<< "${EXTRA_ARGS:-}"

first_host() {  # the first host of a Slurm node list: gpu[003-004,009] -> gpu003
  local host=""
  if command -v scontrol > /dev/null 2>&1; then  # without a reachable Slurm config it prints nothing
    host=$(scontrol show hostnames "$1" 2> /dev/null | head -n 1) || host=""
  fi
  if [[ -z "$host" ]]; then
    local prefix=${1%%[*} rest=${1#*[}
    if [[ "$1" == *"["* ]]; then host="$prefix${rest%%[-,]*}"; else host="${1%%,*}"; fi
  fi
  echo "$host"
}

export MASTER_ADDR=${MASTER_ADDR:-$(first_host "$SLURM_JOB_NODELIST")}
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
export LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE%%(*}
export CUDA_DEVICE_MAX_CONNECTIONS=1           # Megatron's TP/SP overlap needs ordered kernels
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1       # a dead peer raises (after --distributed-timeout-minutes)
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}    # as torchrun sets it: one intra-op thread a rank, one reduction order

if [[ "$LAUNCHER" == launch ]]; then
  CMD=("$PYTHON" -m megatron_async.launch "$PRETRAIN" "${TRAIN_ARGS[@]}" "${EXTRA[@]}")
else
  CMD=("$PYTHON" "$PRETRAIN" "${TRAIN_ARGS[@]}" "${EXTRA[@]}")
fi

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  echo "rank $RANK of $WORLD_SIZE (local $LOCAL_RANK of $LOCAL_WORLD_SIZE) on $(hostname):" \
       "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"
  printf '%q ' "${CMD[@]}"
  echo
  exec "$PYTHON" -m megatron_async.check_flags --world-size "$WORLD_SIZE" -- "${TRAIN_ARGS[@]}" "${EXTRA[@]}"
fi
echo "rank $RANK of $WORLD_SIZE on $(hostname) (job ${SLURM_JOB_ID:-?}, restart ${SLURM_RESTART_COUNT:-0})"
exec "${CMD[@]}"
