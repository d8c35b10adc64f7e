#!/usr/bin/env bash
# Build (or re-check) one of the conformance lane's two throwaway venvs, from this repository alone.
#
#   bash conformance/make_venv.sh engine    DIR   # SGLang 0.5.23 + vLLM 0.33.0 loaders, torch 2.14.1 (CUDA build)
#   bash conformance/make_venv.sh specforge DIR   # SpecForge 0.2.0, transformers 5.8.1, torch 2.13.0+cpu
#
# Every distribution is pinned exactly in conformance/venvs/<mode>.txt and installed with --no-deps,
# so pip resolves nothing and the venv is the same on every machine:
#   engine     the engines WITHOUT their declared dependencies: `pip install sglang` (or vllm) with deps
#              pulls 7+ GB of CUDA kernels the loaders never import, and an unpinned vllm backtracks
#              through dozens of releases. The CUDA build of torch 2.14.1 (sglang's hard pin; vllm asks
#              for 2.14.0, whose loader code runs unchanged on 2.14.1) imports fine without a GPU.
#              Resolved conflicts, checked by running both loaders: openai 2.54.0 (sglang pins 2.8.0,
#              vllm needs >= 2.25), compressed-tensors 0.18.0 (vllm pins 0.17.0), xgrammar 0.2.8
#              (sglang 0.2.7), openai-harmony 0.0.8 (sglang 0.0.4).
#   specforge  torch 2.13.0+cpu from a local wheel ($TORCH_WHEEL, or the first torch-2.13.0+cpu wheel in
#              $PIP_FIND_LINKS), else from PyTorch's CPU index (scripts/pip_cpu_args.py), never PyPI's
#              multi-GB CUDA build of the same version. specforge 0.2.0 without its declared
#              dependencies (sglang, yunchang, wandb, datasets, ...): its drafter code imports none.
#              triton is not installed: conformance/specforge_ref.py stubs it for one import.
# Idempotent: when the stamp in DIR matches the lock file and the smoke import passes, nothing is
# installed (seconds). Lines starting with [make_venv] are the summary conformance/run.sh prints.
set -euo pipefail

MODE=${1:-}
DIR=${2:-}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PY=${PYTHON_FOR_VENV:-python3}
START=$(date +%s)

say() { echo "[make_venv $MODE $(( $(date +%s) - START ))s] $*"; }
die() { local code=$1; shift; echo "[make_venv $MODE] ERROR: $*" >&2; exit "$code"; }  # die CODE MESSAGE...

case "$MODE" in
    engine|specforge) ;;
    *) die 2 "usage: bash conformance/make_venv.sh engine|specforge DIR (got mode '${MODE}')" ;;
esac
[ -n "$DIR" ] || die 2 "usage: bash conformance/make_venv.sh $MODE DIR (no DIR given)"
LOCK="$HERE/venvs/$MODE.txt"
[ -f "$LOCK" ] || die 2 "$LOCK: lock file missing"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || die 2 "$PY is Python $("$PY" -c 'import platform; print(platform.python_version())'); both venvs need >= 3.11" \
           "(specforge 0.2.0 requires it); set PYTHON_FOR_VENV"

smoke() {  # the imports each venv exists for
    if [ "$MODE" = engine ]; then
        VLLM_TARGET_DEVICE=cpu "$DIR/bin/python" - <<'EOF'
import importlib.metadata as m
import torch
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3  # noqa: F401
from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM  # noqa: F401
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM  # noqa: F401
from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM as V  # noqa: F401
print(f"[make_venv] engine: torch {torch.__version__} (CUDA available: {torch.cuda.is_available()}), "
      f"sglang {m.version('sglang')}, vllm {m.version('vllm')}: both EAGLE-3 drafter classes import")
EOF
    else
        PYTHONPATH="$ROOT" "$DIR/bin/python" -m conformance.specforge_ref --check-import
    fi
}

find_torch_wheel() {  # the local torch-2.13.0+cpu wheel, or nothing
    if [ -n "${TORCH_WHEEL:-}" ]; then
        [ -f "$TORCH_WHEEL" ] || die 2 "TORCH_WHEEL=$TORCH_WHEEL: no such file"
        echo "$TORCH_WHEEL"
        return
    fi
    local d
    for d in ${PIP_FIND_LINKS:-}; do
        [ -d "$d" ] || continue
        ls "$d"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1 && return
    done
}

STAMP="$DIR/.redraft-venv-$MODE"
WANT="$(sha256sum "$LOCK" | cut -d' ' -f1) $("$PY" -c 'import platform; print(platform.python_version())')"
if [ -x "$DIR/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
    if smoke; then
        say "already built: $DIR (lock $(basename "$LOCK") unchanged)"
        exit 0
    fi
    say "stamp matches but the smoke import failed: reinstalling"
fi

WHEEL=""
[ "$MODE" = specforge ] && WHEEL=$(find_torch_wheel)
if [ ! -x "$DIR/bin/python" ]; then
    say "creating $DIR with $PY"
    "$PY" -m venv "$DIR" || die 1 "python3 -m venv $DIR failed"
fi
PIP=("$DIR/bin/python" -m pip --disable-pip-version-check)
rm -f "$STAMP"

if [ "$MODE" = specforge ] && [ -n "$WHEEL" ]; then
    say "torch from $WHEEL"
    "${PIP[@]}" install --no-deps "$WHEEL" || die 1 "installing $WHEEL failed"
elif [ "$MODE" = specforge ]; then  # PyTorch's CPU index where pip's own indexes lack the CPU build (never PyPI's CUDA)
    read -r -a EXTRA <<< "$("$DIR/bin/python" "$ROOT/scripts/pip_cpu_args.py" --pip "$DIR/bin/pip")"
    say "torch==2.13.0+cpu${EXTRA[*]:+ (${EXTRA[*]})}"
    "${PIP[@]}" install --no-deps "${EXTRA[@]}" "torch==2.13.0+cpu" || die 1 "installing torch==2.13.0+cpu failed"
fi
say "installing $(grep -c '==' "$LOCK") pinned distributions from $(basename "$LOCK") (--no-deps)"
"${PIP[@]}" install --no-deps -r "$LOCK" || die 1 "pip install --no-deps -r $LOCK failed (registry unreachable, or a pin gone)"
smoke || die 1 "the venv at $DIR was installed but its smoke import fails (see above)"
echo "$WANT" > "$STAMP"
say "done: $DIR ($(du -sh "$DIR" 2>/dev/null | cut -f1))"
