#!/usr/bin/env bash
# Streaming on one machine: extraction fills a bounded window of shards while training consumes it.
#
#   bash slurm/stream.sh DATA_DIR RUN_DIR                         # configs/demo/extract.yaml + configs/demo/train.yaml
#   WINDOW=64GiB EXTRACT_CONFIG=... TRAIN_CONFIG=... bash slurm/stream.sh /data/ds /runs/drafter [train flags...]
#
# The two sides are the two ordinary commands on one folder: `python -m extract --window-bytes $WINDOW` and
# `train/main.py --stream` (extra arguments go to training). Either may be killed and rerun with the same
# command: extraction keeps its sealed shards, training resumes its checkpoint (--resume auto). Peak disk:
# the window plus one shard. On a cluster the same two run as two jobs over a shared filesystem:
#
#   sbatch slurm/extract.sh --out /shared/ds --window-bytes 64GiB         # inference nodes (an array)
#   sbatch slurm/train.sh --data /shared/ds --stream --resume auto        # training nodes
#
# See docs/kimi-k25.md ("Streaming") for the Kimi-K2.5 recipe and its disk budget.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
die() { echo "[slurm/stream.sh] error: $*" >&2; exit 2; }
[[ $# -ge 2 ]] || die "usage: bash slurm/stream.sh DATA_DIR RUN_DIR [train flags...]"
DATA=$1 RUN=$2
shift 2
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[[ -x "$PYTHON" ]] || die "PYTHON=$PYTHON is not an executable interpreter (make venv, or set PYTHON)"
EXTRACT_CONFIG=${EXTRACT_CONFIG:-configs/demo/extract.yaml}
TRAIN_CONFIG=${TRAIN_CONFIG:-configs/demo/train.yaml}
WINDOW=${WINDOW:-8GiB}

# The window must hold the trainer's group of shards plus one: extraction checks it with the trainer's group.
SETTINGS=$("$PYTHON" -m redraft config "$TRAIN_CONFIG" --stage train) || die "$TRAIN_CONFIG: cannot be read (above)"
GROUP=$(sed -n 's/^stream_group_shards: //p' <<< "$SETTINGS" | tail -n 1)
GROUP=${GROUP:-4}

"$PYTHON" -m extract --config "$EXTRACT_CONFIG" --out "$DATA" --window-bytes "$WINDOW" --stream-group-shards "$GROUP" &
EXTRACT=$!
"$PYTHON" train/main.py --config "$TRAIN_CONFIG" --data "$DATA" --out "$RUN" --stream --resume auto "$@" &
TRAIN=$!
trap 'kill -TERM $EXTRACT $TRAIN 2>/dev/null || true' INT TERM
# Each side stops by itself when the other is gone: extraction leaves its end state in $DATA (refused, failed,
# stopped) and both keep a heartbeat there (redraft/core/dataset/liveness.py), so the trainer stops with extraction's reason
# after saving, and extraction stops when the trainer is gone. The job waits for both.
estatus=0
wait $EXTRACT || estatus=$?
tstatus=0
wait $TRAIN || tstatus=$?
status=$((tstatus ? tstatus : estatus))
echo "[slurm/stream.sh] training exit ${tstatus}, extraction exit ${estatus}; data $DATA, run $RUN" >&2
exit $status
