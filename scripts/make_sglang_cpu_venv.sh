#!/usr/bin/env bash
# Build the SGLang CPU venv that redraft's `--backend sglang` drives (never .venv: SGLang pins its own stack).
#
#   bash scripts/make_sglang_cpu_venv.sh [VENV_DIR]     # default $SGLANG_CPU_VENV or ~/.cache/redraft/sglang-cpu
#   make sglang-cpu-venv [SGLANG_CPU_VENV=DIR]
#
# Idempotent: a venv whose stamp names the same lock, Python and SGLang and still passes the smoke import is kept
# (seconds); otherwise the missing steps run (about 2 min and 3.5 GB on a quiet 2-core machine).
# Why each step (docs/engine-truth.md, the SGLang CPU section):
#  * torch 2.13.0+cpu first, with --no-deps: from pip's configured indexes (a wheel folder in PIP_FIND_LINKS,
#    a mirror), else from PyTorch's CPU index (scripts/pip_cpu_args.py); any other build is refused. SGLang 0.5.23 pins torch 2.14.1 but runs on 2.13.0.
#  * then every other distribution, pinned exactly in requirements/sglang-cpu.txt, with --no-deps: pip resolves
#    nothing, and SGLang's CUDA-only requirements (flashinfer, sglang-kernel, nvidia-*, ...: GBs) stay out.
#    The lock's header says how it was produced and what was left out.
#  * torchvision 0.28.0 is the index's CUDA build; its compiled ops cannot load beside CPU torch, which
#    redraft/engines/sglang_cpu/site/sitecustomize.py handles at import time. SGLang's `sgl_kernel` is not installed:
#    redraft's pure-PyTorch stand-in (redraft/engines/sglang_cpu/site/sgl_kernel) is put on PYTHONPATH when redraft
#    starts the engine, and the smoke import below does the same.
set -euo pipefail
START=$(date +%s)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
V="${1:-${SGLANG_CPU_VENV:-$HOME/.cache/redraft/sglang-cpu}}"
PY="${PYTHON:-python3}"
LOCK="$ROOT/requirements/sglang-cpu.txt"
SGLANG="sglang==0.5.23"
TORCH_VERSION="2.13.0+cpu"
STAMP="$V/.redraft-sglang-cpu"
PIPLOG="$V/.redraft-pip.log"

log() { echo "[make_sglang_cpu_venv $(( $(date +%s) - START ))s] $*"; }
die() { echo "[make_sglang_cpu_venv $(( $(date +%s) - START ))s] ERROR: $*" >&2; exit 1; }

[ -f "$LOCK" ] || die "$LOCK: lock file missing"
grep -qx "$SGLANG" "$LOCK" || die "$LOCK does not pin $SGLANG"

smoke() {  # what redraft's engine start needs, with the PYTHONPATH and env it will use; prints one line
    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$ROOT:$ROOT/redraft/engines/sglang_cpu/site" \
        "$V/bin/python" -W ignore::UserWarning - "$SGLANG" "$TORCH_VERSION" <<'EOF'
import sys
import sglang, torch, torchvision, sgl_kernel  # noqa: F401,E401
from sglang.srt.entrypoints.engine import Engine  # noqa: F401
want_sglang, want_torch = sys.argv[1].split("==")[1], sys.argv[2]
found = f"sglang {sglang.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}"
if (sglang.__version__, torch.__version__) != (want_sglang, want_torch):
    sys.exit(f"wrong versions: {found} (want sglang {want_sglang}, torch {want_torch})")
print(f"{found}; sgl_kernel stand-in {sgl_kernel.__file__}")
EOF
}

want() {  # the stamp: lock hash + the venv's Python + SGLang
    echo "$(sha256sum "$LOCK" | cut -d' ' -f1) $("$V/bin/python" -c 'import platform; print(platform.python_version())') $SGLANG"
}

pip_install() {  # pip_install WHAT ARGS...: pip quietly into $PIPLOG; its tail and a clear message on failure
    local what=$1; shift
    if ! "$V/bin/python" -m pip --disable-pip-version-check install "$@" >"$PIPLOG" 2>&1; then
        echo "---- last 25 lines of $PIPLOG ----" >&2
        grep -v "is ignored: it is neither a file nor a directory" "$PIPLOG" | tail -n 25 >&2
        die "pip could not install $what (is the package index reachable? a pin gone?); full log: $PIPLOG"
    fi
}

if [ -x "$V/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$(want)" ]; then
    if found=$(smoke 2>/dev/null); then
        log "$SGLANG already installed in $V: $found"
        exit 0
    fi
    log "stamp matches but the smoke import fails: reinstalling"
fi

"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null \
    || die "$PY is not Python >= 3.11 ($SGLANG requires it); set PYTHON"
if [ ! -x "$V/bin/python" ]; then
    log "creating venv at $V"
    mkdir -p "$(dirname "$V")"
    "$PY" -m venv "$V" || die "$PY -m venv $V failed"
fi
rm -f "$STAMP"

read -r -a EXTRA <<< "$("$V/bin/python" "$(dirname "$0")/pip_cpu_args.py" --pip "$V/bin/pip" --spec "torch==$TORCH_VERSION")"
log "installing torch==$TORCH_VERSION (--no-deps${EXTRA[*]:+, ${EXTRA[*]}})"
pip_install "torch==$TORCH_VERSION" --no-deps "${EXTRA[@]}" "torch==$TORCH_VERSION"
got=$("$V/bin/python" -c "import importlib.metadata as m; print(m.version('torch'))")
[ "$got" = "$TORCH_VERSION" ] || die "pip installed torch $got, not $TORCH_VERSION: put the torch-$TORCH_VERSION wheel" \
    "in PIP_FIND_LINKS, or let scripts/pip_cpu_args.py reach PyTorch's CPU index; a CUDA torch would pull GBs of nvidia-* packages"

log "installing $(grep -c '^[^#].*==' "$LOCK") pinned distributions from requirements/$(basename "$LOCK") (--no-deps)"
pip_install "requirements/$(basename "$LOCK")" --no-deps -r "$LOCK"
cuda=$("$V/bin/python" -c "import importlib.metadata as m; print(' '.join(sorted({d.metadata['Name'] for d in
    m.distributions() if d.metadata['Name'].lower().startswith(('nvidia-', 'nvidia_', 'cuda-', 'cuda_'))})))")
[ -z "$cuda" ] || die "$V holds CUDA packages ($cuda), left from an earlier install? delete $V and run again"

log "smoke import (SGLANG_USE_CPU_ENGINE=1, PYTHONPATH with redraft's sgl_kernel stand-in)"
found=$(smoke) || die "the venv at $V was installed but its smoke import fails (see above)"
log "$found"
want > "$STAMP"
du -sh "$V" 2>/dev/null | awk '{print "[make_sglang_cpu_venv] venv size: " $1}'
log "done: $V"
