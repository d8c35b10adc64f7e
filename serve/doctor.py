"""The doctor: why a running speculative deployment does not pay, and the flags that fix it.

    python -m serve.doctor --url http://HOST:PORT [--drafter DIR] [--target DIR] [--base-url URL] \\
        [--tokenizer DIR] [--concurrency 1,8] [--num-prompts 8] [--max-tokens 128] [--max-seconds 300] \\
        [--offline-tau T] [--json OUT.json] [--markdown OUT.md]

1. What is running, from the engine's own endpoints (``serve.bench``'s identity: SGLang ``/server_info``, whose
   launch line and KV budget come along; vLLM ``/v1/models``, ``/version``, ``/metrics``): engine and version,
   target, speculative algorithm and steps, draft model, ``max_running_requests``, CUDA-graph batch limit, context.
2. The drafter folder (``--drafter``, else the draft model path the server reports when it exists here): its layer
   ids as *this engine version* reads them (``redraft.core.layers``), against the layers it was trained on (an
   ``eval.export`` folder records them); its context length against the server's.
3. A bounded probe (``serve.bench``: a few prompts at each ``--concurrency``, the engine's own acceptance: SGLang's
   per-request counters, vLLM's ``/metrics`` differences); beside ``--base-url`` when given (tokens/s ratios
   measured), and at most ``--max-seconds`` in all.
4. The verdict (``serve.doctor_findings``): each finding with its evidence and the exact fix; with a base, the draft
   tokens per concurrency that the probe's own step costs predict fastest (``serve.cost_model.best_chain``). ``--offline-tau``
   (τ of ``python -m eval.acceptance`` over the same kind of traffic) separates a drafter served wrongly from one
   that does not fit; ``python -m redraft.pipeline.doctor --target DIR`` computes it over the server's own replies.

``--evidence FILE``: the verdict on figures recorded elsewhere (what a probe gathers, as JSON: the engine, what the
server reported, the drafter folder's facts, each server's levels; ``docs/results/doctor-writeup/evidence.json``
is the write-up's deployment).

``--before-launch DRAFTER_DIR --engine sglang|vllm [--engine-version V] [--context-length N]``: the static checks
of point 2 with no server (the ids as that version reads them, or as every version known here reads them); what
``slurm/serve.sh`` and ``serve.tune`` run before they launch a server.

Exit status: 0 healthy (no finding), 3 findings, 2 cannot examine (bad options, an unreachable server, a probe past
``--max-seconds``); the probe's requests failing is a finding of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redraft.core import cli as ending
from redraft.core import options
from redraft.core.atomic import atomic_write_text
from redraft.core.config import ConfigError
from redraft.core.options import option
from serve import doctor_findings as rules
from serve import report as serve_report
from serve.bench import ServingConfig, run_benchmark
from serve.prompts import ServingError

log = logging.getLogger("serve.doctor")
HEALTHY, FINDINGS, CANNOT_EXAMINE = 0, 3, 2
PROG = "python -m serve.doctor"


@dataclass(kw_only=True)
class DoctorOptions:
    """The options of python -m serve.doctor (redraft.core.options)."""

    url: str | None = option(None, "the speculative server to examine (SGLang or vLLM), e.g. http://host:30000",
                             group="server")
    base_url: str | None = option(None, "a server of the same target without a drafter: the probe measures the "
                                        "speed-up against it (else no speed is judged)", group="server")
    drafter: str | None = option(None, "the drafter folder the server loads (default: the path the server reports, "
                                       "when it exists here)", group="server")
    target_architecture: str | None = option(None, "the target's architecture, e.g. KimiK25ForConditionalGeneration "
                                                   "(default: the drafter's redraft.json)", group="server")
    tokenizer: str | None = option(None, "the target's folder: prompts rendered with its chat template (SGLang then "
                                         "reports acceptance per request)", group="probe")
    trust_remote_code: bool = option(False, "allow the tokenizer's custom code (Kimi-K2.5)", group="probe")
    prompts: str | None = option(None, "prompt file (default: the embedded MT-bench first turns)", group="probe")
    concurrency: list[int] = option([1, 8], "concurrent streams probed (1 and the level you serve at)", group="probe")
    num_prompts: int = option(8, "prompts per probe level", group="probe")
    max_tokens: int = option(128, "new tokens per request", group="probe")
    max_seconds: float = option(300.0, "the whole probe's time limit", group="probe")
    offline_tau: float | None = option(None, "the drafter's τ offline on this kind of traffic (eval.acceptance)",
                                       group="probe")
    evidence: str | None = option(None, "no server: judge evidence recorded elsewhere (a JSON file: engine, what the "
                                        "server reported, the drafter folder's facts, each server's levels; "
                                        "docs/doctor.md)", group="server")
    before_launch: str | None = option(None, "no server: the static checks of this drafter folder for --engine "
                                             "(slurm/serve.sh and serve.tune run them before they launch)",
                                       group="before a launch")
    engine: str | None = option(None, "--before-launch: the engine that will serve it", group="before a launch",
                                choices=("sglang", "vllm"))
    engine_version: str | None = option(None, "--before-launch: its version (default: every version whose reading "
                                              "of layer ids is known here)", group="before a launch")
    context_length: int | None = option(None, "--before-launch: the context the server will serve",
                                        group="before a launch")
    json: str | None = option(None, "write the findings and the evidence as JSON here", group="output")
    markdown: str | None = option(None, "write them as Markdown here", group="output")

    def validate(self) -> None:
        if sum(x is not None for x in (self.url, self.before_launch, self.evidence)) != 1:
            raise ConfigError("give --url URL (a running server), --before-launch DRAFTER_DIR or --evidence FILE (no "
                              "server), one of them")
        if self.evidence is not None and not Path(self.evidence).is_file():
            raise ConfigError(f"--evidence {self.evidence}: no such file")
        if self.before_launch is not None:
            if self.engine is None:
                raise ConfigError("--before-launch: --engine sglang|vllm is required (the engine that will serve it)")
            if not (Path(self.before_launch) / "config.json").is_file():
                raise ConfigError(f"--before-launch {self.before_launch}: no config.json (not a drafter folder)")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError(f"concurrency={self.concurrency}: expected positive integers")
        if self.num_prompts < 1 or self.max_tokens < 1 or self.max_seconds <= 0:
            raise ConfigError("num_prompts, max_tokens and max_seconds: must be positive")
        if self.drafter is not None and not (Path(self.drafter) / "config.json").is_file():
            raise ConfigError(f"--drafter {self.drafter}: no config.json (not a drafter folder)")


def probe(args: DoctorOptions) -> dict[str, Any]:
    """serve.bench over the server (and the base), bounded in requests and seconds."""
    cfg = ServingConfig(base=args.base_url, eagle=args.url, concurrency=args.concurrency, max_tokens=args.max_tokens,
                        prompts=args.prompts, num_prompts=args.num_prompts, min_rounds=1, warmup=1, retries=1,
                        timeout=min(args.max_seconds, 300.0), tokenizer=args.tokenizer,
                        trust_remote_code=args.trust_remote_code)
    try:
        return asyncio.run(asyncio.wait_for(run_benchmark(cfg), timeout=args.max_seconds))
    except (asyncio.TimeoutError, TimeoutError):
        raise ServingError(f"the probe did not finish within --max-seconds {args.max_seconds:.0f}; lower "
                           "--num-prompts/--max-tokens or raise it") from None


def examine(args: DoctorOptions) -> dict[str, Any]:
    """Gather the evidence (the probe, the drafter folder), then the verdict."""
    started = time.monotonic()
    report = probe(args)
    probe_seconds = time.monotonic() - started
    server = report["servers"]["eagle"]
    info = server["info"]
    drafter_dir = args.drafter or info.get("speculative_draft_model_path")
    drafter = rules.drafter_facts(Path(drafter_dir)) if drafter_dir and (Path(drafter_dir) / "config.json").is_file() \
        else None
    result = conclude(server["engine"], info, drafter, server["levels"], report.get("comparison") or [],
                      warnings=server["warnings"], top_concurrency=max(args.concurrency),
                      target_architecture=args.target_architecture, offline_tau=args.offline_tau)
    result["url"] = args.url
    result["probe"]["seconds"] = round(probe_seconds, 1)
    result["probe"]["speed"] = ("measured against --base-url" if args.base_url else
                                "not judged (no --base-url: a base server's speed is what a speed-up is against)")
    return result


def conclude(engine: str, info: dict[str, Any], drafter: dict[str, Any] | None, levels: list[dict[str, Any]],
             comparison: list[dict[str, Any]], *, warnings: Sequence[str] = (), top_concurrency: int = 1,
             target_architecture: str | None = None, offline_tau: float | None = None) -> dict[str, Any]:
    """The verdict from the evidence alone (what the server said, the drafter folder's facts, the probe's levels
    and the comparison with the base): every finding in the order a team should fix them, and the draft plan."""
    done = [lv for lv in levels if lv["ok"]]
    # a request's tokens for sizing the cap's fix: the probe's mean reply plus as much again for its prompt (the
    # prompt's length is not reported by every API; MT-bench's first turns are shorter than its replies)
    per_request = 2 * sum(lv["output_tokens"] for lv in done) / max(sum(lv["ok"] for lv in done), 1)
    running = {"info": info, "tokens_per_request": per_request}
    findings: list[rules.Finding] = []
    if any(lv["errors"] for lv in levels):
        bad = next(lv for lv in levels if lv["errors"])
        findings.append(rules.Finding("requests-fail", "requests to the server fail",
                                      f"{bad['errors']} of {bad['requests']} at concurrency {bad['concurrency']}, "
                                      f"e.g. {bad['error_samples'][:1]}", "read the server's log"))
    for w in warnings:
        if "not running a drafter" in w:
            findings.append(rules.Finding("no-drafter", "the server runs no drafter", w,
                                          "start it with the drafter (python -m eval.export prints the launch line)"))
    checks = [rules.cap_finding(engine, running, top_concurrency)]
    if drafter is not None:
        checks += [rules.layer_finding(engine, info.get("version"), drafter, target_architecture),
                   rules.context_finding(running, drafter)]
    checks.append(rules.acceptance_finding(levels, info.get("speculative_num_steps"), offline_tau))
    findings += [f for f in checks if f is not None]
    plan = rules.draft_plan(comparison, levels, info.get("speculative_num_steps"))
    findings += rules.speed_findings(comparison, engine, plan)
    return {"url": None, "engine": engine, "running": _running_summary(info), "drafter": drafter,
            "probe": {"levels": [{k: lv.get(k) for k in ("concurrency", "requests", "ok", "errors",
                                                          "aggregate_tok_s", "per_stream_tok_s", "accept_length",
                                                          "accept_per_pos")}
                                 for lv in levels],
                      "comparison": comparison, "draft_plan": plan,
                      "speed": "measured against a base server" if comparison else "not judged"},
            "findings": [f.to_dict() for f in findings], "healthy": not findings}


EVIDENCE_KEYS = ("engine", "info", "levels")


def judge_evidence(args: DoctorOptions) -> dict[str, Any]:
    """The verdict on evidence recorded elsewhere: ``engine``, ``info`` (what the server reported, the keys of
    ``serve.bench``'s identity), ``drafter`` (:func:`serve.doctor_findings.drafter_facts`' keys, or null), ``levels``
    (the speculative server's, ``serve.bench``'s keys) and ``base_levels`` (a base server's, or absent); ``source``
    says where the numbers come from and is kept in the report."""
    path = Path(args.evidence)
    try:
        ev = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--evidence {path}: not JSON ({e.msg}, line {e.lineno})") from None
    missing = [k for k in EVIDENCE_KEYS if k not in ev] if isinstance(ev, dict) else list(EVIDENCE_KEYS)
    if missing:
        raise ConfigError(f"--evidence {path}: missing key(s) {', '.join(missing)}")
    if ev["engine"] not in ("sglang", "vllm"):
        raise ConfigError(f"--evidence {path}: engine={ev['engine']!r}: expected sglang or vllm")
    levels = _levels(path, "levels", ev["levels"])
    comparison = []
    if ev.get("base_levels"):
        comparison = serve_report.comparison_rows({"servers": {"base": {"levels": _levels(path, "base_levels",
                                                                                          ev["base_levels"])},
                                                               "eagle": {"levels": levels}}})
    result = conclude(ev["engine"], ev["info"], ev.get("drafter"), levels, comparison,
                      top_concurrency=max(lv["concurrency"] for lv in levels),
                      target_architecture=args.target_architecture, offline_tau=args.offline_tau)
    result["url"] = f"evidence {path.name}"
    result["source"] = ev.get("source")
    return result


def _levels(path: Path, key: str, recorded: Any) -> list[dict[str, Any]]:
    """Recorded levels with the keys a probe's level has (what a record leaves out: none, zero, unknown; requests:
    the successful ones); each must say its concurrency and its tokens/s."""
    if not isinstance(recorded, list) or not recorded or not all(
            isinstance(lv, dict) and isinstance(lv.get("concurrency"), int)
            and isinstance(lv.get("aggregate_tok_s"), int | float) for lv in recorded):
        raise ConfigError(f"--evidence {path}: {key}: expected a non-empty list of levels, each with an integer "
                          "concurrency and a number aggregate_tok_s")
    out = []
    for lv in recorded:
        level = {"ok": 0, "errors": 0, "output_tokens": 0, "accept_length": None, "accept_per_pos": None,
                 "per_stream_tok_s": None, "tpot_ms": {}, "ttft_ms": {}, **lv}
        level.setdefault("requests", level["ok"])
        out.append(level)
    return out


def check_before_launch(args: DoctorOptions) -> dict[str, Any]:
    """The drafter folder's static checks for the engine (and version) that will serve it: no server yet."""
    drafter = rules.drafter_facts(Path(args.before_launch))
    findings = [f.to_dict() for f in rules.before_launch_findings(args.engine, args.engine_version, drafter,
                                                                   args.context_length, args.target_architecture)]
    return {"before_launch": args.before_launch, "engine": args.engine, "engine_version": args.engine_version,
            "drafter": drafter, "findings": findings, "healthy": not findings}


def render_before_launch(result: dict[str, Any]) -> str:
    d = result["drafter"]
    lines = [f"# serve.doctor --before-launch {result['before_launch']} ({result['engine']} "
             f"{result['engine_version'] or 'every version known here'})",
             f"- layer ids {d['written_layer_ids']} (trained on {d['trained_layer_ids'] or 'unknown: not a redraft export'}),"
             f" context {d['max_position_embeddings']}"]
    if result["healthy"]:
        return "\n".join([*lines, "", "Verdict: ready to launch (no finding)."]) + "\n"
    for f in result["findings"]:
        lines += ["", f"## {f['title']} ({f['code']})", f"- evidence: {f['evidence']}", f"- fix: {f['fix']}"]
    return "\n".join(lines) + "\n"


def _running_summary(info: dict[str, Any]) -> dict[str, Any]:
    """What the server reported, the fields it has (SGLang's /server_info or vLLM's endpoints, via serve.bench)."""
    return {k: v for k, v in info.items() if v is not None}


def render(result: dict[str, Any]) -> str:
    lines = [f"# serve.doctor: {result['url']} ({result['engine']})", ""]
    if result.get("source"):
        lines += [f"Evidence: {result['source']}", ""]
    lines += [f"- {k}: {v}" for k, v in result["running"].items()]
    if result["drafter"]:
        d = result["drafter"]
        lines.append(f"- drafter {d['folder']}: layer ids {d['written_layer_ids']} (trained on "
                     f"{d['trained_layer_ids'] or 'unknown: not a redraft export'}), context "
                     f"{d['max_position_embeddings']}")
    lines += ["", "| concurrency | ok | tokens/s | per stream | tokens per verify round |", "|---:|---:|---:|---:|---:|"]
    for lv in result["probe"]["levels"]:
        acc = "n/a" if lv["accept_length"] is None else f"{lv['accept_length']:.2f}"
        per = "n/a" if lv["per_stream_tok_s"] is None else f"{lv['per_stream_tok_s']:.1f}"
        lines.append(f"| {lv['concurrency']} | {lv['ok']}/{lv['requests']} | {lv['aggregate_tok_s']:.1f} | {per} "
                     f"| {acc} |")
    seconds = result["probe"].get("seconds")
    lines += ["", f"Speed: {result['probe']['speed']}." + (f" The probe took {seconds:.0f} s." if seconds else "")]
    for p in result["probe"].get("draft_plan") or []:
        predicted = ", ".join(f"{k}: {x:.2f}x" for k, x in p["predicted"].items())
        lines.append(f"- concurrency {p['concurrency']}: predicted speed-up by draft tokens ({predicted}): best "
                     f"{p['best_k']} (the probe's own step costs, serve.cost_model)")
    if walk := result.get("offline_walk"):
        lines.append(f"Offline walk over the server's own replies ({walk['samples']} samples, {walk['estimator']}): "
                     f"{walk['tau']:.2f} tokens per verify round, the engine {walk['engine_tau_one_stream'] or 0:.2f} "
                     "at one stream.")
    lines.append("")
    if result["healthy"]:
        lines.append("Verdict: healthy (no finding).")
    else:
        lines.append(f"Verdict: {len(result['findings'])} finding(s).")
        for f in result["findings"]:
            lines += ["", f"## {f['title']} ({f['code']})", f"- evidence: {f['evidence']}", f"- fix: {f['fix']}"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = options.parse(DoctorOptions, argv, prog=PROG, description=__doc__.split("\n\n")[0], section="doctor")
    if args.before_launch is not None:
        result = check_before_launch(args)
        text = render_before_launch(result)
    elif args.evidence is not None:
        result = judge_evidence(args)
        text = render(result)
    else:
        result = examine(args)
        text = render(result)
    print(text, end="")
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(result, indent=1, default=str) + "\n")
    if args.markdown:
        atomic_write_text(Path(args.markdown), text)
    return HEALTHY if result["healthy"] else FINDINGS


def cli(argv: list[str] | None = None) -> int:
    return ending.run(lambda: main(argv), log)


if __name__ == "__main__":
    sys.exit(cli())
