#!/usr/bin/env bash
# The image, built and run on a machine without nvcr.io or a GPU (`make image`, `make image-smoke`):
#
#   docker/image.sh build   # the stand-in base (docker/standin/build_base.sh) if missing, then
#                           # the project's Dockerfile on it, changed only by build arguments
#   docker/image.sh smoke   # the CI smoke inside the image: prepare the Shakespeare corpus, train
#                           # a small GPT with 2bw, PP=2 on 2 processes in Megatron's loop, and
#                           # check that the validation loss fell (examples/demo.sh); with
#                           # Megatron-LM in the image, the same run through its pretrain_gpt.py
#
# Environment: IMAGE (the tag, default localhost/megatron-async:standin), BASE_IMAGE (default:
# the stand-in), MEGATRON_LM_MIRROR (a local git mirror of NVIDIA/Megatron-LM holding the pinned
# commit; without it the image has no Megatron-LM checkout and megatron-core's wheel brings
# megatron/training), SMOKE_ITERS (default 40).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=docker/engine.sh
source "$REPO/docker/engine.sh"

IMAGE=${IMAGE:-localhost/megatron-async:standin}
BASE_IMAGE=${BASE_IMAGE:-localhost/megatron-async-base:standin}
SMOKE_ITERS=${SMOKE_ITERS:-40}

build() {
  local start=$SECONDS args=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
  if [[ $BASE_IMAGE == localhost/megatron-async-base:standin ]]; then
    BASE_TAG=$BASE_IMAGE "$REPO/docker/standin/build_base.sh"
  fi
  if [[ -n "${MEGATRON_LM_MIRROR:-}" ]]; then
    git -C "$MEGATRON_LM_MIRROR" cat-file -e "f8837c04ef6cbef6cdefb8de001aad63178aebbf^{commit}" \
      || { echo "image: $MEGATRON_LM_MIRROR lacks Megatron-LM commit f8837c04" >&2; exit 1; }
    args+=(--volume "$(cd "$MEGATRON_LM_MIRROR" && pwd):/megatron-lm-mirror:ro"
           --build-arg MEGATRON_LM_REPO=/megatron-lm-mirror)
  else
    args+=(--build-arg MEGATRON_LM_REPO=none)
  fi
  local base_done=$SECONDS
  engine_build "${args[@]}" -t "$IMAGE" "$REPO"
  echo "image: $IMAGE built in $((SECONDS - base_done)) s (base included: $((SECONDS - start)) s)"
}

smoke() {
  image_exists "$IMAGE" || { echo "image: no $IMAGE yet: building it first"; build; }
  local start=$SECONDS
  # shellcheck disable=SC2016  # expanded inside the container
  engine_run -e OMP_NUM_THREADS=1 -e ITERS="$SMOKE_ITERS" "$IMAGE" bash -c '
    set -euo pipefail
    cd /workspace/megatron-async
    python -c "import sys, torch, megatron_async; print(\"image:\", \"Python\", sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.cuda.is_available())"
    PYTHON=python DATA=/tmp/data OUT=/tmp/out/gpt bash examples/demo.sh
    if [[ -f /workspace/megatron-lm/pretrain_gpt.py ]]; then
      echo "== the same run through the patched Megatron-LM pretrain_gpt.py"
      PYTHON=python DATA=/tmp/data OUT=/tmp/out/pretrain_gpt ENTRY=/workspace/megatron-lm/pretrain_gpt.py bash examples/demo.sh
    fi'
  echo "image: smoke passed in $((SECONDS - start)) s"
}

case "${1:-}" in
  build) build ;;
  smoke) smoke ;;
  *) echo "usage: docker/image.sh build|smoke" >&2; exit 2 ;;
esac
