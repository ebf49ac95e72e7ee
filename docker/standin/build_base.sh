#!/usr/bin/env bash
# Build the stand-in for NVIDIA's PyTorch container from Debian's packages, for machines
# that cannot reach nvcr.io (this one, CI):
#   1. debootstrap a minimal Debian (trixie: Python 3.13) with git, a C++ compiler and
#      Python's headers, as NVIDIA's container has them (Megatron-LM builds its dataset
#      helpers with them);
#   2. import it as ROOT_TAG;
#   3. build docker/standin/Containerfile on it: the pinned torch and numpy (constraints.txt) in a
#      Python environment on PATH, tagged BASE_TAG.
# Kept when BASE_TAG exists (FORCE=1 rebuilds). The machine's CA bundle goes into the
# root file system, so pip inside the builds trusts what this machine's pip trusts.
#
#   docker/standin/build_base.sh            # -> localhost/megatron-async-base:standin
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck source=docker/engine.sh
source "$REPO/docker/engine.sh"

SUITE=${SUITE:-trixie}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOT_TAG=${ROOT_TAG:-localhost/megatron-async-standin-root:$SUITE}
BASE_TAG=${BASE_TAG:-localhost/megatron-async-base:standin}
TORCH_VERSION=$(sed -n 's/^torch==//p' "$REPO/constraints.txt")
NUMPY_VERSION=$(sed -n 's/^numpy==//p' "$REPO/constraints.txt")

if [[ -z "${FORCE:-}" ]] && image_exists "$BASE_TAG"; then
  echo "build_base: $BASE_TAG exists (FORCE=1 rebuilds)"
  exit 0
fi
command -v debootstrap > /dev/null || { echo "build_base: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS
echo "build_base: debootstrap $SUITE from $MIRROR"
debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,g++,make,git,ca-certificates \
  "$SUITE" "$WORK/root" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 \
  || { tail -n 20 "$WORK/debootstrap.log" >&2; exit 1; }
if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
  cp /etc/ssl/certs/ca-certificates.crt "$WORK/root/etc/ssl/certs/ca-certificates.crt"
fi
echo "build_base: root file system in $((SECONDS - start)) s; importing as $ROOT_TAG"
tar -C "$WORK/root" -c . | engine import - "$ROOT_TAG" > /dev/null
engine_build --build-arg "ROOT_IMAGE=$ROOT_TAG" --build-arg "TORCH_VERSION=$TORCH_VERSION" \
  --build-arg "NUMPY_VERSION=$NUMPY_VERSION" \
  -t "$BASE_TAG" -f "$REPO/docker/standin/Containerfile" "$REPO/docker/standin"
echo "build_base: $BASE_TAG (torch $TORCH_VERSION) in $((SECONDS - start)) s"
