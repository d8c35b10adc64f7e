#!/usr/bin/env bash
# Extraction for the serving target, one 8-GPU node per array task.
#
#   sbatch slurm/extract.sh                       # Kimi-K2.5, SGLang TP 8, configs/kimi-k25.yaml (its extract section)
#   sbatch --array=0-15 slurm/extract.sh          # 16 data partitions: task i takes shards s with s % 16 == i
#   bash slurm/extract.sh [--max-samples 8 ...]   # outside Slurm: the embedded default on this machine
#
# Requeue-friendly: a requeued or rerun task keeps its complete shards and redoes the rest;
# the last task to finish assembles manifest.json. Extra arguments are passed to
# `python -m extract` and override the config file.
#
# The interpreter: PYTHON, else (in a Slurm job) REDRAFT_ENGINE_PYTHON, the venv on the GPU nodes that has
# redraft with SGLang (pip install 'redraft[sglang]'; --backend vllm finds vLLM itself), else this checkout's
# CPU .venv (which has no SGLang). The script stops before the job starts when that interpreter is
# missing or lacks the engine the config asks for.
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
die() { echo "[slurm/extract.sh] error: $*" >&2; exit 2; }

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  CONFIG=${CONFIG:-configs/kimi-k25.yaml}  # its extract section; CONFIG=configs/kimi-k25.yaml#extract-vllm for vLLM
  PYTHON=${PYTHON:-${REDRAFT_ENGINE_PYTHON:-$REPO/.venv/bin/python}}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
else
  CONFIG=${CONFIG:-configs/demo/extract.yaml}
  PYTHON=${PYTHON:-$REPO/.venv/bin/python}
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
fi
[[ -x "$PYTHON" ]] || die "PYTHON=$PYTHON is not an executable interpreter; set PYTHON (or REDRAFT_ENGINE_PYTHON) to the python of the venv that has redraft and its engine"

# The engine the run needs: --backend on the command line, else the config's backend key (hf by default).
SETTINGS=$("$PYTHON" -m redraft config "$CONFIG" --stage extract) || die "CONFIG=$CONFIG: cannot be read (above)"
BACKEND=$(sed -n 's/^backend: \([a-z]*\)$/\1/p' <<< "$SETTINGS" | tail -n 1)
for ((i = 1; i <= $#; i++)); do
  arg=${!i}
  case "$arg" in
    --backend=*) BACKEND=${arg#--backend=} ;;
    --backend) j=$((i + 1)); BACKEND=${!j:-} ;;
  esac
done
# SGLang runs in-process, so PYTHON must have it; vLLM is found by the run itself (engine_python, this python
# or the vLLM CPU venv) and says so when it is nowhere.
if [[ "${BACKEND:-hf}" == sglang ]]; then
  "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)" \
    || die "backend sglang ($CONFIG): $PYTHON has no SGLang; set PYTHON (or REDRAFT_ENGINE_PYTHON) to the python of the venv with redraft[sglang]"
fi

# Rank and world size come from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT (see extract/config.py).
CMD=("$PYTHON" -m extract --config "$CONFIG" "$@")
echo "[slurm/extract.sh] ${CMD[*]}" >&2
exec "${CMD[@]}"
