#!/usr/bin/env bash
# FineWeb-Edu (or any text corpus) from local files into Megatron indexed datasets for the
# 10B MoE run, with a standard tokenizer from a local path; runs in the image
# (Megatron-LM's tools/preprocess_data.py at the pinned commit).
#
#   examples/moe_10b/prepare_data.sh OUT_DIR TOKENIZER_DIR FILE...
#
# FILE: .parquet (FineWeb-Edu's format: a "text" column) or .jsonl ({"text": ...} a line).
# Each file becomes OUT_DIR/<name>_text_document.{bin,idx}; end of document tokens are
# appended. The last line printed is the DATA_PREFIX for examples/moe_10b/flags.sh
# (every prefix; Megatron blends them in proportion to their size).
set -euo pipefail

if [[ $# -lt 3 ]]; then
  echo "usage: $0 OUT_DIR TOKENIZER_DIR FILE..." >&2
  exit 2
fi
OUT=$1 TOKENIZER=$2
shift 2
MEGATRON_LM=${MEGATRON_LM:-/workspace/megatron-lm}
PYTHON=${PYTHON:-python}
WORKERS=${WORKERS:-$(nproc)}
mkdir -p "$OUT"

prefixes=()
for file in "$@"; do
  name=$(basename "${file%.*}")
  input=$file
  if [[ "$file" == *.parquet ]]; then  # stream the text column to JSON lines, a row group at a time
    input="$OUT/$name.jsonl"
    "$PYTHON" - "$file" "$input" <<'PY'
import json, sys
import pyarrow.parquet as pq

source, target = sys.argv[1], sys.argv[2]
with open(target, "w", encoding="utf-8") as out:
    for batch in pq.ParquetFile(source).iter_batches(columns=["text"], batch_size=8192):
        for text in batch.column(0).to_pylist():
            if text:
                out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
PY
  fi
  "$PYTHON" "$MEGATRON_LM/tools/preprocess_data.py" --input "$input" --json-keys text \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" --append-eod \
    --output-prefix "$OUT/$name" --workers "$WORKERS"
  [[ "$input" == "$file" ]] || rm -f "$input"
  prefixes+=("$OUT/${name}_text_document")
done
echo "DATA_PREFIX=\"${prefixes[*]}\""
