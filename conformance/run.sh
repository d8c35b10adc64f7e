#!/usr/bin/env bash
# `make conformance`: our exports in the real SGLang/vLLM loaders, and our drafter vs SpecForge.
#
#   bash conformance/run.sh                # venvs under $CONFORMANCE_VENVS, work under $CONFORMANCE_WORK
#
# Everything it runs is in this repository: a clean clone needs nothing beside it.
# Phases (wall time printed for each):
#   1. venvs   conformance/make_venv.sh engine and specforge (exact --no-deps locks in conformance/venvs/; idempotent)
#   2. sglang-tests  the tests marked `sglang` (they need the real SGLang package) run with the engine
#              venv's python (pytest added beside it under $WORK/engine-pytest, the same versions as .venv);
#              REDRAFT_REQUIRE_SGLANG=1 makes a missing SGLang, or a skip, a failure
#   3. drafters  demo pipeline (extract 6 samples -> train 2 steps -> export), the same as an MLA drafter,
#              a Kimi-K2.5-shaped drafter, one warm-started from an imported SGLang-layout drafter, and MLA
#              drafters in the engines' layout (small, Kimi-K2.5-sized, q_lora_rank null) (conformance.make_drafters)
#   4. engines   python -m eval.verify_engine on every export and MLA drafter +
#              broken exports and broken MLA drafters refused
#   5. product   `python -m eval.export --verify-with sglang` inside the engine venv (item 4's path), and the
#              regeneration server client's SGLang /generate bodies through SGLang's schema (check_regen_api.py)
#   6. specforge our logits/losses vs conformance/specforge_ref.py (SpecForge 0.2.0's own code)
# CONFORMANCE_LANES picks what runs: "loaders specforge" (the default, every phase) or "specforge" (phase 6
# and its venv only: what .ci/run runs, because vLLM CPU and SGLang CPU now serve our exports for real in
# make engine-truth, and the loaders' venv is ~7 GB of CUDA wheels CI would download on every run).
# The lane never passes without running: when the venvs cannot be built (registries unreachable) it
# fails (exit 1) and says why. REDRAFT_SKIP_CONFORMANCE=1, set on purpose, skips it (exit 0, loudly).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
VENVS=${CONFORMANCE_VENVS:-$HOME/.cache/redraft/conformance}
WORK=${CONFORMANCE_WORK:-$ROOT/.cache/conformance}
ENGINE_VENV=$VENVS/engine
SF_VENV=$VENVS/specforge
LANES=${CONFORMANCE_LANES:-loaders specforge}
for lane in $LANES; do
    case "$lane" in
        loaders|specforge) ;;
        *) echo "conformance: unknown lane '$lane' in CONFORMANCE_LANES (loaders, specforge)" >&2; exit 2 ;;
    esac
done
want() { [[ " $LANES " == *" $1 "* ]]; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline DS_ACCELERATOR=cpu
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

LANE_START=$(date +%s)
PHASE_START=$LANE_START
declare -a TIMES=()
phase() { echo; echo "=== conformance: $* ==="; PHASE_START=$(date +%s); }
done_phase() {
    local took=$(( $(date +%s) - PHASE_START ))
    TIMES+=("$(printf '%-10s %5d s' "$1" "$took")")
    echo "--- $1: ${took} s"
}
loud() {
    echo
    echo "################################################################################"
    for line in "$@"; do echo "### $line"; done
    echo "################################################################################"
}

[ -x "$PY" ] || { echo "conformance: $PY missing (run 'make venv' first)" >&2; exit 2; }

# ---------------------------------------------------------------- 1. venvs
phase "1/6 venvs ($VENVS)"
venvs_ready() {
    if want loaders; then
        [ -x "$ENGINE_VENV/bin/python" ] && "$ENGINE_VENV/bin/python" -c "import sglang, vllm" >/dev/null 2>&1 || return 1
    fi
    [ -x "$SF_VENV/bin/python" ] && "$SF_VENV/bin/python" -c "import specforge" >/dev/null 2>&1
}
registry_reachable() {  # a quick index query per package the venvs need, with a short timeout
    local pkg pkgs=(specforge)
    want loaders && pkgs+=(sglang vllm)
    for pkg in "${pkgs[@]}"; do
        timeout 30 python3 -m pip index versions --timeout 10 --retries 1 "$pkg" >/dev/null 2>&1 || return 1
    done
}
if [ "${REDRAFT_SKIP_CONFORMANCE:-0}" = 1 ]; then
    loud "CONFORMANCE LANE SKIPPED on purpose (REDRAFT_SKIP_CONFORMANCE=1)." \
         "Nothing about the exports or the numerics was checked."
    exit 0
fi
if ! venvs_ready && ! registry_reachable; then  # importing the engines takes ~20 s; the probe, seconds
    loud "CONFORMANCE LANE FAILED: it cannot run. The package registries are unreachable (pip index versions" \
         "sglang/vllm/specforge failed within 30 s) and the venvs under $VENVS are not built." \
         "Build them where the registries are reachable, or set REDRAFT_SKIP_CONFORMANCE=1 to skip on purpose."
    exit 1
fi
mkdir -p "$VENVS" "$WORK"
build_venv() {  # build_venv MODE DIR: pip's chatter goes to a log, printed only when the build fails
    local log="$WORK/make_venv-$1.log"
    if ! bash conformance/make_venv.sh "$1" "$2" >"$log" 2>&1; then
        tail -n 60 "$log" | sed 's/^/  /'
        echo "conformance: conformance/make_venv.sh $1 $2 failed (full log: $log)" >&2
        exit 1
    fi
    grep -E '^\[make_venv' "$log" | sed 's/^/  /'
}
want loaders && build_venv engine "$ENGINE_VENV"
build_venv specforge "$SF_VENV"
done_phase venvs

if want loaders; then

# ---------------------------------------------------------------- 2. tests that need the real SGLang
phase "2/6 tests marked sglang, with the engine venv's python"
mapfile -t SGLANG_TESTS < <(grep -l "pytest.mark.sglang" tests/engine/loaders/test_*.py)
if [ "${#SGLANG_TESTS[@]}" = 0 ]; then
    echo "conformance: no test file under tests/engine/loaders has a test marked sglang" >&2
    exit 1
fi
PYTEST_SITE="$WORK/engine-pytest"  # pytest beside the engine venv, not in it: its lock file owns that venv
PYTEST_PINS=$("$PY" -c 'import importlib.metadata as m
print(" ".join(f"{d}=={m.version(d)}" for d in ("pytest", "pluggy", "iniconfig", "pytest-timeout")))')
if [ "$(cat "$PYTEST_SITE/.pins" 2>/dev/null)" != "$PYTEST_PINS" ]; then
    rm -rf "$PYTEST_SITE"
    # shellcheck disable=SC2086  # the pins are separate arguments
    if ! "$ENGINE_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$PYTEST_SITE" \
            $PYTEST_PINS >"$WORK/engine-pytest.log" 2>&1; then
        tail -n 30 "$WORK/engine-pytest.log" | sed 's/^/  /'
        echo "conformance: installing $PYTEST_PINS for the engine venv failed (log: $WORK/engine-pytest.log)" >&2
        exit 1
    fi
    echo "$PYTEST_PINS" >"$PYTEST_SITE/.pins"
fi
echo "  $PYTEST_PINS; ${SGLANG_TESTS[*]}"
REDRAFT_REQUIRE_SGLANG=1 PYTHONPATH="$ROOT:$PYTEST_SITE" "$ENGINE_VENV/bin/python" -m pytest -q -p no:cacheprovider \
    -m sglang "${SGLANG_TESTS[@]}"
done_phase sglang-tests

# ---------------------------------------------------------------- 3. drafters
phase "3/6 exported drafters ($WORK)"
# everything but the extracted dataset is redone: training, checkpoint writing and export are under test
# (the MLA drafters under $WORK/foreign are random weights of a fixed seed: reused when present)
rm -rf "$WORK/exports" "$WORK/broken" "$WORK/runs" "$WORK/verify" "$WORK/imported-sglang"
for which in demo demo-mla warm kimi mla; do
    t0=$(date +%s)
    "$PY" -m conformance.make_drafters "$which" "$WORK"
    echo "  $which: $(( $(date +%s) - t0 )) s"
done
done_phase drafters

# ---------------------------------------------------------------- 4. engines
phase "4/6 engine loading (SGLang 0.5.23 + vLLM 0.33.0 loaders)"
"$PY" -m conformance.check_engines "$WORK/exports" --engine-python "$ENGINE_VENV/bin/python" --foreign "$WORK/foreign"
rm -rf "$WORK/runs/kimi" "$WORK/exports/kimi-sglang" "$WORK/exports/kimi-vllm"  # 7 GB, rebuilt every run
done_phase engines

# ---------------------------------------------------------------- 5. product --verify-with
phase "5/6 python -m eval.export --verify-with (in the engine venv)"
"$ENGINE_VENV/bin/python" -m eval.export "$WORK/runs/demo" "$WORK/verify/demo-sglang" --format sglang --force -q \
    --verify-with sglang
rc=0
"$ENGINE_VENV/bin/python" -m eval.verify_engine "$WORK/broken/demo-sglang-no-d2t" --engine sglang || rc=$?
if [ "$rc" != 1 ]; then
    echo "conformance: eval.verify_engine on an export without d2t exited $rc, expected 1 (FAIL)" >&2
    exit 1
fi
echo "  eval.verify_engine refused the export without d2t, as it must"
# extract --regen-backend server: our SGLang /generate bodies through SGLang's own schema and SamplingParams
PYTHONPATH="$ROOT" "$ENGINE_VENV/bin/python" conformance/check_regen_api.py
done_phase product
else
    echo; echo "=== conformance: phases 2-5 (the engine loaders) not in CONFORMANCE_LANES=\"$LANES\" ==="
fi

# ---------------------------------------------------------------- 6. specforge
if want specforge; then
    phase "6/6 numerics vs SpecForge 0.2.0"
    "$PY" -m conformance.check_specforge "$WORK/specforge" --sf-python "$SF_VENV/bin/python"
    done_phase specforge
fi

echo
echo "=== conformance: the phases of \"$LANES\" passed in $(( $(date +%s) - LANE_START )) s"
for t in "${TIMES[@]}"; do echo "  $t"; done
