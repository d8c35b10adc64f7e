"""What the doctor concludes: each finding with its evidence and the exact fix, from facts already gathered.

Pure functions over three dicts, so every rule is read (and tested) on its own:

- ``running``: what the server says about itself (``serve.bench``'s identity: SGLang's ``/server_info`` with its
  launch line and KV budget, vLLM's ``/v1/models``, ``/version`` and ``/metrics``);
- ``drafter``: the drafter folder's facts (:func:`drafter_facts`): its config.json and, for an eval.export folder,
  the layers it was trained on;
- ``probe``: the bounded measurement (``serve.bench``'s report: per concurrency, tokens/s and the engine's own
  acceptance; a base server beside it when one was given).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from redraft.core import layers
from redraft.core.drafter.folder import read_record
from serve import cost_model

SGLANG_SPEC_CAP = 48  # arg_groups/speculative_hook.py (SGLang 0.5.23): max_running_requests when none is asked
# Below this many tokens per verify round a drafter does not fit its target: the write-up's Kimi-K2 drafter on
# Kimi-K2.5 (SGLang's accept length 1.65 at 3 steps, top-k 1, 4 draft tokens: its "42%" is 1.65 / 4) ran a single
# stream at 0.99x of base, where drafters fitted to their target reach 2.4-3.5 at the same setting (the published
# Kimi-K2 drafters' accept lengths, docs/doctor.md).
LOW_ACCEPT_LENGTH = 2.0


@dataclass
class Finding:
    code: str  # stable name: tests, JSON consumers
    title: str
    evidence: str
    fix: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def drafter_facts(folder: Path) -> dict[str, Any]:
    """config.json's layer ids, context length, dtype and vocabulary; for a redraft export, what it was trained on."""
    config = json.loads((folder / "config.json").read_text())
    eagle = config.get("eagle_config") or {}
    record = read_record(folder) or {}
    trained = record.get("drafter") or {}
    return {
        "folder": str(folder),
        "architectures": config.get("architectures"),
        "written_layer_ids": eagle.get("eagle_aux_hidden_state_layer_ids"),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "torch_dtype": config.get("torch_dtype") or config.get("dtype"),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "serving_format": record.get("serving_format"),
        "trained_layer_ids": trained.get("aux_layer_ids"),
        "target_architecture": trained.get("target_architecture"),
        "target_num_layers": trained.get("target_num_layers"),
    }


def cap_finding(engine: str, running: dict[str, Any], probe_top: int) -> Finding | None:
    """SGLang's silent cap of 48 running requests in speculative mode (not asked for on its launch line)."""
    info = running.get("info") or {}
    if engine != "sglang" or not info.get("speculative_algorithm"):
        return None
    if info.get("max_running_requests") != SGLANG_SPEC_CAP:
        return None
    if "--max-running-requests" in str(info.get("launch_command") or ""):
        return None  # asked for 48 on purpose
    tokens = info.get("max_total_num_tokens")
    size = _cap_size(tokens, running.get("tokens_per_request"))
    fix = (f"relaunch with --max-running-requests {size} --cuda-graph-max-bs {min(size, 256)} (N = KV budget / 2 / "
           "tokens per request, here the probe's; size it with your traffic's request length)"
           if size else "relaunch with an explicit --max-running-requests N (and --cuda-graph-max-bs N)")
    per = running.get("tokens_per_request")
    budget = (f"; the server's KV budget is {tokens:,} tokens" if isinstance(tokens, int) else "") + (
        f", the probe's requests ~{per:,.0f} tokens each" if per else "")
    return Finding("sglang-cap-48", "SGLang caps this speculative server at 48 running requests",
                   f"max_running_requests = 48 and the launch line does not ask for it{budget}; "
                   f"requests beyond 48 queue (the probe's highest concurrency: {probe_top})", fix)


def _cap_size(kv_tokens: Any, tokens_per_request: Any) -> int | None:
    """Requests the KV budget holds at half capacity (SGLang's own bound: resolve_max_num_reqs caps the count at
    half the token capacity) for requests of the probe's mean length."""
    if not isinstance(kv_tokens, int) or not tokens_per_request or tokens_per_request <= 0:
        return None
    return max(1, int(kv_tokens // 2 // tokens_per_request))


def layer_finding(engine: str, version: str | None, drafter: dict[str, Any], target_arch: str | None) -> Finding | None:
    """The drafter's ids read by *this* engine version as other layers than it was trained on."""
    written, trained = drafter.get("written_layer_ids"), drafter.get("trained_layer_ids")
    arch = target_arch or drafter.get("target_architecture")
    if not written or not arch:
        return None
    if engine == "sglang" and version is None:  # before a launch, the version unknown: every version known here
        return _every_version_finding(written, trained, arch, drafter["folder"]) if trained is not None else None
    if engine == "sglang":
        read = layers.sglang_read_layer_ids(written, arch, version)
    else:
        read = layers.from_engine_layer_ids(written, engine, arch)
    if read is None:
        return Finding("layer-ids-unknown", f"how SGLang {version} reads these layer ids is not known",
                       f"config.json asks {written} for a {arch} target; 0.5.10 and 0.5.23 read them differently",
                       "serve SGLang 0.5.23 or later, or write ids whose first is 1 (read alike by both)")
    if trained is None or sorted(int(i) for i in trained) == read:
        return None
    want = _ids_for(engine, version, trained, arch)
    return Finding("layer-ids-misread", f"{engine} {version or ''} captures other layers than the drafter was "
                   "trained on".replace("  ", " "),
                   f"config.json asks {written}; this version captures the outputs of layers {read}; the drafter "
                   f"was trained on layers {sorted(trained)} (redraft.json)",
                   f"set eagle_aux_hidden_state_layer_ids to {want} in {drafter['folder']}/config.json (or re-export "
                   "for this engine version) and restart the server")


def _every_version_finding(written: list[int], trained: list[int], arch: str, folder: str) -> Finding | None:
    """The SGLang versions whose rule is known here that would capture other layers than ``trained``."""
    checked = layers.versions_reading(written, "sglang", arch, trained)
    wrong = [v for v, ok in checked.items() if not ok]
    if not wrong:
        return None
    return Finding("layer-ids-misread", f"SGLang {' and '.join(wrong)} would capture other layers than the drafter "
                   "was trained on",
                   f"config.json asks {written} for a {arch} target; the drafter was trained on layers "
                   f"{sorted(trained)} (redraft.json); read as trained only by "
                   f"{' and '.join(v for v, ok in checked.items() if ok) or 'none of them'}",
                   f"set eagle_aux_hidden_state_layer_ids to {_ids_for('sglang', None, trained, arch)} in "
                   f"{folder}/config.json (read alike by SGLang {' and '.join(checked)})")


def _ids_for(engine: str, version: str | None, ours: list[int], arch: str) -> list[int]:
    """The ids that make this engine version capture ``ours``."""
    ours = sorted(int(i) for i in ours)
    v = layers.parse_version(version)
    if engine == "sglang" and layers.serving_family(arch) == "deepseek" and v is not None \
            and v < layers.SGLANG_SHIFT_FIRST_IS_1:
        return ours  # 0.5.10 adds 1 to every id
    return layers.to_engine_layer_ids(ours, engine, arch)  # keeps ids whose first is 1, read alike by both


def context_finding(running: dict[str, Any], drafter: dict[str, Any]) -> Finding | None:
    """A drafter shorter than the context the server serves."""
    served, own = (running.get("info") or {}).get("context_length"), drafter.get("max_position_embeddings")
    if not isinstance(served, int) or not isinstance(own, int) or own >= served:
        return None
    return Finding("context-length", "the drafter's context is shorter than the server's",
                   f"the server serves {served:,} tokens; the drafter's config.json says max_position_embeddings "
                   f"{own:,}",
                   f"set max_position_embeddings to {served} in {drafter['folder']}/config.json (the drafter's rope "
                   "is the target's; SGLang otherwise needs SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1), and train "
                   "at the lengths you serve (docs/long-context.md)")


def before_launch_findings(engine: str, version: str | None, drafter: dict[str, Any], context_length: int | None,
                           target_arch: str | None = None) -> list[Finding]:
    """The static checks of a drafter folder before a server starts: its ids as this version (or every version
    known here) reads them, and its context against the one to be served."""
    checks = (layer_finding(engine, version, drafter, target_arch),
              context_finding({"info": {"context_length": context_length}}, drafter))
    return [f for f in checks if f is not None]


def acceptance_finding(levels: list[dict[str, Any]], steps: Any, offline_tau: float | None) -> Finding | None:
    """Acceptance low at one stream: the drafter does not fit this target, or is not served as trained."""
    one = next((lv for lv in levels if lv.get("concurrency") == 1 and lv.get("accept_length")), None)
    if one is None:
        return None
    tau = float(one["accept_length"])
    if offline_tau is not None and tau < 0.9 * offline_tau:
        return Finding("served-not-as-trained", "the engine accepts far less than the drafter's offline walk",
                       f"tokens per verify round: {tau:.2f} in the engine against {offline_tau:.2f} offline",
                       "check the layer ids, norms, chat template and target the server uses against the ones the "
                       "drafter was trained with (the findings above); the drafter itself is fine")
    if tau >= LOW_ACCEPT_LENGTH:
        return None
    offline = "" if offline_tau is None else f"; {offline_tau:.2f} in the offline walk: served as trained, and low"
    return Finding("drafter-does-not-fit", "the drafter does not fit this target",
                   f"tokens per verify round at one stream: {tau:.2f} with {steps} draft steps (below "
                   f"{LOW_ACCEPT_LENGTH}: a mismatched Kimi drafter gave 1.65 and no speed-up, fitted ones give "
                   f"2.4-3.5){offline}",
                   "retrain it on this target's own hidden states: python -m extract --target TARGET --data CHATS "
                   "--regenerate --out DATA, then accelerate launch train/main.py --data DATA --out CKPT "
                   "(docs/kimi-k25.md)")


def pays(speedup: float | None) -> bool:
    """Speculation pays at a concurrency when tokens/s with the drafter over tokens/s without is above 1."""
    return speedup is not None and speedup > 1.0


def where_it_pays(speedups: list[tuple[int, float | None]]) -> dict[str, Any]:
    """Where speculation pays (:func:`pays`), shared by the doctor and serve.tune's summary. ``speedups``:
    (concurrency, ratio or None where not measured). Returns the paying and the losing concurrencies, and the concurrency from which
    none pays any more (None when the highest measured still pays)."""
    measured = sorted((c, r) for c, r in speedups if r is not None)
    no_gain_from = None
    for c, r in reversed(measured):
        if pays(r):
            break
        no_gain_from = c
    return {"pays": [c for c, r in measured if pays(r)], "loses": [c for c, r in measured if not pays(r)],
            "no_gain_from": no_gain_from}


def pays_sentence(verdict: dict[str, Any]) -> str:
    """``where_it_pays`` said of exactly the concurrencies measured (none, some or all)."""
    pays, loses = verdict["pays"], verdict["loses"]
    if not pays:
        return "No setting beats base at any concurrency measured: serve base."
    if not loses:
        return "A setting beats base at every concurrency measured."
    said = (f"A setting beats base at concurrency {', '.join(map(str, pays))}; none does at "
            f"{', '.join(map(str, loses))}.")
    ngf = verdict["no_gain_from"]
    return said + (f" None beats base from concurrency {ngf} on." if ngf is not None else "")


def draft_plan(comparison: list[dict[str, Any]], levels: list[dict[str, Any]], steps: Any) -> list[dict[str, Any]]:
    """Per concurrency measured beside the base, the chain length the probe's own step costs predict fastest
    (``serve.cost_model.best_chain``; 0: no drafting)."""
    if not isinstance(steps, int) or steps < 1:
        return []
    per_pos = {lv["concurrency"]: lv.get("accept_per_pos") for lv in levels}
    plan = []
    for row in comparison:
        base, spec, tau = row["aggregate_tok_s"]["base"], row["aggregate_tok_s"]["eagle"], row.get("accept_length")
        if not base or not spec or not tau:
            continue
        taus = cost_model.chain_taus(steps, tau, per_pos.get(row["concurrency"]))
        plan.append(cost_model.best_chain(row["concurrency"], base, spec, steps, taus))
    return plan


def vllm_schedule(plan: list[dict[str, Any]]) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` (0.32: inclusive batch-size ranges, the first from 1, k >= 0;
    the last range carried to the largest batch): each measured concurrency's best k from the one above the
    previous measured concurrency, so a batch between two measured levels gets the higher level's (fewer) drafts."""
    out, start = [], 1
    for p in sorted(plan, key=lambda p: p["concurrency"]):
        if out and out[-1][2] == p["best_k"]:
            out[-1][1] = p["concurrency"]
        else:
            out.append([start, p["concurrency"], p["best_k"]])
        start = p["concurrency"] + 1
    return out


def _plan_fix(engine: str, plan: list[dict[str, Any]]) -> str:
    """The flags the plan asks for, in the running engine's words."""
    said = "; ".join(f"at {p['concurrency']}: " + (f"{p['best_k']} draft token(s), {p['predicted'][p['best_k']]:.2f}x"
                                                      if p["best_k"] else "no drafting")
                     for p in plan)
    if not any(p["best_k"] for p in plan):
        return (f"the probe's step costs predict no drafting pays at any concurrency measured ({said}): serve "
                "without speculation until a drafter that fits this target is measured again")
    if engine == "vllm":
        return (f"the probe's step costs predict ({said}): add \"num_speculative_tokens_per_batch_size\": "
                f"{json.dumps(vllm_schedule(plan))} to --speculative-config (vLLM 0.32 picks the drafts per batch "
                "size; 0 drafts none)")
    paying = [p for p in sorted(plan, key=lambda p: p["concurrency"]) if p["best_k"]]
    return (f"the probe's step costs predict ({said}): relaunch with --speculative-adaptive (SGLang 0.5.23 picks "
            f"the steps per batch size, none among its choices from batch 8), or --speculative-num-steps "
            f"{paying[0]['best_k']} --speculative-num-draft-tokens {paying[0]['best_k'] + 1} where the load stays at "
            f"{paying[-1]['concurrency']} or below")


def speed_findings(comparison: list[dict[str, Any]], engine: str = "vllm",
                   plan: list[dict[str, Any]] | None = None) -> list[Finding]:
    """Speculation that loses to the base server (``serve.report.comparison_rows``, measured beside it), by
    :func:`where_it_pays` on aggregate tokens/s: at one stream, and from which concurrency on; the fix sized by
    :func:`draft_plan` where the probe allows one."""
    verdict = where_it_pays([(r["concurrency"], r["aggregate_tok_s"]["ratio"]) for r in comparison])
    ratio = {r["concurrency"]: r["aggregate_tok_s"]["ratio"] for r in comparison}
    sized = _plan_fix(engine, plan) if plan else None
    out = []
    if 1 in verdict["loses"]:
        out.append(Finding("no-gain-one-stream", "speculation does not speed up a single stream",
                           f"tokens/s at one stream with the drafter / without: {ratio[1]:.2f}",
                           "a better-fitting drafter (retrain it on this target), or fewer draft steps"
                           + (f"; {sized}" if sized else "")))
    losing = [c for c in verdict["loses"] if c > 1]
    if losing:
        out.append(Finding("loses-at-concurrency", f"speculation costs throughput at concurrency "
                           f"{', '.join(map(str, losing))}",
                           "aggregate tokens/s with the drafter / without: "
                           + ", ".join(f"{ratio[c]:.2f} at {c}" for c in losing),
                           sized or "serve speculation only below that load: SGLang 0.5.23 --speculative-adaptive "
                           "(turns drafting off for large batches), vLLM 0.32 num_speculative_tokens_per_batch_size "
                           "in --speculative-config, or fewer steps; python -m serve.tune sizes them"))
    return out
