#!/usr/bin/env bash
# Transformer Engine onto a GPU node that reaches no package index, from the pieces
# docker/te_offline/te_prepare.sh made (docs/cluster.md, "Transformer Engine on a node without a
# package index"). Each `receive` checks one piece folder into $TE_STORE (/tmp/te, kept between
# runs); `setup` receives the last folder, rebuilds every file and checks its sha256 against the
# manifest (a missing or altered piece stops here, naming the folder to receive again), installs
# TE, its PyTorch extension, megatron-core, emerging-optimizers and TE's Python dependencies into
# one folder ($SITE, /tmp/site), and runs the fp8 smoke check (docker/te_offline/te_smoke.py).
# The extension is the wheel te_prepare.sh built against torch 2.11.0+cu130 (TE_BUILD=auto, the
# default); where that one fails to load, or with TE_BUILD=node, it is built on the node from the
# sdist, Hopper only, within BUILD_S seconds. Each phase's time goes to $TE_STORE/phases.tsv and,
# at `setup`, to $OUT/te_setup.json:
#   bash docker/te_offline/te_node_setup.sh receive .te/pieces/K      # K = 1..N-1
#   bash docker/te_offline/te_node_setup.sh setup .te/pieces/N
set -u -o pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT:-out/gpu}; STORE=${TE_STORE:-/tmp/te}; SITE=${SITE:-/tmp/site}; MODE=${1:-}; FOLDER=${2:-}
BUILD=${TE_BUILD:-auto}; BUILD_S=${BUILD_S:-420}; CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
PHASES=$STORE/phases.tsv; FILES=$STORE/files
mkdir -p "$OUT" "$STORE"
die() { echo "te_node_setup: error: $*" >&2; exit 2; }
case "$MODE" in receive|setup) ;; *) die "usage: te_node_setup.sh receive|setup PIECE_FOLDER";; esac
case "$BUILD" in auto|node) ;; *) die "TE_BUILD must be auto or node, got '$BUILD'";; esac
[ "$MODE" = setup ] || [ -n "$FOLDER" ] || die "receive needs a piece folder (.te/pieces/K)"

phase() {  # phase NAME CMD...: runs CMD, appends NAME, its exit status and seconds to $PHASES
  local name=$1 t0 rc ns; shift; t0=$(date +%s%N)
  "$@"; rc=$?; ns=$(( $(date +%s%N) - t0 ))
  printf '%s\t%d\t%d.%03d\n' "$name" "$rc" $(( ns / 1000000000 )) $(( ns / 1000000 % 1000 )) >> "$PHASES"
  echo "== $name: exit $rc, $(( ns / 1000000 )) ms"; return $rc
}

if [ -n "$FOLDER" ]; then
  phase "receive $(basename "$FOLDER")" python3 "$HERE/pieces.py" receive "$FOLDER" --store "$STORE" || exit 2
fi
[ "$MODE" = receive ] && exit 0

phase join python3 "$HERE/pieces.py" join --store "$STORE" --dest "$FILES" || exit 2
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  python3 -c "import sys,torch;print(sys.version.split()[0], torch.__version__, torch.version.git_version, 'cuda', torch.version.cuda)"
  "$CUDA_HOME/bin/nvcc" --version | tail -n 2; ldd --version | head -n 1; } > "$OUT/env.txt" 2>&1

install() {  # every carried wheel but the build tools (and the carried extension when building
  # on the node), plus any wheel given, in one pip command: TE's three distributions share the
  # top-level folder transformer_engine/, which a later --upgrade --target would replace whole
  local wheels=("$@") w
  for w in "$FILES"/*.whl; do
    case "$(basename "$w")" in setuptools-*|wheel-*) continue;; esac
    [ "$made" = node ] && case "$(basename "$w")" in transformer_engine_torch-*) continue;; esac
    wheels+=("$w")
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
}
made=carried; [ "$BUILD" = node ] && made=node
phase install install || exit 1

smoke() { PYTHONPATH=$SITE python3 "$HERE/te_smoke.py" --json "$OUT/te_smoke.json"; }
extension_failed() {  # the smoke stopped at loading the extension itself (not at a missing Python package)
  python3 - "$OUT/te_smoke.json" <<'PY'
import json, re, sys
s = json.load(open(sys.argv[1]))
sys.exit(not (s.get("stage") == "import transformer_engine.pytorch"
              and re.search(r"shared object|undefined symbol|transformer_engine_torch|torch lib", s.get("error", ""))))
PY
}
build_on_node() {  # transformer_engine_torch from the sdist: a C++ extension against the node's torch
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$STORE/buildtools" \
    "$FILES"/setuptools-*.whl "$FILES"/wheel-*.whl || return 1
  rm -rf "$STORE/built"
  local cuda=${CUDA_HOME:-/usr/local/cuda}
  PYTHONPATH=$STORE/buildtools:$SITE NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 \
    NVTE_BUILD_USE_NVIDIA_WHEELS=1 CPATH=$cuda/include CUDA_HOME=$cuda MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    timeout "$BUILD_S" python3 -m pip wheel -v --no-index --no-deps --no-build-isolation -w "$STORE/built" \
    "$FILES"/transformer_engine_torch-*.tar.gz > "$OUT/te_build.log" 2>&1 || { tail -n 30 "$OUT/te_build.log"; return 1; }
  cp "$STORE"/built/*.whl "$OUT/" 2>/dev/null
}

if [ "$made" = node ]; then
  phase build build_on_node && phase reinstall install "$STORE"/built/*.whl && phase smoke smoke
else
  phase smoke smoke || if extension_failed; then
    echo "TE's PyTorch extension did not load; building it on the node"
    made=node; phase build build_on_node && phase reinstall install "$STORE"/built/*.whl && phase smoke smoke
  fi
fi
python3 "$HERE/te_setup_report.py" write --phases "$PHASES" --smoke "$OUT/te_smoke.json" \
  --build "$made" --out "$OUT/te_setup.json"
