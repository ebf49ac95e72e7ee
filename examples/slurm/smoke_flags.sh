# shellcheck shell=bash
# A small GPT under 2bw at PP=2 on two CPU-only ranks (mock data): the config the local
# two-node Slurm runs the sbatch with (examples/slurm/local_cluster.sh, tests/test_slurm_cluster.py).
# Sourced by examples/slurm/rank_command.sh, which needs RUN_DIR; TRAIN_ITERS,
# SAVE_INTERVAL and EXIT_INTERVAL may be set by the caller.
# shellcheck disable=SC2034  # read by the script that sources this file
TRAIN_ARGS=(
  --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
  --micro-batch-size 2 --global-batch-size 8
  --position-embedding-type learned_absolute --hidden-dropout 0.1 --attention-dropout 0.1
  --pipeline-model-parallel-size 2 --pipeline-schedule 2bw
  --train-iters "${TRAIN_ITERS:-100000}" --lr 2e-3 --lr-decay-style constant
  --mock-data --tokenizer-type NullTokenizer --vocab-size 256 --num-workers 0
  --log-interval 1 --eval-interval 100000 --eval-iters 1
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval "${SAVE_INTERVAL:-100000}" --ckpt-format torch_dist
  --exit-signal-handler --metrics-json "$RUN_DIR/metrics.jsonl"
)
if [[ -n "${EXIT_INTERVAL:-}" ]]; then TRAIN_ARGS+=(--exit-interval "$EXIT_INTERVAL"); fi
