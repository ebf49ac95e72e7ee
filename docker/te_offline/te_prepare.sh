#!/usr/bin/env bash
# On a machine that reaches the package index: everything Transformer Engine needs on a GPU node
# that does not, cut into checked pieces of at most MAX_MIB each (docs/cluster.md, "Transformer
# Engine on a node without a package index"). Downloads into .te/dl (ignored by git): TE's Python
# package, its CUDA 13 core wheel (276 MB) and its PyTorch extension's sdist, megatron-core and
# emerging-optimizers, TE's Python dependencies, setuptools and wheel (for a build on the node);
# with --build-here also the extension built here (docker/te_offline/te_build_here.sh), or with
# --extension WHEEL one built before (on the node, say). Then splits the lot
# (docker/te_offline/pieces.py) into .te/pieces/1..N and prints the commands to run on the node.
# The bundle is for the node's Python, CPython 3.12 on x86_64, which .venv must match.
#   bash docker/te_offline/te_prepare.sh [--build-here | --extension WHEEL] [--max-mib 60] [--te 2.20.2]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TE=2.20.2; MAX_MIB=60; BUILD_HERE=0; EXTENSION=
while [ $# -gt 0 ]; do
  case $1 in
    --build-here) BUILD_HERE=1;;
    --extension) EXTENSION=$(realpath "$2"); shift;;
    --max-mib) MAX_MIB=$2; shift;;
    --te) TE=$2; shift;;
    *) echo "te_prepare: error: unknown argument $1" >&2; exit 2;;
  esac; shift
done
PY=.venv/bin/python
$PY -c 'import sys, platform; assert sys.version_info[:2] == (3, 12) and platform.machine() == "x86_64"' \
  || { echo "te_prepare: error: .venv must be CPython 3.12 on x86_64, the node's (make setup)" >&2; exit 2; }
DL=.te/dl; rm -rf "$DL"; mkdir -p "$DL"
get() { $PY -m pip download -q -d "$DL" "$@"; }
s0=$(date +%s)
get --no-deps --only-binary=:all: "transformer_engine==$TE" "transformer_engine_cu13==$TE" \
  megatron-core==0.19.2 emerging-optimizers==0.3.0 nvidia-cudnn-frontend==1.32.0 "setuptools<82" wheel
# Only an sdist exists, and pip runs its setup.py for the metadata: with .venv's torch (seconds),
# else in an isolated env that pip first installs torch into (minutes).
get --no-deps --no-build-isolation "transformer_engine_torch==$TE" || get --no-deps "transformer_engine_torch==$TE"
# What `import transformer_engine.pytorch` needs beyond torch and numpy (the node's Python has
# both): pydantic for the recipes, einops, packaging, and onnxscript with onnx, which TE's
# modules import for ONNX export; their own dependencies come along, less those torch brings.
get --only-binary=:all: pydantic einops packaging onnxscript onnx
rm -f "$DL"/numpy-*.whl "$DL"/sympy-*.whl "$DL"/mpmath-*.whl
echo "downloaded in $(( $(date +%s) - s0 ))s"
if [ -n "$EXTENSION" ]; then
  cp "$EXTENSION" "$DL/"
elif [ $BUILD_HERE = 1 ]; then
  bash "$HERE/te_build_here.sh" "$DL" "$DL/transformer_engine_torch-$TE.tar.gz"
fi
ls -l "$DL"
$PY "$HERE/pieces.py" split --max-mib "$MAX_MIB" --out .te/pieces "$DL"/*
N=$(find .te/pieces -mindepth 1 -maxdepth 1 -type d | wc -l)
echo
echo "Copy .te/pieces/1..$N into this checkout on the GPU node (one folder a transfer), then run there,"
echo "from the checkout's root, in this order:"
for k in $(seq 1 $((N - 1))); do
  echo "  bash docker/te_offline/te_node_setup.sh receive .te/pieces/$k"
done
echo "  bash docker/te_offline/te_node_setup.sh setup .te/pieces/$N"
