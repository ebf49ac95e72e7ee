#!/usr/bin/env bash
# transformer_engine_torch built on this machine, so that the GPU node spends no time compiling it
# (docs/cluster.md). The extension is C++ only (33 files against torch's and CUDA's headers, no
# GPU code; TE's kernels are in the prebuilt core wheel), so neither a GPU nor nvcc is needed:
# a throwaway venv under $TE_BUILD_DIR gets the node's torch ($TE_BUILD_TORCH, PyPI's 2.11.0 by
# default, which is 2.11.0+cu130), its CUDA 13 wheels and the CUDA headers those lack, and the
# sdist is built there with NVTE_CUDA_ARCHS=90 (Hopper; that setting only decides whether TE's
# NCCL EP bindings are compiled in). The wheel lands in DEST. Nothing is installed into .venv.
#   bash docker/te_offline/te_build_here.sh DEST_DIR SDIST [MAX_JOBS]
set -euo pipefail
DEST=$1; SDIST=$2; JOBS=${3:-$(nproc)}
DIR=${TE_BUILD_DIR:-/tmp/te_build_here}; TORCH=${TE_BUILD_TORCH:-torch==2.11.0}
BASE=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
"$BASE" -c 'import sys, platform; assert sys.version_info[:2] == (3, 12) and platform.machine() == "x86_64", sys.version' \
  || { echo "te_build_here: error: needs CPython 3.12 on x86_64 (the node's), got $BASE" >&2; exit 2; }
[ -x "$DIR/venv/bin/python" ] || "$BASE" -m venv "$DIR/venv"
PIP=("$DIR/venv/bin/python" -m pip)
s0=$(date +%s)
# torch with its CUDA 13 wheels (cuDNN, NCCL, cuBLAS, ... with their headers), plus the CUDA
# runtime's crt/ and CCCL headers, which cuda_runtime_api.h includes and torch does not pull in.
"${PIP[@]}" install -q --no-compile "$TORCH" nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 \
  "setuptools<82" wheel packaging
"$DIR/venv/bin/python" -c 'import torch; print("torch", torch.__version__, torch.version.git_version, "cuda", torch.version.cuda)'
echo "build env ready in $(( $(date +%s) - s0 ))s"
rm -rf "$DIR/wheel"; b0=$(date +%s)
PATH=$DIR/venv/bin:$PATH NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 NVTE_BUILD_USE_NVIDIA_WHEELS=1 \
  MAX_JOBS=$JOBS nice -n 19 "${PIP[@]}" wheel -v --no-deps --no-build-isolation -w "$DIR/wheel" "$SDIST" \
  > "$DIR/build.log" 2>&1 || { tail -n 40 "$DIR/build.log"; echo "te_build_here: error: build failed ($DIR/build.log)" >&2; exit 1; }
echo "built in $(( $(date +%s) - b0 ))s with $JOBS jobs: $(ls "$DIR"/wheel)"
cp "$DIR"/wheel/transformer_engine_torch-*.whl "$DEST/"
