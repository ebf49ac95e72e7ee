# shellcheck shell=bash
# A ~10B-parameter MoE GPT trained with PipeDream-2BW, Muon and the EF delay correction,
# in the spirit of the 10B MoE run of Zmushko et al. (2026): 200B tokens.
#
# Shape: OLMoE-1B-7B's layer (Muennighoff et al., 2024: hidden 2048, 16 heads, 64
# fine-grained experts of FFN 1024, top-8, SwiGLU, RMSNorm, RoPE, QK-norm, no biases)
# with 24 layers instead of 16. Total 10.28B parameters, 1.82B active per token
# (examples/moe_10b/plan.sh builds every stage on the meta device and prints both).
# Layout for 8-GPU nodes: PP=4 x DP=8 (4 nodes, 32 GPUs), experts spread over the 8
# data-parallel ranks of a stage (EP=8), no tensor parallelism; 6, 6, 7 and 5 layers a
# stage, the last with the output layer: the planner's split (plan.sh prints it).
#
# Sourced by examples/slurm/rank_command.sh; it sets TRAIN_ARGS. Paths come from the
# environment: DATA_PREFIX (Megatron indexed dataset prefix, examples/moe_10b/prepare_data.sh),
# TOKENIZER_MODEL (a local Hugging Face tokenizer directory), RUN_DIR (checkpoints, logs);
# MOCK_DATA=1 trains on Megatron's mock data instead (smoke runs, dry runs).

MODEL_ARGS=(
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16
  --seq-length 4096 --max-position-embeddings 4096
  --position-embedding-type rope --rotary-base 500000
  --normalization RMSNorm --swiglu --disable-bias-linear --qk-layernorm
  --untie-embeddings-and-output-weights       # the model's choice (2bw trains tied ones too)
  --num-experts 64 --moe-ffn-hidden-size 1024 --moe-router-topk 8
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01
  --moe-token-dispatcher-type alltoall
  --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02
)
PARALLEL_ARGS=(
  --pipeline-model-parallel-size 4 --expert-model-parallel-size 8 --tensor-model-parallel-size 1
  --pipeline-model-parallel-layout "Et*6|t*6|t*7|t*5L"   # the planner's split: 6, 6, 7, 5 + output layer
  --pipeline-schedule 2bw                       # no flush, two weight versions, one-step delay
  --overlap-moe-expert-parallel-comm            # each expert all-to-all behind the other microbatch's compute:
                                                # Megatron's combined step, 2bw's deeper warm-up (twice the
                                                # activations on stage 0; plan.sh counts them). Projected
                                                # 1.23x of 2bw without it on a GPU-bound host, equal on a
                                                # host-bound one (docs/benchmarks.md, the overlaps section)
  --use-distributed-optimizer                   # with Muon: Megatron's layer-wise distributed optimizer
  --bf16
)
OPTIMIZER_ARGS=(
  --optimizer muon --muon-momentum 0.95 --muon-extra-scale-factor 0.2   # AdamW-sized updates: one --lr
  --delay-correction ef --ef-lambda 1.0         # corrects the one-step delay (docs/delay_correction.md)
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2000 --lr-decay-style cosine
  --weight-decay 0.1 --clip-grad 1.0
)
BATCH_ARGS=(
  --micro-batch-size 1 --global-batch-size 512  # 2.1M tokens a step; m = 512 / 8 = 64 microbatches
  --train-iters 95368                           # 95,368 x 512 x 4,096 = 200.0B tokens
)
# shellcheck disable=SC2034  # read by examples/data_and_output.sh
MOCK_VOCAB_SIZE=50304
# shellcheck source=examples/data_and_output.sh
source "$(dirname "${BASH_SOURCE[0]}")/../data_and_output.sh"   # DATA_ARGS, OUTPUT_ARGS
# shellcheck disable=SC2034  # read by the script that sources this file
TRAIN_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${BATCH_ARGS[@]}"
            "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}")
