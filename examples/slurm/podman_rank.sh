#!/usr/bin/env bash
# One rank of a Slurm job in the image, through podman on the node (`srun ... podman_rank.sh`,
# from examples/slurm/pretrain_2bw.sbatch with PODMAN_IMAGE set): for clusters without pyxis.
# The container shares the node's network (rendezvous as without a container) and gets the
# job's environment by name (the SLURM_* variables, CONFIG, RUN_DIR, ...), less the variables
# that describe the node's own Python and paths. REPO and RUN_DIR are mounted at the same
# paths; CONTAINER_MOUNTS adds SRC:DST[,SRC:DST...]; CONTAINER_OPTS adds podman options
# (on GPU nodes, e.g. "--device nvidia.com/gpu=all"). Slurm's signals reach the rank through
# podman's signal proxy; the container is removed when the rank ends.
set -euo pipefail
: "${PODMAN_IMAGE:?set PODMAN_IMAGE (e.g. localhost/megatron-async:standin, docker/image.sh)}"
: "${REPO:?set REPO (the repository, as the sbatch does)}"
: "${RUN_DIR:?set RUN_DIR}"
# shellcheck source=docker/engine.sh
source "$REPO/docker/engine.sh"

args=(-v "$REPO:$REPO" -v "$RUN_DIR:$RUN_DIR" -w "$PWD")
IFS=, read -ra mounts <<< "${CONTAINER_MOUNTS:-}"
for mount in "${mounts[@]}"; do args+=(-v "$mount"); done
while read -r name; do
  case "$name" in
    PATH|HOME|HOSTNAME|PWD|OLDPWD|SHLVL|_|TMPDIR|SHELL|USER|LOGNAME|TERM|PYTHON|PYTHONPATH|VIRTUAL_ENV|LD_LIBRARY_PATH) ;;
    *) args+=(-e "$name") ;;  # the value comes from this environment
  esac
done < <(compgen -e)
read -ra extra <<< "${CONTAINER_OPTS:-}"
echo "rank ${SLURM_PROCID:-?} on $(hostname): $ENGINE run $PODMAN_IMAGE"
exec "${ENGINE_RUN[@]}" --init "${args[@]}" "${extra[@]}" "$PODMAN_IMAGE" bash "$REPO/examples/slurm/rank_command.sh"
