#!/usr/bin/env bash
# `make demo`: the pipeline on the embedded default (SmolLM2-135M-Instruct), on this machine's CPUs.
#   extract (the target regenerates chitchat answers) -> verify -> train (2 DeepSpeed CPU processes)
#   -> offline acceptance on the held-out split -> export for SGLang and vLLM
# Sizes live in configs/demo/*.yaml; DEMO_OUT (default demo-out) is where everything goes.
# DEMO_SCALE=small|default|large or a multiplier (e.g. 0.5, 2) resizes the run: samples, regenerated
# tokens, train steps (small ~1/3 of default's time, large ~3x); a non-default scale writes to
# demo-out-$DEMO_SCALE unless DEMO_OUT is set. DEMO_TRAIN_STEPS still overrides the step count.
# DEMO_PROCS=1 trains in one process (two micro-batches per step: the same tokens per step as the two DeepSpeed
# processes, in another order) where the two would only share a busy core (CI's engine-truth lane).
# Rerunning resumes: complete shards and checkpoints are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SCALE=${DEMO_SCALE:-default}
EXTRACT_SIZES=()
case "$SCALE" in
  default) STEPS=60 ;;
  small) STEPS=20; EXTRACT_SIZES=(--max-samples 16 --max-new-tokens 32) ;;
  large) STEPS=180; EXTRACT_SIZES=(--max-samples 144 --max-new-tokens 128) ;;
  *)
    if ! awk -v x="$SCALE" 'BEGIN { exit !(x ~ /^[0-9]*\.?[0-9]+$/ && x > 0) }'; then
      echo "DEMO_SCALE must be small, default, large or a positive number, got '$SCALE'" >&2
      exit 2
    fi
    STEPS=$(awk -v x="$SCALE" 'BEGIN { s = int(60 * x + 0.5); print (s < 5 ? 5 : s) }')
    EXTRACT_SIZES=(--max-samples "$(awk -v x="$SCALE" 'BEGIN { n = int(48 * x + 0.5); print (n < 8 ? 8 : n) }')")
    ;;
esac
if [ "$SCALE" = default ]; then OUT=${DEMO_OUT:-demo-out}; else OUT=${DEMO_OUT:-demo-out-$SCALE}; fi
TRAIN_STEPS=${DEMO_TRAIN_STEPS:-$STEPS}
PROCS=${DEMO_PROCS:-2}
case "$PROCS" in
  1) LAUNCH=("$PY" train/main.py --grad-accum 2); HOW="1 process, 2 micro-batches per step" ;;
  2) LAUNCH=("$PY" -m accelerate.commands.launch --config_file configs/accelerate/cpu-2proc-zero2.yaml train/main.py)
     HOW="2 DeepSpeed ZeRO-2 processes on CPU" ;;
  *) echo "DEMO_PROCS must be 1 or 2, got '$PROCS'" >&2; exit 2 ;;
esac
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DS_ACCELERATOR=cpu WANDB_MODE=${WANDB_MODE:-offline}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)

echo "== 1/5 extract: $OUT/data"
"$PY" -m extract --config configs/demo/extract.yaml --out "$OUT/data" ${EXTRACT_SIZES[@]+"${EXTRACT_SIZES[@]}"}

echo "== 2/5 verify"
"$PY" -m extract.verify "$OUT/data"

echo "== 3/5 train: $OUT/drafter ($HOW)"
"${LAUNCH[@]}" --config configs/demo/train.yaml --data "$OUT/data" --out "$OUT/drafter" \
  --max-steps "$TRAIN_STEPS" --resume auto --report-to none

echo "== 4/5 offline acceptance (held-out split recorded at training)"
"$PY" -m eval.acceptance "$OUT/drafter" --data "$OUT/data" --steps 5 --no-progress \
  --json "$OUT/acceptance.json" --markdown "$OUT/acceptance.md" --plot "$OUT/acceptance.png"

echo "== 5/5 export for SGLang and vLLM"
"$PY" -m eval.export "$OUT/drafter" "$OUT/export-sglang" --format sglang --force
"$PY" -m eval.export "$OUT/drafter" "$OUT/export-vllm" --format vllm --force

echo "== done in $(( $(date +%s) - start )) s: dataset $OUT/data, checkpoint $OUT/drafter/$(cat "$OUT/drafter/latest"), exported drafters $OUT/export-sglang, $OUT/export-vllm"
