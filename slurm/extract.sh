#!/usr/bin/env bash
# Extraction for the serving target, one 8-GPU node per array task.
#
#   sbatch slurm/extract.sh                       # Kimi-K2.5, SGLang TP 8, configs/kimi-k25/extract.yaml
#   sbatch --array=0-15 slurm/extract.sh          # 16 data partitions: task i takes shards s with s % 16 == i
#   bash slurm/extract.sh [--max-samples 8 ...]   # outside Slurm: the embedded default on this machine
#
# Requeue-friendly: a requeued or rerun task keeps its complete shards and redoes the rest;
# the last task to finish assembles manifest.json. Extra arguments are passed to
# `python -m extract` and override the config file.
#SBATCH --job-name=redraft-extract
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --array=0-7
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/extract-%A_%a.log
set -euo pipefail

REPO=${REDRAFT_REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
cd "$REPO"
PYTHON=${PYTHON:-$REPO/.venv/bin/python}

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  CONFIG=${CONFIG:-configs/kimi-k25/extract.yaml}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
else
  CONFIG=${CONFIG:-configs/demo/extract.yaml}
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
fi

# Rank and world size come from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT (see extract/config.py).
CMD=("$PYTHON" -m extract --config "$CONFIG" "$@")
echo "[slurm/extract.sh] ${CMD[*]}" >&2
exec "${CMD[@]}"
