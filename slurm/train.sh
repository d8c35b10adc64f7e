#!/usr/bin/env bash
# Drafter training on one or more 8-GPU nodes: one `accelerate launch` per node under srun, DeepSpeed ZeRO-2.
#
#   DATA=/scratch/redraft/kimi-k25/data OUT=/scratch/redraft/kimi-k25/train sbatch --nodes=2 slurm/train.sh
#   sbatch slurm/train.sh --data D --out O [--lr 3e-5 ...]   # extra arguments go to train/main.py
#   bash slurm/train.sh --dry-run [...]                       # print the commands (srun + every node's launch)
#   bash slurm/train.sh --data runs/data --out runs/train     # outside Slurm: this machine only
#
# Resumable: every launch passes `--resume auto` (newest complete checkpoint under OUT), so a requeued
# job (node failure, preemption, or the USR1 sent 10 minutes before the time limit, which requeues the
# job itself) continues where the last checkpoint left off. OUT must be on a filesystem all nodes share.
# Environment overrides: CONFIG, ACCEL_CONFIG, DATA, OUT, GPUS_PER_NODE, MAIN_ADDR, MAIN_PORT, PYTHON.
# Create logs/ before sbatch (Slurm does not create the --output folder).
#SBATCH --job-name=redraft-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
#SBATCH --open-mode=append
#SBATCH --output=logs/train-%j.log
set -euo pipefail

DRY_RUN=0
NODE_LAUNCH=0
ARGS=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --node-launch) NODE_LAUNCH=1 ;;  # internal: the per-node step started by srun
    *) ARGS+=("$arg") ;;
  esac
done

REPO=${REDRAFT_REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
cd "$REPO"
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
log() { echo "[slurm/train.sh] $*" >&2; }

# First host of the allocation: `scontrol show hostnames`, else parse the nodelist ("gpu[003-006,9],x" -> gpu003),
# else this machine.
first_host() {
  local list=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
  if [[ -z "$list" ]]; then
    hostname
    return
  fi
  if command -v scontrol >/dev/null 2>&1; then
    local h
    h=$(scontrol show hostnames "$list" 2>/dev/null | head -n1 || true)
    if [[ -n "$h" ]]; then
      echo "$h"
      return
    fi
  fi
  local head=${list%%[\[,]*}
  local rest=${list:${#head}}
  if [[ "$rest" == \[* ]]; then
    local inner=${rest#\[}
    inner=${inner%%]*}
    echo "${head}${inner%%[,-]*}"
  else
    echo "$head"
  fi
}

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  IN_SLURM=1
  CONFIG=${CONFIG:-configs/kimi-k25.yaml}  # its train section; CONFIG=configs/kimi-k25.yaml#train-mla: the MLA drafter
  NNODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}
  GPUS=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-8}}
  GPUS_PER_NODE=${GPUS_PER_NODE:-${GPUS##*:}}  # "h100:8" -> 8
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
else
  IN_SLURM=0
  CONFIG=${CONFIG:-configs/demo/train.yaml}
  NNODES=1
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}
  else
    GPUS_PER_NODE=${GPUS_PER_NODE:-2}
    ACCEL_CONFIG=${ACCEL_CONFIG:-configs/accelerate/cpu-2proc-zero2.yaml}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  fi
fi
if [[ "$NNODES" -gt 1 ]]; then
  ACCEL_CONFIG=${ACCEL_CONFIG:-configs/accelerate/multinode-zero2-bf16.yaml}
else
  ACCEL_CONFIG=${ACCEL_CONFIG:-configs/accelerate/gpu-8-zero2-bf16.yaml}
fi
NUM_PROCESSES=$((NNODES * GPUS_PER_NODE))
MAIN_ADDR=${MAIN_ADDR:-$(first_host)}
MAIN_PORT=${MAIN_PORT:-29500}
export MAIN_ADDR MAIN_PORT GPUS_PER_NODE CONFIG ACCEL_CONFIG

# The launch for machine rank $1. Options before "${ARGS[@]}" so that the user's arguments win.
launch_cmd() {
  CMD=("$PYTHON" -m accelerate.commands.launch
       --config_file "$ACCEL_CONFIG"
       --num_machines "$NNODES" --num_processes "$NUM_PROCESSES" --machine_rank "$1"
       --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT"
       train/main.py --config "$CONFIG" --resume auto)
  if [[ -n "${DATA:-}" ]]; then CMD+=(--data "$DATA"); fi
  if [[ -n "${OUT:-}" ]]; then CMD+=(--out "$OUT"); fi
  CMD+=(${ARGS[@]+"${ARGS[@]}"})
}

if [[ "$NODE_LAUNCH" == 1 ]]; then
  launch_cmd "${SLURM_NODEID:?--node-launch runs under srun, which sets SLURM_NODEID}"
  log "node ${SLURM_NODEID} ($(hostname)): ${CMD[*]}"
  exec "${CMD[@]}"
fi

if [[ "$IN_SLURM" == 1 ]]; then
  SRUN=(srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1
        bash "$REPO/slurm/train.sh" --node-launch ${ARGS[@]+"${ARGS[@]}"})
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "srun: ${SRUN[*]}"
    for ((rank = 0; rank < NNODES; rank++)); do
      launch_cmd "$rank"
      echo "node $rank: ${CMD[*]}"
    done
    exit 0
  fi
  log "$NNODES node(s) x $GPUS_PER_NODE GPUs, main $MAIN_ADDR:$MAIN_PORT, config $CONFIG, accelerate $ACCEL_CONFIG"
  requeue() {
    log "USR1 before the time limit: requeueing job $SLURM_JOB_ID (resumes from the newest checkpoint)"
    scontrol requeue "$SLURM_JOB_ID"
  }
  trap requeue USR1
  set +e
  "${SRUN[@]}" &
  SRUN_PID=$!
  wait "$SRUN_PID"
  status=$?
  while kill -0 "$SRUN_PID" 2>/dev/null; do  # a trapped signal interrupts wait; keep waiting for srun
    wait "$SRUN_PID"
    status=$?
  done
  exit "$status"
else
  launch_cmd 0
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "node 0: ${CMD[*]}"
    exit 0
  fi
  log "${CMD[*]}"
  exec "${CMD[@]}"
fi
