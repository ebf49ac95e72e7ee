#!/usr/bin/env bash
# Install megatron-async, and optionally a patched Megatron-LM checkout, into an existing
# Python environment WITHOUT replacing its torch, Transformer Engine or apex.
#
#   docker/install.sh [--megatron-lm DIR] [--editable]
#
# The Dockerfile runs it inside an NVIDIA PyTorch container; CI runs it on its own venv
# (tests/test_cluster_files.py), so the steps the image takes are tested steps.
#  1. refuse a Python older than 3.12;
#  2. write the installed torch / Transformer Engine / apex versions to a pip
#     constraints file, so pip can only keep them (it fails rather than replace one);
#  3. with --megatron-lm DIR: apply patches/ to that checkout (once) and install it
#     in place, so `python DIR/pretrain_gpt.py --pipeline-schedule 2bw` works as is;
#  4. install this package under those constraints;
#  5. check the kept packages are unchanged and that the plugin's hooks all exist.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
MEGATRON_LM=""
EDITABLE=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --megatron-lm) MEGATRON_LM=$2; shift 2 ;;
    --editable) EDITABLE=(-e); shift ;;
    *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 12):
    sys.exit(f"install.sh: megatron-async needs Python >= 3.12, this is {sys.version.split()[0]}")
PY

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
kept() {  # name==version of the packages the environment must keep
  "$PYTHON" -m pip list --format=freeze 2>/dev/null \
    | grep -iE '^(torch|transformer[-_]engine([-_][a-z0-9]+)?|apex)==' || true
}
kept > "$WORK/keep.txt"
echo "install.sh: keeping $(tr '\n' ' ' < "$WORK/keep.txt")"

if [[ -n "$MEGATRON_LM" ]]; then
  PATCH="$REPO/patches/megatron-lm-f8837c04-megatron-async.patch"
  if git -C "$MEGATRON_LM" apply --reverse --check "$PATCH" 2>/dev/null; then
    echo "install.sh: $MEGATRON_LM already patched"
  else
    git -C "$MEGATRON_LM" apply "$PATCH"
  fi
  "$PYTHON" -m pip install --no-build-isolation --no-deps -c "$WORK/keep.txt" -e "$MEGATRON_LM"
fi

"$PYTHON" -m pip install --no-build-isolation -c "$WORK/keep.txt" "${EDITABLE[@]}" "$REPO"

kept > "$WORK/after.txt"
if ! diff -u "$WORK/keep.txt" "$WORK/after.txt"; then
  echo "install.sh: the install changed the packages above; it must not" >&2
  exit 1
fi
"$PYTHON" -c "from megatron_async.megatron_lm.adapter.hooks import install; install(); print('install.sh: plugin hooks in place')"
