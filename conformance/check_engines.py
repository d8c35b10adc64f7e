"""Engine loading conformance: our exports in SGLang's and vLLM's real loaders, broken ones refused.

    python -m conformance.check_engines WORK/exports --engine-python ENGINE_VENV/bin/python [--foreign WORK/foreign]

For every ``<name>.json`` in the exports folder (written by ``conformance.make_drafters``):

1. ``python -m eval.verify_engine`` (run by the engine venv's python) loads ``<name>-sglang`` and
   ``<name>-vllm`` in both engines (or, when the drafter's json says ``"engines": "matching"``, each
   in its own engine: the Kimi-sized one) and must say PASS;
2. negative controls: copies of the demo export with a renamed key, without ``d2t``, and with
   ``model.``-prefixed keys must be refused by our own pre-check (``check_serving_state``) AND by
   the engines (renamed / no d2t: both FAIL; ``model.`` prefix: vLLM FAILs).

Then every ``<name>.json`` in the foreign folder (MLA drafters in the engines' layout, which our
exporter does not write yet) is loaded in both engines and must get the verdicts it names
(``expect``), with the target config it names for vLLM; and copies of the small MLA drafter with a
renamed MLA key and without ``d2t`` must FAIL in both.
Exit code 0 only when every expectation holds. (Which layers each engine captures for an export's ids is
asked of the engines themselves: tests/engine/sglang/test_sglang_capture.py and tests/engine/vllm/test_vllm_capture.py.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from redraft.core import cli as ending

log = logging.getLogger("conformance.check_engines")

VERDICT_RE = re.compile(r"^VERDICT (?P<engine>\w+) (?P<status>PASS|FAIL|ERROR)\b[:( ]?(?P<detail>.*)$")

# The negative controls: (name, format of the export to break, engines that must FAIL)
BROKEN = (
    ("renamed", "sglang", ("sglang", "vllm")),
    ("no-d2t", "sglang", ("sglang", "vllm")),
    ("model-prefix", "vllm", ("vllm",)),
)
RENAMED_FROM, RENAMED_TO = "midlayer.mlp.up_proj.weight", "midlayer.mlp.upp_proj.weight"
# the MLA controls, on the small MLA drafter: kv_a_proj_with_mqa is the key SGLang fuses with q_a_proj
# (renamed, SGLang silently drops both; vLLM rejects the unknown name), d2t as for the Llama drafters
MLA_BASE = "mla-small"
MLA_BROKEN = (("renamed-mla", {"midlayer.self_attn.kv_a_proj_with_mqa.weight": "midlayer.self_attn.kv_a_proj.weight"}),
              ("no-d2t", None))
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Verdict:
    engine: str
    status: str  # PASS | FAIL | ERROR
    detail: str


def parse_verdicts(text: str) -> dict[str, Verdict]:
    """The ``VERDICT <engine> PASS|FAIL|ERROR ...`` lines of the engine check's output, by engine."""
    out: dict[str, Verdict] = {}
    for line in text.splitlines():
        m = VERDICT_RE.match(line.strip())
        if m:
            out[m["engine"]] = Verdict(m["engine"], m["status"], m["detail"].strip())
    return out


def expect_verdicts(verdicts: dict[str, Verdict], rc: int, want: dict[str, str]) -> list[str]:
    """Problems when the parsed verdicts (and exit code) differ from ``want`` (engine -> PASS|FAIL)."""
    problems = [f"{engine}: no VERDICT line" for engine in want if engine not in verdicts]
    for engine, status in want.items():
        got = verdicts.get(engine)
        if got is not None and got.status != status:
            problems.append(f"{engine}: expected {status}, got {got.status} {got.detail}"[:400])
    expected_rc = 0 if all(s == "PASS" for s in want.values()) else 1
    if rc != expected_rc:
        problems.append(f"exit code {rc}, expected {expected_rc} (2 = the check could not run)")
    return problems


# ----------------------------------------------------------------------------- broken exports


def break_export(good: Path, out: Path, kind: str, renames: dict[str, str] | None = None) -> Path:
    """A copy of ``good`` with one deliberate defect in model.safetensors (config.json untouched).

    ``renamed`` renames ``renames`` (default: the Llama MLP's up_proj); a key that is not there is an
    error, so a control can never silently break nothing.
    """
    from safetensors.torch import load_file, save_file

    state = load_file(str(good / "model.safetensors"))
    if kind in ("renamed", "renamed-mla"):
        for old, new in (renames or {RENAMED_FROM: RENAMED_TO}).items():
            if old not in state:
                raise KeyError(f"{good / 'model.safetensors'}: no key {old!r} to rename")
            state[new] = state.pop(old)
    elif kind == "no-d2t":
        del state["d2t"]
    elif kind == "model-prefix":
        state = {f"model.{k}": v for k, v in state.items()}
    else:
        raise ValueError(f"unknown defect {kind!r}")
    if out.exists():
        shutil.rmtree(out)
    tmp = out.with_name(f".tmp-{out.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name in ("config.json", "redraft.json"):
        if (good / name).is_file():
            shutil.copy(good / name, tmp / name)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.replace(tmp, out)
    return out


def precheck_problems(folder: Path) -> str | None:
    """Our own table check (redraft.core.drafter.serving_format) on the folder's raw keys; None when it passes."""
    from safetensors.torch import load_file

    from redraft.core.drafter.config import DrafterConfig
    from redraft.core.drafter.serving_format import ServingFormatError, check_serving_state

    record = json.loads((folder / "redraft.json").read_text())
    cfg = DrafterConfig.from_dict(record["drafter"])
    try:
        check_serving_state(load_file(str(folder / "model.safetensors")), cfg, record.get("serving_format", "sglang"))
    except ServingFormatError as e:
        return str(e)
    return None


# ----------------------------------------------------------------------------- running the engine check


def engine_check(python: str, folder: Path, engine: str, context: int | None, logdir: Path,
                 target_config: Path | None = None) -> tuple[int, dict[str, Verdict], float]:
    """``python -m eval.verify_engine`` on ``folder`` in the engine venv, from the repository root; its log kept."""
    cmd = [python, "-m", "eval.verify_engine", str(folder), "--engine", engine]
    if context:
        cmd += ["--context-length", str(context)]
    if target_config:
        cmd += ["--target-config", str(target_config)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    took = time.time() - t0
    logdir.mkdir(parents=True, exist_ok=True)
    (logdir / f"{folder.name}.{engine}.log").write_text(proc.stdout)
    verdicts = parse_verdicts(proc.stdout)
    for v in verdicts.values():
        print(f"  [{took:5.1f}s] {folder.name:<28} VERDICT {v.engine} {v.status} {v.detail[:150]}")
    return proc.returncode, verdicts, took


def check_foreign(python: str, foreign: Path, logdir: Path) -> tuple[list[str], int]:
    """The MLA drafters (each must get the verdicts its json names) and the MLA negative controls."""
    failures: list[str] = []
    metas = sorted((json.loads(f.read_text()) for f in foreign.glob("*.json") if f.name != "kimi-k25-target.json"),
                   key=lambda m: m["name"])
    for meta in metas:
        target = foreign / meta["target_config"] if meta.get("target_config") else None
        rc, verdicts, _ = engine_check(python, foreign / meta["folder"], "both", meta.get("context_length"), logdir,
                                       target)
        failures += [f"{meta['name']} ({meta['why']}): {msg}" for msg in expect_verdicts(verdicts, rc, meta["expect"])]
    names = {m["name"] for m in metas}
    if MLA_BASE not in names:
        return [*failures, f"{foreign}: no {MLA_BASE}.json, so the MLA negative controls cannot run"], len(metas)
    for kind, renames in MLA_BROKEN:
        bad = break_export(foreign / MLA_BASE, foreign.parent / "broken" / f"{MLA_BASE}-{kind}", kind, renames)
        rc, verdicts, _ = engine_check(python, bad, "both", None, logdir)
        failures += [f"{bad.name} (negative control): {msg}"
                     for msg in expect_verdicts(verdicts, rc, {"sglang": "FAIL", "vllm": "FAIL"})]
    return failures, len(metas)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.check_engines", description=__doc__.split("\n\n")[0])
    p.add_argument("exports", type=Path, help="folder written by conformance.make_drafters")
    p.add_argument("--engine-python", required=True, help="python of the venv built by conformance/make_venv.sh engine")
    p.add_argument("--foreign", type=Path, help="folder of MLA drafters written by `conformance.make_drafters mla`")
    p.add_argument("--engine", default="both", choices=("sglang", "vllm", "both"),
                   help="engines for the good exports (default both)")
    a = p.parse_args(argv)
    ending.configure_logging(logging.INFO, "[check_engines] %(message)s")
    exports = a.exports.resolve()
    logdir = exports.parent / "engine-logs"
    engines = ("sglang", "vllm") if a.engine == "both" else (a.engine,)
    failures: list[str] = []
    names = sorted(json.loads(f.read_text())["name"] for f in exports.glob("*.json"))
    if not names:
        raise SystemExit(f"{exports}: no exported drafters (<name>.json) to check")
    for name in names:
        meta = json.loads((exports / f"{name}.json").read_text())
        for fmt in ("sglang", "vllm"):
            folder = exports / f"{name}-{fmt}"
            use = engines if meta.get("engines", "both") == "both" else tuple(e for e in engines if e == fmt)
            if not use:
                continue
            want = {e: "PASS" for e in use}
            which = "both" if len(use) == 2 else use[0]
            rc, verdicts, _ = engine_check(a.engine_python, folder, which, meta.get("context_length"), logdir)
            failures += [f"{folder.name}: {msg}" for msg in expect_verdicts(verdicts, rc, want)]
    # negative controls on the demo drafter (small: seconds per engine)
    base = "demo" if "demo" in names else names[0]
    for kind, fmt, must_fail in BROKEN:
        bad = break_export(exports / f"{base}-{fmt}", exports.parent / "broken" / f"{base}-{fmt}-{kind}", kind)
        if precheck_problems(bad) is None:
            failures.append(f"{bad.name}: our own pre-check (check_serving_state) accepted it")
        engine = "both" if len(must_fail) == 2 else must_fail[0]
        rc, verdicts, _ = engine_check(a.engine_python, bad, engine, None, logdir)
        failures += [f"{bad.name} (negative control): {msg}"
                     for msg in expect_verdicts(verdicts, rc, {e: "FAIL" for e in must_fail})]
    foreign_count = 0
    if a.foreign is not None:
        found, foreign_count = check_foreign(a.engine_python, a.foreign.resolve(), logdir)
        failures += found
    print()
    if failures:
        print("ENGINE CONFORMANCE FAILED:")
        for msg in failures:
            print(f"  - {msg}")
        return 1
    print(f"ENGINE CONFORMANCE OK: {len(names)} drafters x 2 formats load whole in {' and '.join(engines)}; "
          f"{len(BROKEN)} broken exports refused by us and by the engines"
          + (f"; {foreign_count} MLA drafters as expected, {len(MLA_BROKEN)} broken ones refused" if foreign_count else ""))
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("conformance.check_engines")))
