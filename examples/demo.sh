#!/usr/bin/env bash
# `make demo`: prepare the Shakespeare corpus, then pretrain a small GPT on the CPU with
# 2 processes as 2 pipeline stages with PipeDream-2BW, and check that it learned. About 3 minutes on 2 cores.
# DATA, OUT, ITERS, SCHEDULE and OPTIMIZER may be overridden from the environment (e.g. ITERS=20 for a smoke run);
# PYTHON (the venv's by default) and ENTRY (--gpt: our GPT entry; or a training script such as
# Megatron-LM's pretrain_gpt.py) are how the image smoke (docker/image.sh) runs it.
set -euo pipefail
cd "$(dirname "$0")/.."                         # paths below are relative to the repo root

PYTHON=${PYTHON:-.venv/bin/python}              # the Python with megatron-async installed
ENTRY=${ENTRY:---gpt}
DATA=${DATA:-data/shakespeare}                  # prepared corpus (cached between runs)
OUT=${OUT:-out/demo}                            # metrics.jsonl, loss.png, train.log
SCHEDULE=${SCHEDULE:-2bw}                       # 2bw (ours) or 1f1b (Megatron's, with a flush)
OPTIMIZER=${OPTIMIZER:-muon}                    # muon or adam (AdamW)
ITERS=${ITERS:-200}                             # ~0.75 s/iter on 2 cores: ~2.5 minutes of training
export OMP_NUM_THREADS=1                        # one thread per rank: 2 ranks fill 2 cores
export PYTHONWARNINGS=ignore                    # hide "Apex/Transformer Engine not installed" noise

echo "== 1/2 data: Shakespeare -> $DATA (skipped when already prepared)"
# 42 works, split by whole work; SentencePiece BPE with 4096 tokens; ~20 s the first time.
"$PYTHON" -m megatron_async.data.prepare --out "$DATA"

echo "== 2/2 training: 4-layer GPT, 2 pipeline stages ($SCHEDULE, $OPTIMIZER), $ITERS iterations on the CPU"
mkdir -p "$OUT"
rm -f "$OUT/loss.png"                           # written again at the end
train_args=(
  # data: the prepared indexed datasets and their tokenizer
  --train-data-path "$DATA/train_text_document"
  --valid-data-path "$DATA/valid_text_document"
  --tokenizer-type SentencePieceTokenizer
  --tokenizer-model "$DATA/tokenizer.model"
  --data-cache-path "$DATA/cache"               # GPTDataset's sample indices, reused next time
  --num-workers 0                               # read batches in the training process (2 cores)
  # parallelism: 2 ranks = 2 pipeline stages of 2 layers each
  --pipeline-model-parallel-size 2
  --pipeline-schedule "$SCHEDULE"               # PipeDream-2BW: no flush, 2 weight versions per stage,
                                                # one-step delayed gradients (SCHEDULE=1f1b: Megatron's);
                                                # each stage clips by its own gradient norm
  --num-layers 4                                # 2 transformer layers per stage
  --hidden-size 128                             # beat hidden 256 in equal time (more steps)
  --num-attention-heads 4                       # head dimension 32
  --seq-length 128                              # ~380 characters of context
  --max-position-embeddings 128
  --position-embedding-type learned_absolute
  --untie-embeddings-and-output-weights         # a model choice: measured so (2bw trains tied ones too)
  --hidden-dropout 0 --attention-dropout 0      # under one epoch: nothing to regularise
  # batch: 32 sequences = 4,096 tokens per step, as 4 microbatches that fill the pipeline
  --micro-batch-size 8
  --global-batch-size 32
  --train-iters "$ITERS"
  # optimizer: Muon (Megatron's) on the hidden matrices, Adam on the rest; short warmup,
  # cosine decay; clip at 1.0 (the default). Muon tolerates the one-step delay of 2bw
  # far better than Adam (OPTIMIZER=adam: final validation loss ~6.0 instead of ~4.9).
  --optimizer "$OPTIMIZER"
  --muon-momentum 0.95                          # Muon's usual momentum (Megatron-LM's default is 0.9)
  --muon-extra-scale-factor 0.2                 # with spectral scaling: AdamW's update size, so
                                                # one --lr and --weight-decay serve Muon and Adam
  --muon-fp32-matmul-prec high                  # fp32 Newton-Schulz: the default, medium, runs its
                                                # matmuls in bf16, emulated and 17-31x slower on a CPU
                                                # (docs/benchmarks.md); on a GPU medium is the fast one
  --lr 2e-3                                     # high, as a model this small tolerates
  --min-lr 1e-4                                 # cosine floor
  --lr-warmup-iters $(( ITERS / 10 ))           # 10% linear warmup
  --lr-decay-style cosine
  --weight-decay 0.01
  # output: progress every 10 steps, validation every 25 on 4 x 32 held-out sequences
  --log-interval 10
  --eval-interval 25
  --eval-iters 4
  --metrics-json "$OUT/metrics.jsonl"           # one JSON object per iteration / evaluation
  --plot "$OUT/loss.png"                        # train and validation loss, written at the end
)
# Megatron's own training loop (megatron.training.pretrain) with the plugin installed; on a
# machine without CUDA the launcher adds the CPU flags (--transformer-impl local, gloo, ...).
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_async.launch "$ENTRY" "${train_args[@]}" \
  > "$OUT/train.log" 2>&1 || { tail -n 40 "$OUT/train.log"; exit 1; }
# Megatron's progress lines, shortened to iteration, time, loss and grad norm; what is printed
# from here on is also kept in $OUT/summary.txt (README's sample output is its end)
awk -F' [|] ' '/ iteration +[0-9]+\/|validation loss at/ {
  line = ""; for (i = 1; i <= NF; i++) if ($i ~ /^ *(\[[^]]*\] *)?iteration +[0-9]|elapsed|lm loss|grad norm|validation loss/) {
    sub(/^ *\[[^]]*\] */, "", $i); line = line (line ? " | " : "") $i }
  print line }' "$OUT/train.log" | tee "$OUT/summary.txt"

# A model that learned nothing predicts uniformly: loss ln(vocab) = ln(4096) = 8.32.
"$PYTHON" - "$OUT/metrics.jsonl" "$DATA/stats.json" "$SECONDS" <<'EOF' | tee -a "$OUT/summary.txt"
import json, math, sys

metrics, stats, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3])
records = [json.loads(line) for line in open(metrics)]
# Megatron's evaluation after training (final_val_loss), else the last one during training
vals = [r["val_loss"] for r in records if "val_loss" in r] + [r["final_val_loss"] for r in records
                                                             if "final_val_loss" in r]
vocab = json.load(open(stats))["vocab_size"]
uniform = math.log(vocab)
if not vals:
    sys.exit("demo FAILED: no validation loss in " + metrics)
learned = vals[-1] < uniform - 1.0  # well below: at least one nat better than guessing
verdict = "learned" if learned else "FAILED"
print(f"demo {verdict}: final validation loss {vals[-1]:.3f} vs ln({vocab}) = {uniform:.2f} "
      f"for a uniform guess; {seconds // 60} min {seconds % 60} s in all")
sys.exit(0 if learned else 1)
EOF
