#!/usr/bin/env bash
# Here, before a lent GPU is asked for: everything Transformer Engine needs on the device, cut
# into pieces that one device call each can carry (docs/gpu_te.md). Downloads into .te/dl
# (ignored): TE's Python package, its CUDA 13 core wheel (276 MB) and its PyTorch extension's
# sdist, megatron-core and emerging-optimizers, TE's Python dependencies, setuptools and wheel
# (for a build on the device); with --build-here also the extension built here
# (bench/gpu/te_build_here.sh), or with --extension WHEEL one built before (on a device, say).
# Then splits the lot (bench/gpu/pieces.py) into .te/calls/1..N,
# at most MAX_MIB each, and prints the device calls to make, back to back.
#   bash bench/gpu/te_prepare.sh [--build-here | --extension WHEEL] [--max-mib 60] [--te 2.20.2]
set -euo pipefail
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
  || { echo "te_prepare: error: .venv must be CPython 3.12 on x86_64, the device's (make setup)" >&2; exit 2; }
DL=.te/dl; rm -rf "$DL"; mkdir -p "$DL"
get() { $PY -m pip download -q -d "$DL" "$@"; }
s0=$(date +%s)
get --no-deps --only-binary=:all: "transformer_engine==$TE" "transformer_engine_cu13==$TE" \
  megatron-core==0.19.2 emerging-optimizers==0.3.0 nvidia-cudnn-frontend==1.32.0 "setuptools<82" wheel
# Only an sdist exists, and pip runs its setup.py for the metadata: with .venv's torch (seconds),
# else in an isolated env that pip first installs torch into (minutes).
get --no-deps --no-build-isolation "transformer_engine_torch==$TE" || get --no-deps "transformer_engine_torch==$TE"
# What `import transformer_engine.pytorch` needs beyond torch and numpy (the device's image has
# both): pydantic for the recipes, einops, packaging, and onnxscript with onnx, which TE's
# modules import for ONNX export; their own dependencies come along, less those torch brings.
get --only-binary=:all: pydantic einops packaging onnxscript onnx
rm -f "$DL"/numpy-*.whl "$DL"/sympy-*.whl "$DL"/mpmath-*.whl
echo "downloaded in $(( $(date +%s) - s0 ))s"
if [ -n "$EXTENSION" ]; then
  cp "$EXTENSION" "$DL/"
elif [ $BUILD_HERE = 1 ]; then
  bash bench/gpu/te_build_here.sh "$DL" "$DL/transformer_engine_torch-$TE.tar.gz"
fi
ls -l "$DL"
$PY -m bench.gpu.pieces split --max-mib "$MAX_MIB" --out .te/calls "$DL"/*
N=$(find .te/calls -mindepth 1 -maxdepth 1 -type d | wc -l)
echo
echo "Device calls, back to back (the machine is given back 30 s after a call returns):"
for k in $(seq 1 $((N - 1))); do
  echo "  run command='bash bench/gpu/te_device_setup.sh receive .te/calls/$k' carry=['.te/calls/$k'] timeout_s=120"
done
echo "  run command='bash bench/gpu/te_device_setup.sh setup .te/calls/$N' carry=['.te/calls/$N'] timeout_s=${SETUP_TIMEOUT_S:-300}"
