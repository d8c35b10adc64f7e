"""Load a drafter folder with SGLang's and vLLM's REAL model classes and loaders, on CPU; say what landed.

    python -m eval.verify_engine FOLDER [--engine sglang|vllm|both]
        [--target-config TARGET/config.json] [--context-length N] [--json REPORT.json] [--verbose]
    python -m eval.export CKPT OUT --format sglang --verify-with sglang      # the same on a fresh export

Run by a python that has the engine: the serving box, or the venv that ``conformance/make_venv.sh engine``
builds (the CI lane runs every export through it). Why: SGLang skips weight names it does not know and
leaves the parameter as uninitialised memory, vLLM rejects ``model.``-prefixed names, and a missing ``d2t``
makes both use draft ids as target ids; none of that raises at serve time. The procedure is
``eval.loadcheck`` (it imports nothing of ``core``: it judges an export without sharing the exporter's
tables). Handles both EAGLE-3 drafter architectures:
``LlamaForCausalLMEagle3`` and the MLA drafter ``Eagle3DeepseekV2ForCausalLM``. No forward pass runs.
For every engine it prints the table (NOT LOADED / IGNORED / REJECTED / USED / SKIPPED / BY DESIGN)
and one line ``VERDICT <engine> PASS|FAIL|ERROR ...``; ``--engine both`` runs each engine in its own
process (two engines' globals must not meet) and adds ``VERDICT both ...``.

Exit code: 0 PASS (every parameter written or left to the target by the engine's rule, every key
used or dropped by design, d2t valid); 1 FAIL; 2 could not run (bad usage, unreadable folder, an
engine that is missing or whose internals moved).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from redraft.core import cli as ending
from redraft.core import options
from redraft.core.config import ConfigError
from redraft.core.options import option

ENGINES = ("sglang", "vllm")
ROOT = Path(__file__).resolve().parents[1]


def run_one(engine: str, a: VerifyEngineOptions) -> int:
    """One engine in this process: the report's table, warnings, and its VERDICT line."""
    from eval.loadcheck.check import SetupError, run_check
    from eval.loadcheck.folder import FolderError, read_folder

    try:
        folder = read_folder(a.folder)
        if engine == "sglang":
            from eval.loadcheck.sglang_engine import SGLangEngine

            eng = SGLangEngine(folder, a.context_length)
        else:
            from eval.loadcheck.vllm_engine import VLLMEngine

            eng = VLLMEngine(folder, a.context_length, a.target_config)
        report = run_check(eng, folder, verbose=a.verbose)
    except (FolderError, SetupError) as e:
        print(f"VERDICT {engine} ERROR: {e}")
        return 2
    except Exception as e:  # noqa: BLE001 - a crash of the check itself is "could not run", never a PASS
        import traceback

        traceback.print_exc()
        print(f"VERDICT {engine} ERROR: the check itself crashed: {type(e).__name__}: {e}"[:500])
        return 2
    print(f"{engine}: {report.version}, {report.model_class or '(not built)'}, {folder.path}")
    for line in report.lines:
        print(line)
    for w in report.warnings:
        print(f"  WARNING      {w}")
    if a.json:
        Path(a.json).write_text(json.dumps(report.to_json(), indent=1) + "\n")
    print(report.verdict())
    return 0 if report.ok else 1


def child_args(a: VerifyEngineOptions, engine: str) -> list[str]:
    """The command line of one engine's child process, rebuilt from the parsed options."""
    out = [a.folder, "--engine", engine]
    if a.target_config:
        out += ["--target-config", a.target_config]
    if a.context_length:
        out += ["--context-length", str(a.context_length)]
    if a.json:
        out += ["--json", f"{a.json}.{engine}.json"]
    if a.verbose:
        out.append("--verbose")
    return out


def run_both(a: VerifyEngineOptions) -> int:
    """Each engine in a child process; the combined verdict: ERROR if either could not run, else FAIL/PASS."""
    status: dict[str, str] = {}
    codes = []
    for engine in ENGINES:
        cmd = [sys.executable, "-m", "eval.verify_engine", *child_args(a, engine)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        sys.stdout.write(proc.stdout)
        sys.stdout.flush()
        codes.append(proc.returncode)
        status[engine] = {0: "PASS", 1: "FAIL"}.get(proc.returncode, "ERROR")
    overall = "ERROR" if 2 in codes or any(c not in (0, 1) for c in codes) else ("FAIL" if 1 in codes else "PASS")
    print(f"VERDICT both {overall}: " + ", ".join(f"{e} {s}" for e, s in status.items()))
    return {"PASS": 0, "FAIL": 1}.get(overall, 2)


@dataclass(kw_only=True)
class VerifyEngineOptions:
    """The options of python -m eval.verify_engine (redraft.core.options)."""

    folder: str = option(help="drafter folder: config.json + model.safetensors", group="inputs", positional=True)
    engine: str = option("both", "whose loader checks the folder", group="engine", choices=(*ENGINES, "both"))
    target_config: str | None = option(None, "vLLM only: the target's config.json (default: synthesised from the "
                                             "draft; a DeepSeek-V3-style MoE target for an MLA drafter)",
                                       group="engine")
    context_length: int | None = option(None, "behave like a target with this context length", group="engine",
                                        metavar="N")
    json: str | None = option(None, "the full report (per parameter and per key)", group="output", metavar="FILE")
    verbose: bool = option(False, "show the engines' own output", group="output")


PROG = "python -m eval.verify_engine"


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(VerifyEngineOptions, prog=PROG, description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = options.parse(VerifyEngineOptions, argv, prog=PROG, description=__doc__.split("\n\n")[0], section="loadcheck")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(sys.prefix) / "vllm-cache"))  # the registry's cache
    if a.engine == "both":
        return run_both(a)
    return run_one(a.engine, a)


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as redraft.core.cli ends every command (one line and exit 2 on a mistake)."""
    return ending.run(lambda: main(argv), logging.getLogger("eval.verify_engine"))


if __name__ == "__main__":
    sys.exit(cli())
