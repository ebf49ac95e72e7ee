#!/usr/bin/env bash
# Transformer Engine onto a lent GPU from the pieces bench/gpu/te_prepare.sh made (docs/gpu_te.md).
# Every device call but the last carries one piece and checks it into $TE_STORE (/tmp/te, which
# outlives the call on the warm machine); the last carries the last piece, rebuilds every file and
# checks its sha256 against the manifest (a missing or altered piece stops here, naming the call
# to make again), installs TE, its PyTorch extension, megatron-core, emerging-optimizers and TE's
# Python dependencies into one folder ($SITE, /tmp/site), and runs the fp8 smoke check
# (bench/gpu/te_smoke.py). The extension is the wheel built here against torch 2.11.0+cu130
# (TE_BUILD=auto, the default); where that one fails to load, or with TE_BUILD=device, it is
# built on the device from the sdist, Hopper only, within BUILD_S seconds. Each phase's time
# goes to $TE_STORE/phases.tsv and, in the last call, to $OUT/te_setup.json:
#   bash bench/gpu/te_device_setup.sh receive .te/calls/K      # carry: .te/calls/K   (K = 1..N-1)
#   bash bench/gpu/te_device_setup.sh setup .te/calls/N        # carry: .te/calls/N
set -u -o pipefail
OUT=${OUT:-out/gpu}; STORE=${TE_STORE:-/tmp/te}; SITE=${SITE:-/tmp/site}; MODE=${1:-}; CALL=${2:-}
BUILD=${TE_BUILD:-auto}; BUILD_S=${BUILD_S:-420}; CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
PHASES=$STORE/phases.tsv; FILES=$STORE/files
mkdir -p "$OUT" "$STORE"
die() { echo "te_device_setup: error: $*" >&2; exit 2; }
case "$MODE" in receive|setup) ;; *) die "usage: te_device_setup.sh receive|setup CALL_DIR";; esac
case "$BUILD" in auto|device) ;; *) die "TE_BUILD must be auto or device, got '$BUILD'";; esac
[ "$MODE" = setup ] || [ -n "$CALL" ] || die "receive needs the call's folder (.te/calls/K)"

phase() {  # phase NAME CMD...: runs CMD, appends NAME, its exit status and seconds to $PHASES
  local name=$1 t0 rc ns; shift; t0=$(date +%s%N)
  "$@"; rc=$?; ns=$(( $(date +%s%N) - t0 ))
  printf '%s\t%d\t%d.%03d\n' "$name" "$rc" $(( ns / 1000000000 )) $(( ns / 1000000 % 1000 )) >> "$PHASES"
  echo "== $name: exit $rc, $(( ns / 1000000 )) ms"; return $rc
}

if [ -n "$CALL" ]; then
  phase "receive $(basename "$CALL")" python3 -m bench.gpu.pieces receive "$CALL" --store "$STORE" || exit 2
fi
[ "$MODE" = receive ] && exit 0

phase join python3 -m bench.gpu.pieces join --store "$STORE" --dest "$FILES" || exit 2
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  python3 -c "import sys,torch;print(sys.version.split()[0], torch.__version__, torch.version.git_version, 'cuda', torch.version.cuda)"
  "$CUDA_HOME/bin/nvcc" --version | tail -n 2; ldd --version | head -n 1; } > "$OUT/env.txt" 2>&1

install() {  # every carried wheel but the build tools (and the carried extension when building
  # on the device), plus any wheel given, in one pip command: TE's three distributions share the
  # top-level folder transformer_engine/, which a later --upgrade --target would replace whole
  local wheels=("$@") w
  for w in "$FILES"/*.whl; do
    case "$(basename "$w")" in setuptools-*|wheel-*) continue;; esac
    [ "$made" = device ] && case "$(basename "$w")" in transformer_engine_torch-*) continue;; esac
    wheels+=("$w")
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
}
made=carried; [ "$BUILD" = device ] && made=device
phase install install || exit 1

smoke() { PYTHONPATH=$SITE:$PWD python3 -m bench.gpu.te_smoke --json "$OUT/te_smoke.json"; }
extension_failed() {  # the smoke stopped at loading the extension itself (not at a missing Python package)
  python3 - "$OUT/te_smoke.json" <<'PY'
import json, re, sys
s = json.load(open(sys.argv[1]))
sys.exit(not (s.get("stage") == "import transformer_engine.pytorch"
              and re.search(r"shared object|undefined symbol|transformer_engine_torch|torch lib", s.get("error", ""))))
PY
}
build_on_device() {  # transformer_engine_torch from the sdist: a C++ extension against the device's torch
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

if [ "$made" = device ]; then
  phase build build_on_device && phase reinstall install "$STORE"/built/*.whl && phase smoke smoke
else
  phase smoke smoke || if extension_failed; then
    echo "TE's PyTorch extension did not load; building it on the device"
    made=device; phase build build_on_device && phase reinstall install "$STORE"/built/*.whl && phase smoke smoke
  fi
fi
python3 -m bench.gpu.te_setup_report write --phases "$PHASES" --smoke "$OUT/te_smoke.json" \
  --build "$made" --out "$OUT/te_setup.json"
