# Sourced by the image scripts: one way to call the container engine on this machine.
# podman where present (Debian's, as root, with Debian's runc: crun fails on hybrid
# cgroups, and podman's default rlimits are refused here), else docker. Builds and runs
# use the host's network, which reaches the package registries.
# shellcheck shell=bash
if command -v podman > /dev/null; then
  ENGINE=podman
  ENGINE_OPTS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=32768:32768)
  if command -v runc > /dev/null; then
    ENGINE_RUNTIME=(--runtime "$(command -v runc)")
  else
    ENGINE_RUNTIME=()
  fi
elif command -v docker > /dev/null && docker info > /dev/null 2>&1; then
  ENGINE=docker
  ENGINE_OPTS=()
  ENGINE_RUNTIME=()
else
  echo "no container engine: install podman and runc (apt-get install podman runc), or run a Docker engine" >&2
  exit 1
fi

engine() { "$ENGINE" "$@"; }

image_exists() { "$ENGINE" image inspect "$1" > /dev/null 2>&1; }

# engine_build ARGS...: build with the Docker image format (the Dockerfiles use SHELL)
engine_build() {
  if [[ $ENGINE == podman ]]; then
    podman build "${ENGINE_RUNTIME[@]}" "${ENGINE_OPTS[@]}" --network host --format docker "$@"
  else
    docker build --network host "$@"
  fi
}

# "${ENGINE_RUN[@]}" ARGS... (or engine_run ARGS...): run a container with the host's network,
# removed afterwards
ENGINE_RUN=("$ENGINE" run "${ENGINE_RUNTIME[@]}" "${ENGINE_OPTS[@]}" --rm --network host)
engine_run() { "${ENGINE_RUN[@]}" "$@"; }
