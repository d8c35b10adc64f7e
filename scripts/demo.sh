#!/usr/bin/env bash
# `make demo`: the pipeline on the embedded default (SmolLM2-135M-Instruct), on this machine's CPUs.
#   extract (the target regenerates chitchat answers) -> verify -> train (2 DeepSpeed CPU processes)
#   -> offline acceptance on the held-out split -> export for SGLang
# Sizes live in configs/demo/*.yaml; DEMO_OUT (default demo-out) is where everything goes.
# Rerunning resumes: complete shards and checkpoints are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${DEMO_OUT:-demo-out}
TRAIN_STEPS=${DEMO_TRAIN_STEPS:-60}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DS_ACCELERATOR=cpu WANDB_MODE=${WANDB_MODE:-offline}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)

echo "== 1/5 extract: $OUT/data"
"$PY" -m extract --config configs/demo/extract.yaml --out "$OUT/data"

echo "== 2/5 verify"
"$PY" -m extract.verify "$OUT/data"

echo "== 3/5 train: $OUT/drafter (2 DeepSpeed ZeRO-2 processes on CPU)"
"$PY" -m accelerate.commands.launch --config_file configs/accelerate/cpu-2proc-zero2.yaml \
  train/main.py --config configs/demo/train.yaml --data "$OUT/data" --out "$OUT/drafter" \
  --max-steps "$TRAIN_STEPS" --resume auto --report-to none

echo "== 4/5 offline acceptance (held-out split recorded at training)"
"$PY" -m eval.acceptance "$OUT/drafter" --data "$OUT/data" --steps 5 --no-progress \
  --json "$OUT/acceptance.json" --markdown "$OUT/acceptance.md" --plot "$OUT/acceptance.png"

echo "== 5/5 export for SGLang"
"$PY" -m eval.export "$OUT/drafter" "$OUT/export-sglang" --format sglang --force

echo "== done in $(( $(date +%s) - start )) s: dataset $OUT/data, checkpoint $OUT/drafter/$(cat "$OUT/drafter/latest"), exported drafter $OUT/export-sglang"
