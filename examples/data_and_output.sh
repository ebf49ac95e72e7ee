# shellcheck shell=bash
# The data and output flags every cluster config shares (examples/*/flags.sh source it
# after setting MOCK_VOCAB_SIZE, the --vocab-size of Megatron's mock data for that model).
# From the environment: RUN_DIR; DATA_PREFIX (Megatron indexed dataset prefixes, made with
# examples/moe_10b/prepare_data.sh) and TOKENIZER_MODEL (a local Hugging Face tokenizer
# directory), or MOCK_DATA=1 for Megatron's mock data (smoke runs, dry runs, plans).

: "${RUN_DIR:?set RUN_DIR to the run directory (checkpoints, TensorBoard, metrics)}"
TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}
# shellcheck disable=SC2034  # DATA_ARGS: read by the config that sources this file
if [[ "${MOCK_DATA:-0}" == 1 ]]; then  # smoke runs, dry runs and plans, without the corpus
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${MOCK_VOCAB_SIZE:?}" --num-workers 2)
else
  : "${DATA_PREFIX:?set DATA_PREFIX to the prepared dataset prefix (examples/moe_10b/prepare_data.sh)}"
  : "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a local tokenizer directory}"
  read -ra DATA_PATHS <<< "$DATA_PREFIX"       # one or more prefixes, blended by size
  DATA_ARGS=(
    --data-path "${DATA_PATHS[@]}" --split "998,2,0"
    --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL"
    --data-cache-path "$RUN_DIR/data_cache" --num-workers 2
  )
fi
# shellcheck disable=SC2034  # read by the config that sources this file
OUTPUT_ARGS=(
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 1000
  --exit-signal-handler   # SIGTERM (the sbatch's --signal, scancel --signal): every rank stops and saves at one iteration
  --log-interval 10 --eval-interval 1000 --eval-iters 20
  --tensorboard-dir "$RUN_DIR/tensorboard" --metrics-json "$RUN_DIR/metrics.jsonl"
)
