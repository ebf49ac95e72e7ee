# shellcheck shell=bash
# SmolLM-360M, the paper's headline dense model (Zmushko et al., 2026), trained with
# PipeDream-2BW, Muon and the EF delay correction.
#
# Shape: SmolLM-360M's published configuration (HuggingFaceTB/SmolLM-360M config.json:
# hidden 960, 32 layers, 15 heads, 5 key/value heads, FFN 2560 (SwiGLU), vocabulary
# 49,152, RMSNorm eps 1e-5, RoPE base 10,000, no biases, tied input and output
# embeddings, context 2048). 361.82M parameters (examples/smollm_360m/plan.sh counts
# them on the meta device; tests/test_cluster_files.py checks the count in closed form).
# Layout: one 8-GPU node, PP=4 x DP=2, no tensor parallelism; 9, 9, 9 and 5 layers a stage,
# the last with the output layer: the planner's split (plan.sh prints it), within 1% of even.
# Tokens: 10B (a stated budget for this config, not a figure from the paper).
#
# Sourced by examples/slurm/rank_command.sh; it sets TRAIN_ARGS. Paths come from the
# environment: DATA_PREFIX (Megatron indexed dataset prefixes of FineWeb-Edu, made with
# examples/moe_10b/prepare_data.sh and SmolLM's tokenizer), TOKENIZER_MODEL (a local copy
# of SmolLM's tokenizer), RUN_DIR (checkpoints, logs); MOCK_DATA=1 trains on Megatron's
# mock data instead (smoke runs, dry runs, the plan).

MODEL_ARGS=(
  --num-layers 32 --hidden-size 960 --ffn-hidden-size 2560
  --num-attention-heads 15 --group-query-attention --num-query-groups 5
  --seq-length 2048 --max-position-embeddings 2048
  --position-embedding-type rope --rotary-base 10000
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02
  # tied input and output embeddings: Megatron's default, as SmolLM (2bw trains them, docs/two_bw.md)
)
PARALLEL_ARGS=(
  --pipeline-model-parallel-size 4 --tensor-model-parallel-size 1
  --decoder-last-pipeline-num-layers 5          # the planner's split: 9, 9, 9, 5 + output layer
  --pipeline-schedule 2bw                       # no flush, two weight versions, one-step delay
  --use-distributed-optimizer                   # with Muon: Megatron's layer-wise distributed optimizer
  --bf16
)
OPTIMIZER_ARGS=(
  --optimizer muon --muon-momentum 0.95 --muon-extra-scale-factor 0.2   # AdamW-sized updates: one --lr
  --delay-correction ef --ef-lambda 1.0         # corrects the one-step delay (docs/delay_correction.md)
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 1000 --lr-decay-style cosine
  --weight-decay 0.1 --clip-grad 1.0
)
BATCH_ARGS=(
  --micro-batch-size 8 --global-batch-size 256  # 0.5M tokens a step; m = 256 / (8 x DP 2) = 16 microbatches
  --train-iters 19073                           # 19,073 x 256 x 2,048 = 10.0B tokens
)
# shellcheck disable=SC2034  # read by examples/data_and_output.sh
MOCK_VOCAB_SIZE=49151  # + end of document = 49,152
# shellcheck source=examples/data_and_output.sh
source "$(dirname "${BASH_SOURCE[0]}")/../data_and_output.sh"   # DATA_ARGS, OUTPUT_ARGS
# shellcheck disable=SC2034  # read by the script that sources this file
TRAIN_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${BATCH_ARGS[@]}"
            "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}")
