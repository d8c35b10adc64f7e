#!/usr/bin/env bash
# SGLang server for the target with the exported EAGLE-3 drafter (or without it, for the baseline).
#
#   sbatch slurm/serve.sh                              # Kimi-K2.5 + the drafter in $DRAFT, EAGLE3, TP 8
#   sbatch slurm/serve.sh --base                       # the same target without speculation (the baseline)
#   bash slurm/serve.sh --dry-run [--base] [options]   # print the command instead of running it
#   bash slurm/serve.sh --draft DIR -- --mem-fraction-static 0.85   # after "--": extra sglang arguments
#
# Options (environment variable in brackets; SERVE_CONFIG names a config's serve section of the same settings in
# lower case, default configs/kimi-k25.yaml#serve): --target DIR [TARGET], --draft DIR [DRAFT], --tp N [TP],
# --port N [PORT], --host H [HOST], --max-running-requests N [MAX_RUNNING_REQUESTS],
# --cuda-graph-max-bs N [CUDA_GRAPH_MAX_BS], --steps N [SPEC_STEPS], --topk N [SPEC_TOPK],
# --draft-tokens N [SPEC_DRAFT_TOKENS], --context-length N [CONTEXT_LENGTH], --base, --dry-run.
#
# --max-running-requests and --cuda-graph-max-bs are always passed: without them SGLang caps speculative
# serving at 48 running requests (speculative_hook._handle_eagle_family), which cost the write-up this
# project started from 2,370 -> 849 tok/s. Base and EAGLE-3 get the same limits so the comparison is fair.
# The speculative settings: the options/environment first, else what `python -m eval.export` recorded in
# $DRAFT/redraft.json (the launch command it printed), else SGLang's own choice for the DeepSeek/Kimi family:
# steps 3, topk 1, draft tokens 4.
#
# Flag names checked against sgl-project/sglang python/sglang/srt/server_args.py (ServerArgs fields
# model_path, tp_size, max_running_requests, cuda_graph_max_bs, speculative_algorithm,
# speculative_draft_model_path, speculative_num_steps, speculative_eagle_topk, speculative_num_draft_tokens,
# context_length, trust_remote_code; the CLI flag is the field name with dashes).
#SBATCH --job-name=redraft-serve
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --time=12:00:00
#SBATCH --open-mode=append
#SBATCH --output=logs/serve-%j.log
set -euo pipefail

REPO=${REDRAFT_REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
cd "$REPO"
# The interpreter: PYTHON, else (in a Slurm job) REDRAFT_ENGINE_PYTHON, the venv with SGLang on the GPU nodes,
# else this checkout's .venv; a server start stops here when that python has no SGLang (--dry-run does not).
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  PYTHON=${PYTHON:-${REDRAFT_ENGINE_PYTHON:-$REPO/.venv/bin/python}}
else
  PYTHON=${PYTHON:-$REPO/.venv/bin/python}
fi
log() { echo "[slurm/serve.sh] $*" >&2; }
die() { log "error: $*"; exit 2; }

# Settings: a config's serve section (default configs/kimi-k25.yaml#serve, read by `redraft config`); the environment
# and the options win.
SERVE_KEYS=" TARGET DRAFT TP HOST PORT MAX_RUNNING_REQUESTS CUDA_GRAPH_MAX_BS SPEC_STEPS SPEC_TOPK SPEC_DRAFT_TOKENS CONTEXT_LENGTH "
SERVE_CONFIG=${SERVE_CONFIG:-configs/kimi-k25.yaml#serve}
[[ -x "$PYTHON" ]] || die "PYTHON=$PYTHON is not an executable interpreter; set PYTHON (or REDRAFT_ENGINE_PYTHON) to the python of the venv with redraft[sglang]"
SETTINGS=$("$PYTHON" -m redraft config "$SERVE_CONFIG" --stage serve --env) \
  || die "SERVE_CONFIG=$SERVE_CONFIG: cannot be read (above)"
while IFS= read -r line; do
  [[ -z "$line" ]] && continue
  key=${line%%=*}; value=${line#*=}
  [[ "$SERVE_KEYS" == *" $key "* ]] || die "$SERVE_CONFIG: unknown setting '${key,,}' (known:${SERVE_KEYS,,})"
  [[ -n "${!key:-}" ]] || printf -v "$key" '%s' "$value"
done <<< "$SETTINGS"

TARGET=${TARGET:-/models/Kimi-K2.5}
DRAFT=${DRAFT:-/scratch/redraft/kimi-k25/export/sglang}
TP=${TP:-8}
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-30000}
MAX_RUNNING_REQUESTS=${MAX_RUNNING_REQUESTS:-256}
CUDA_GRAPH_MAX_BS=${CUDA_GRAPH_MAX_BS:-}
SPEC_STEPS=${SPEC_STEPS:-}
SPEC_TOPK=${SPEC_TOPK:-}
SPEC_DRAFT_TOKENS=${SPEC_DRAFT_TOKENS:-}
CONTEXT_LENGTH=${CONTEXT_LENGTH:-}
MODE=eagle3
DRY_RUN=0
EXTRA=()

need() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --base) MODE=base; shift ;;
    --target) need "$@"; TARGET=$2; shift 2 ;;
    --draft) need "$@"; DRAFT=$2; shift 2 ;;
    --tp) need "$@"; TP=$2; shift 2 ;;
    --host) need "$@"; HOST=$2; shift 2 ;;
    --port) need "$@"; PORT=$2; shift 2 ;;
    --max-running-requests) need "$@"; MAX_RUNNING_REQUESTS=$2; shift 2 ;;
    --cuda-graph-max-bs) need "$@"; CUDA_GRAPH_MAX_BS=$2; shift 2 ;;
    --steps) need "$@"; SPEC_STEPS=$2; shift 2 ;;
    --topk) need "$@"; SPEC_TOPK=$2; shift 2 ;;
    --draft-tokens) need "$@"; SPEC_DRAFT_TOKENS=$2; shift 2 ;;
    --context-length) need "$@"; CONTEXT_LENGTH=$2; shift 2 ;;
    --) shift; EXTRA+=("$@"); break ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
CUDA_GRAPH_MAX_BS=${CUDA_GRAPH_MAX_BS:-$MAX_RUNNING_REQUESTS}
for v in TP PORT MAX_RUNNING_REQUESTS CUDA_GRAPH_MAX_BS; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a positive integer, got '${!v}'"
done

CMD=("$PYTHON" -m sglang.launch_server
     --model-path "$TARGET" --tp-size "$TP" --trust-remote-code
     --host "$HOST" --port "$PORT"
     --max-running-requests "$MAX_RUNNING_REQUESTS" --cuda-graph-max-bs "$CUDA_GRAPH_MAX_BS")

if [[ "$MODE" == eagle3 ]]; then
  # Settings the export recorded (eval/export.py writes redraft.json with the launch command it printed),
  # where the options and environment left them unset.
  if [[ -f "$DRAFT/redraft.json" ]]; then
    read -r J_STEPS J_TOPK J_TOKENS < <("$PYTHON" - "$DRAFT/redraft.json" <<'PY'
import json, shlex, sys
rec = json.load(open(sys.argv[1]))
argv = shlex.split(rec.get("command") or "")
def flag(name):
    key = name.lstrip("-").replace("-", "_")
    if rec.get(key) is not None:
        return rec[key]
    return argv[argv.index(name) + 1] if name in argv[:-1] else "-"
print(*(flag(f) for f in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")))
PY
    ) || die "cannot read $DRAFT/redraft.json"
    [[ "$J_STEPS" == - ]] || SPEC_STEPS=${SPEC_STEPS:-$J_STEPS}
    [[ "$J_TOPK" == - ]] || SPEC_TOPK=${SPEC_TOPK:-$J_TOPK}
    [[ "$J_TOKENS" == - ]] || SPEC_DRAFT_TOKENS=${SPEC_DRAFT_TOKENS:-$J_TOKENS}
    log "speculative settings from $DRAFT/redraft.json: steps ${SPEC_STEPS:-3}, topk ${SPEC_TOPK:-1}, draft tokens ${SPEC_DRAFT_TOKENS:-4}"
  fi
  SPEC_STEPS=${SPEC_STEPS:-3}
  SPEC_TOPK=${SPEC_TOPK:-1}
  SPEC_DRAFT_TOKENS=${SPEC_DRAFT_TOKENS:-4}
  for v in SPEC_STEPS SPEC_TOPK SPEC_DRAFT_TOKENS; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a positive integer, got '${!v}'"
  done
  if [[ "$SPEC_TOPK" == 1 && "$SPEC_DRAFT_TOKENS" != $((SPEC_STEPS + 1)) ]]; then
    log "warning: with topk 1 SGLang forces num_draft_tokens = steps + 1 = $((SPEC_STEPS + 1)) (not $SPEC_DRAFT_TOKENS)"
    SPEC_DRAFT_TOKENS=$((SPEC_STEPS + 1))
  fi
  if [[ "$MAX_RUNNING_REQUESTS" -le 48 ]]; then
    log "WARNING: --max-running-requests $MAX_RUNNING_REQUESTS: concurrency above it queues (SGLang's speculative default is 48)"
  fi
  if [[ -f "$DRAFT/config.json" ]]; then
    # The doctor's static checks (python -m serve.doctor --before-launch): the ids as this SGLang reads them (every
    # version known to redraft when its SGLang is not installed, as in --dry-run) and the context. A finding stops
    # a launch: the server would start and serve the drafter at other layers, or SGLang would refuse the context.
    SGLANG_VERSION=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('sglang'))" 2>/dev/null || true)
    DOCTOR=("$PYTHON" -m serve.doctor --before-launch "$DRAFT" --engine sglang --context-length "${CONTEXT_LENGTH:-262144}")
    [[ -n "$SGLANG_VERSION" ]] && DOCTOR+=(--engine-version "$SGLANG_VERSION")
    if ! (cd "$REPO" && "${DOCTOR[@]}") >&2; then
      [[ "$DRY_RUN" == 1 ]] || die "the drafter folder $DRAFT would not be served as trained (serve.doctor above)"
      log "warning: serve.doctor found the above; a launch would stop here"
    fi
  else
    log "warning: $DRAFT/config.json not found (fine for --dry-run; the server will fail to start)"
  fi
  CMD+=(--speculative-algorithm EAGLE3 --speculative-draft-model-path "$DRAFT"
        --speculative-num-steps "$SPEC_STEPS" --speculative-eagle-topk "$SPEC_TOPK"
        --speculative-num-draft-tokens "$SPEC_DRAFT_TOKENS")
fi
if [[ -n "$CONTEXT_LENGTH" ]]; then CMD+=(--context-length "$CONTEXT_LENGTH"); fi
CMD+=(${EXTRA[@]+"${EXTRA[@]}"})

if [[ "$DRY_RUN" == 1 ]]; then
  echo "${CMD[*]}"
  exit 0
fi
"$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)" \
  || die "$PYTHON has no SGLang; set PYTHON (or REDRAFT_ENGINE_PYTHON) to the python of the venv with redraft[sglang]"
log "$MODE server on $(hostname):$PORT (loading Kimi-K2.5 takes 5-10 minutes); benchmark it with"
log "  python -m serve.bench --${MODE/eagle3/eagle} http://$(hostname):$PORT --tokenizer $TARGET --trust-remote-code"
log "${CMD[*]}"
exec "${CMD[@]}"
