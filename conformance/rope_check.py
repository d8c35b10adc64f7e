"""The rope proof: our training rope equals what SGLang's and vLLM's own rope modules build from our config.json.

    python -m conformance.rope_check [--engine sglang --engine vllm] [--python ENGINE_PYTHON] [--json OUT]

For each rope type the targets in the field use (:data:`CASES`, with the published values they come from) and
each drafter attention kind the engines serve it with, a drafter config is built, its ``config.json`` written
by our exporter (``redraft.core.drafter.serving_format.serving_config``, one folder per engine), and
``conformance/rope_probe.py``, run by the engine's own interpreter in a subprocess, lets the engine parse the
folder and build its drafter class on CPU. What the engine's attention layer then holds is compared with
``redraft.core.drafter.rope`` (``rope_tables``, ``Rope.cos_sin``, ``Rope.apply``), each as a relative difference
(divided by our cos/sin magnitude, frequency, or scale), all within :data:`RTOL`:

- ``cos_sin``: the engine's ``cos_sin_cache`` rows, laid out in its pairing, against ``Rope.cos_sin`` at every
  position below 4,096, around the YaRN original length, at 256 strided positions up to the engine's last row
  and at the last row;
- ``rotation``: the engine's ``rotary_emb.forward_native`` of every unit vector against ``Rope.apply`` (the
  pairing in action) at 13 of those positions;
- ``magnitude`` (``sqrt(cos^2 + sin^2)``), ``frequencies`` (the angle at position 1) and the rotated dims and
  pairing, which say which config keys are responsible when the tables differ;
- ``softmax``: the attention module's ``scaling`` and every scale it handed an attention kernel, against
  ``Rope.softmax_scale``.

A mismatch is reported by the config keys that set the differing part (:func:`compare`), e.g.
``rope_scaling.attention_factor=1.0 (served as if absent): SGLang cos/sin magnitude 1.13863, ours 1``: when
dropping one key from our config makes our part equal to the engine's, that key is named, else every key that
sets the part.

The configs the two engines serve two ways are held too: ``redraft.core.drafter.rope.engine_rope_deviations`` names
the engine and the key (and ``eval.export`` refuses that engine's format by it); that engine must still differ
(a fixed engine shows up), the other must match. :data:`MLA_REFUSED` are the rope types an MLA drafter is not
trained with (``rope_tables`` refuses them): the engines build DeepSeek's YaRN (or fail) for each, never the type
asked for, which :func:`refusal_facts` reports.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from redraft.core import cli as ending
from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.rope import Rope, engine_rope_deviations, rope_tables
from redraft.core.drafter.serving_format import serving_config

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "conformance" / "rope_probe.py"
RTOL = 1e-6
ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}
DENSE = 4096  # every position below this is compared
STRIDED = 256  # and this many evenly spaced ones up to the engine's last row

# Where the rope keys of the field's targets come from (published config.json values).
K25 = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # Kimi-K2.5 and the K2 family, as published
YARN64_BETA32 = {**K25, "beta_fast": 32.0}  # the same with YaRN's default beta_fast (transformers fills it in)
DSV3 = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
DSV2 = {**DSV3, "mscale": 0.707, "mscale_all_dim": 0.707}
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
           "beta_slow": 1.0, "truncate": False}
MISTRAL_M35 = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class RopeCase:
    """One rope config as a target in the field has it, for one drafter attention kind."""

    name: str
    kind: str  # "gqa" or "mla"
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    source: str
    export_max_position: int | None = None  # config.json's max_position_embeddings, when the export sets another


CASES: tuple[RopeCase, ...] = (
    RopeCase("default", "gqa", 500000.0, None, 8192, "Llama-3-8B"),
    RopeCase("linear", "gqa", 10000.0, {"rope_type": "linear", "factor": 4.0}, 4096, "Llama-2 x4 linear"),
    RopeCase("linear-2.5", "gqa", 10000.0, {"rope_type": "linear", "factor": 2.5}, 4096, "LLaVA-NeXT-Video-7B"),
    RopeCase("dynamic", "gqa", 1000000.0, {"rope_type": "dynamic", "factor": 2.0}, 32768, "InternLM2-chat-7B"),
    RopeCase("llama3", "gqa", 500000.0, LLAMA31, 131072, "Llama-3.1"),
    RopeCase("yarn", "gqa", 1000000.0, QWEN_YARN, 131072, "Qwen2.5/Qwen3 YaRN x4"),
    RopeCase("yarn-truncate-false", "gqa", 150000.0, GPT_OSS, 131072, "gpt-oss"),
    RopeCase("yarn-mscale-both", "gqa", 50000.0, YARN64_BETA32, 262144, "YaRN x64, both mscales, beta_fast 32"),
    RopeCase("yarn-mscale-both-beta1", "gqa", 50000.0, K25, 262144, "Kimi-K2.5 / K2 family"),
    RopeCase("yarn-mscale-0.707", "gqa", 10000.0, DSV2, 163840, "DeepSeek-V2"),
    RopeCase("yarn-mscale-all-dim-0", "gqa", 1000000.0, MISTRAL_M35, 262144, "Mistral-Medium-3.5"),
    RopeCase("yarn-mscale-only", "gqa", 10000.0, {**DSV3, "mscale": 0.707} | {"mscale_all_dim": None}, 163840,
             "mscale without mscale_all_dim"),
    RopeCase("yarn-mscale-all-dim-only", "gqa", 10000.0, {**DSV3, "mscale": None}, 163840,
             "mscale_all_dim without mscale"),
    RopeCase("yarn-attention-factor", "gqa", 1000000.0, {**QWEN_YARN, "attention_factor": 1.0}, 131072,
             "transformers' attention_factor"),
    RopeCase("yarn-mscale-0", "gqa", 10000.0, {**DSV3, "mscale": 0.0}, 163840, "a zero mscale beside mscale_all_dim"),
    RopeCase("yarn-no-original-export-longer", "gqa", 1000000.0, {"rope_type": "yarn", "factor": 4.0}, 32768,
             "YaRN without original_max_position_embeddings, exported for a 131,072-token target", 131072),
    RopeCase("default", "mla", 10000.0, None, 8192, "DeepSeek-V2-Lite without scaling"),
    RopeCase("yarn-mscale-both", "mla", 50000.0, YARN64_BETA32, 262144, "YaRN x64, both mscales, beta_fast 32"),
    RopeCase("yarn-mscale-both-beta1", "mla", 50000.0, K25, 262144, "Kimi-K2.5 / K2 family"),
    RopeCase("yarn-dsv3", "mla", 10000.0, DSV3, 163840, "DeepSeek-V3"),
    RopeCase("yarn-mscale-0.707", "mla", 10000.0, DSV2, 163840, "DeepSeek-V2"),
    RopeCase("yarn", "mla", 1000000.0, QWEN_YARN, 131072, "YaRN without mscale keys"),
    RopeCase("yarn-mscale-all-dim-0", "mla", 1000000.0, MISTRAL_M35, 262144, "Mistral-Medium-3.5's keys"),
    RopeCase("yarn-mscale-all-dim-only", "mla", 10000.0, {**DSV3, "mscale": None}, 163840,
             "mscale_all_dim without mscale"),
    RopeCase("yarn-mscale-0", "mla", 10000.0, {**DSV3, "mscale": 0.0}, 163840, "a zero mscale beside mscale_all_dim"),
    RopeCase("yarn-truncate-false", "mla", 150000.0, GPT_OSS, 131072, "gpt-oss's keys"),
)

# rope configs an MLA drafter cannot be trained with (redraft.core.drafter.rope refuses them), and what the engines do
# with them: every scaled type becomes DeepSeek's YaRN, so the type asked for is not what would be served.
MLA_REFUSED: tuple[RopeCase, ...] = (
    RopeCase("linear", "mla", 10000.0, {"rope_type": "linear", "factor": 4.0}, 16384, "a linear target"),
    RopeCase("dynamic", "mla", 1000000.0, {"rope_type": "dynamic", "factor": 2.0}, 32768, "a dynamic target"),
    RopeCase("llama3", "mla", 500000.0, LLAMA31, 131072, "a Llama-3.1 target"),
    RopeCase("yarn-attention-factor", "mla", 10000.0, {**DSV3, "attention_factor": 1.0}, 163840,
             "DeepSeek-V3's keys and transformers' attention_factor"),
)

# the rope module each engine builds for each (kind, rope type): the engine read the type from our config.json
EXPECTED_ROPE_CLASS = {
    "gqa": {"default": "RotaryEmbedding", "linear": "LinearScalingRotaryEmbedding",
            "dynamic": "DynamicNTKScalingRotaryEmbedding", "llama3": "Llama3RotaryEmbedding",
            "yarn": "YaRNScalingRotaryEmbedding"},
    "mla": {"default": "RotaryEmbedding", "yarn": "DeepseekScalingRotaryEmbedding"},
}

# config keys that set each part of the rope, per rope type (named when no single key explains a mismatch)
FREQUENCY_KEYS = {"default": ("rope_theta",), "linear": ("rope_theta", "factor"),
                  "dynamic": ("rope_theta", "factor", "max_position_embeddings"),
                  "llama3": ("rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                             "original_max_position_embeddings"),
                  "yarn": ("rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                           "truncate")}
MAGNITUDE_KEYS = {"yarn": ("factor", "attention_factor", "mscale", "mscale_all_dim")}
SOFTMAX_KEYS = {"gqa": ("head_dim",), "mla": ("qk_nope_head_dim", "qk_rope_head_dim", "factor", "mscale_all_dim")}
TOP_LEVEL = ("rope_theta", "max_position_embeddings", "head_dim", "qk_nope_head_dim", "qk_rope_head_dim")


def case_id(case: RopeCase) -> str:
    return f"{case.kind}/{case.name}"


def drafter_config(case: RopeCase) -> DrafterConfig:
    """A small drafter with the field's head sizes (gqa: head_dim 128; mla: DeepSeek's 128 + 64) and ``case``'s rope."""
    scaling = None if case.rope_scaling is None else {k: v for k, v in case.rope_scaling.items() if v is not None}
    kw: dict[str, Any] = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                              intermediate_size=64, vocab_size=128, draft_vocab_size=64, target_hidden_size=256,
                              aux_layer_ids=[1, 3, 4], target_num_layers=8, rope_theta=case.rope_theta,
                              rope_scaling=scaling, max_position_embeddings=case.max_position_embeddings)
    if case.kind == "mla":
        kw.update(attention="mla", num_key_value_heads=2, head_dim=128 + 64, q_lora_rank=32, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    return DrafterConfig(**kw)


def target_config(draft: Mapping[str, Any]) -> dict[str, Any]:
    """A small Llama target for vLLM's speculative config (it sizes the vocabulary and layers from the target)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": draft["target_hidden_size"],
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 64,
            "num_hidden_layers": 8, "vocab_size": draft["vocab_size"], "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, "torch_dtype": "float32", "tie_word_embeddings": False,
            "hidden_act": "silu"}


def positions_for(case: RopeCase) -> tuple[list[int], list[int]]:
    """(positions for the tables, positions for the rotation): dense, around the original length, strided."""
    orig = int((case.rope_scaling or {}).get("original_max_position_embeddings") or case.max_position_embeddings)
    factor = float((case.rope_scaling or {}).get("factor") or 1.0)
    last = max(int(orig * factor), case.max_position_embeddings) - 1  # the probe drops what the engine lacks
    near = [p for p in range(orig - 3, orig + 4) if p >= 0]
    strided = [round(i * last / (STRIDED - 1)) for i in range(STRIDED)]
    table = sorted(set(range(DENSE)) | set(near) | set(strided))
    apply = sorted({0, 1, 2, 7, 100, 1000, DENSE - 1, orig - 1, orig, orig + 1, last // 2, last - 1, last})
    return table, apply


def write_cases(root: Path, engine: str, cases: Iterable[RopeCase]) -> list[dict[str, Any]]:
    """One folder per case with our exporter's config.json for ``engine`` (and a target folder for vLLM)."""
    out = []
    for i, case in enumerate(cases):
        folder = root / f"{i:02d}-{case.kind}-{case.name}"
        folder.mkdir(parents=True, exist_ok=True)
        config = serving_config(drafter_config(case), engine=engine,
                                max_position_embeddings=case.export_max_position)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        table, apply = positions_for(case)
        item = {"name": case_id(case), "folder": str(folder), "positions": table, "apply_positions": apply}
        if engine == "vllm":
            target = root / f"{i:02d}-target"
            target.mkdir(exist_ok=True)
            (target / "config.json").write_text(json.dumps(target_config(config)))
            item["target_folder"] = str(target)
        out.append(item)
    return out


def run_probe(python: str, engine: str, cases: Sequence[RopeCase], workdir: Path | None = None,
              timeout_s: float = 600.0, verbose: bool = False) -> dict[str, dict[str, Any]]:
    """rope_probe.py under ``python`` for ``engine``: {case id: what the engine built} (or {"error": ...})."""
    from redraft.engines.vllm import engine_env

    with tempfile.TemporaryDirectory(prefix=f"rope-{engine}-", dir=workdir) as tmp:
        root = Path(tmp)
        request = {"engine": engine, "cases": write_cases(root / "cases", engine, cases), "verbose": verbose}
        (root / "request.json").write_text(json.dumps(request))
        env = engine_env(python, threads=1, extra={"PYTHONPATH": ""})
        proc = subprocess.run([python, str(PROBE), str(root / "request.json"), str(root / "out.pt")], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not (root / "out.pt").is_file():
            raise RuntimeError(f"{python} {PROBE.name} ({engine}) exited {proc.returncode}:\n"
                               + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
        return torch.load(root / "out.pt", weights_only=True)


# ----------------------------------------------------------------------------- comparison


@dataclass
class Comparison:
    """One case in one engine: the relative differences of each part, and the mismatches by config key."""

    case: str
    engine: str
    version: str = ""
    rope_class: str = ""
    cos_sin: float = math.nan
    rotation: float = math.nan
    magnitude: float = math.nan
    frequencies: float = math.nan
    softmax: float = math.nan
    engine_magnitude: float = math.nan
    ours_magnitude: float = math.nan
    engine_softmax: float = math.nan
    ours_softmax: float = math.nan
    problems: list[str] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)  # which parts differ: style, dim, magnitude, frequencies, ...
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float | torch.Tensor) -> float:
    return float(((a.double() - b.double()).abs() / scale).max()) if a.numel() else 0.0


def _expand(half: torch.Tensor, neox: bool) -> torch.Tensor:
    """cache halves [P, R/2] laid out as the engine applies them: NeoX halves or interleaved pairs."""
    return torch.cat((half, half), dim=-1) if neox else torch.repeat_interleave(half, 2, dim=-1)


def _named(cfg: DrafterConfig, keys: Iterable[str]) -> str:
    """``rope_theta=..., rope_scaling.k=v, ...`` for those of ``keys`` the config sets (top-level or rope keys)."""
    scaling = cfg.rope_scaling or {}
    out = []
    for k in keys:
        if k in TOP_LEVEL and getattr(cfg, k, None) is not None:
            out.append(f"{k}={getattr(cfg, k)!r}")
        elif k in scaling:
            out.append(f"rope_scaling.{k}={scaling[k]!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if "original_max_position_embeddings" in keys and scaling and "original_max_position_embeddings" not in scaling:
        out.append("rope_scaling.original_max_position_embeddings absent (engines take config.json's "
                   "max_position_embeddings)")
    return ", ".join(out) or f"rope_scaling.rope_type={rope_type!r}"


def _served_as_if_absent(cfg: DrafterConfig, matches: Any) -> list[str]:
    """The rope_scaling keys the engine serves as if they were absent: without the key, our tables are the engine's."""
    found = []
    for k in cfg.rope_scaling or {}:
        if k in ("rope_type", "type"):
            continue
        try:
            alt = rope_tables(replace(cfg, rope_scaling={kk: v for kk, v in cfg.rope_scaling.items() if kk != k}))
        except (ValueError, KeyError, TypeError):
            continue
        if matches(alt):
            found.append(f"rope_scaling.{k}={cfg.rope_scaling[k]!r} (served as if absent)")
    return found


def compare(case: RopeCase, engine_facts: Mapping[str, Any], cfg: DrafterConfig | None = None) -> Comparison:
    """``engine_facts`` (rope_probe's dict for ``case``) against our Rope for the same config."""
    cfg = cfg or drafter_config(case)
    engine = str(engine_facts.get("engine", "?"))
    who = ENGINE_NAMES.get(engine, engine)
    out = Comparison(case_id(case), engine, str(engine_facts.get("version", "")))
    if "error" in engine_facts:
        out.error = str(engine_facts["error"])
        return out
    out.rope_class = str(engine_facts["rope_class"])
    ours = Rope(cfg)
    t = ours.tables
    rope_type = (cfg.rope_scaling or {}).get("rope_type", "default")

    def problem(part: str, message: str) -> None:
        out.parts.append(part)
        out.problems.append(message)

    neox = bool(engine_facts["is_neox_style"])
    if (t.style == "neox") != neox:
        styles = {True: "NeoX halves", False: "interleaved pairs"}
        problem("style", f"{'rope_interleave' if cfg.attention == 'mla' else 'architectures'}: {who} rotates "
                         f"{styles[neox]}, ours {styles[t.style == 'neox']}")
    r = int(engine_facts["rotary_dim"])
    if r != t.dim:
        problem("dim", f"{'qk_rope_head_dim' if cfg.attention == 'mla' else 'head_dim'}: {who} rotates {r} dims per "
                       f"head, ours {t.dim}")
        return out

    pos = engine_facts["positions"]
    cache = engine_facts["cos_sin"].double()
    cos_e, sin_e = cache[:, : r // 2], cache[:, r // 2:]
    cos_o, sin_o = ours.cos_sin(pos, torch.float32)
    scale = abs(t.cos_sin_scale) or 1.0
    out.cos_sin = max(_rel(_expand(cos_e, neox), cos_o, scale), _rel(_expand(sin_e, neox), sin_o, scale))

    magnitude = (cos_e.square() + sin_e.square()).sqrt()
    out.engine_magnitude, out.ours_magnitude = float(magnitude.mean()), float(t.cos_sin_scale)
    out.magnitude = _rel(magnitude, torch.full_like(magnitude, t.cos_sin_scale), scale)
    if out.magnitude > RTOL:
        keys = _served_as_if_absent(cfg, lambda alt: math.isclose(alt.cos_sin_scale, out.engine_magnitude,
                                                                  rel_tol=10 * RTOL))
        problem("magnitude", f"{', '.join(keys) or _named(cfg, MAGNITUDE_KEYS.get(rope_type, ()))}: {who} cos/sin "
                             f"magnitude {out.engine_magnitude:.6g}, ours {t.cos_sin_scale:.6g}")

    at1 = (pos == 1).nonzero()
    omega_e = None
    if len(at1):
        i = int(at1[0])
        omega_e = torch.atan2(sin_e[i], cos_e[i])  # the frequencies themselves: all are below pi
        rel = (omega_e - t.inv_freq.double() / t.position_divisor).abs() / (t.inv_freq.double() / t.position_divisor)
        out.frequencies = float(rel.max())
        if out.frequencies > RTOL:
            j = int(rel.argmax())
            keys = _served_as_if_absent(cfg, lambda alt: float(((omega_e - alt.inv_freq.double() / alt.position_divisor)
                                                                .abs() / omega_e.abs()).max()) <= 10 * RTOL)
            problem("frequencies", f"{', '.join(keys) or _named(cfg, FREQUENCY_KEYS.get(rope_type, ('rope_theta',)))}"
                                   f": {who} frequency {j} of {r // 2} {float(omega_e[j]):.9g}, ours "
                                   f"{float(t.inv_freq[j]) / t.position_divisor:.9g}")
    if out.cos_sin > RTOL and not out.problems:
        worst = int(((_expand(cos_e, neox) - cos_o.double()).abs().amax(-1)).argmax())
        problem("cos_sin", f"{_named(cfg, FREQUENCY_KEYS.get(rope_type, ('rope_theta',)))}: {who} cos/sin differ by "
                           f"{out.cos_sin:.3g} (relative) at position {int(pos[worst])}, with equal frequencies and "
                           "magnitude: the angle position x frequency is rounded another way")

    if engine_facts.get("rotated") is not None and len(engine_facts["apply_positions"]):
        ap = engine_facts["apply_positions"]
        eye = torch.eye(r, dtype=torch.float32).expand(len(ap), r, r)
        cos_a, sin_a = ours.cos_sin(ap, torch.float32)
        out.rotation = _rel(engine_facts["rotated"], ours.apply(eye, cos_a[:, None, :], sin_a[:, None, :]), scale)
        if out.rotation > RTOL and not out.problems:
            problem("rotation", f"{_named(cfg, FREQUENCY_KEYS.get(rope_type, ('rope_theta',)))}: {who}'s rotary_emb "
                                f"rotates q/k differently from ours (relative {out.rotation:.3g}) with equal tables")

    scales = dict(engine_facts["scales"])
    out.ours_softmax, out.engine_softmax = float(ours.softmax_scale), float(scales["scaling"])
    out.softmax = max(abs(v - ours.softmax_scale) / ours.softmax_scale for v in scales.values())
    if out.softmax > RTOL:
        bad = {k: v for k, v in scales.items() if abs(v - ours.softmax_scale) / ours.softmax_scale > RTOL}
        keys = _served_as_if_absent(cfg, lambda alt: math.isclose(alt.softmax_scale, out.engine_softmax,
                                                                  rel_tol=10 * RTOL))
        problem("softmax", f"{', '.join(keys) or _named(cfg, SOFTMAX_KEYS[cfg.attention])}: {who} softmax scale "
                           f"{', '.join(f'{k} {v:.9g}' for k, v in bad.items())}, ours {ours.softmax_scale:.9g}")
    return out


def check(engine: str, python: str, cases: Sequence[RopeCase] = CASES, workdir: Path | None = None,
          verbose: bool = False) -> list[Comparison]:
    """Every case in ``engine`` (run by ``python``), compared with ours."""
    facts = run_probe(python, engine, cases, workdir, verbose=verbose)
    return [compare(case, facts[case_id(case)]) for case in cases]


def failures(c: Comparison, case: RopeCase) -> list[str]:
    """What is wrong with one comparison: a mismatch the exporter does not name, the engine refusing the config or
    building another rope class than the type asks for, or a deviation ``engine_rope_deviations`` names gone."""
    deviation = engine_rope_deviations(drafter_config(case)).get(c.engine)
    who = ENGINE_NAMES.get(c.engine, c.engine)
    if c.error:
        return [f"{c.case}: {who} did not build the drafter: {c.error}"]
    rope_type = (case.rope_scaling or {}).get("rope_type", "default")
    want = EXPECTED_ROPE_CLASS[case.kind][rope_type]
    bad = [] if c.rope_class == want else [f"{c.case}: {who} built a {c.rope_class}, not the {want} that "
                                           f"rope_type {rope_type!r} asks for: it did not read our config.json's rope"]
    if deviation is None:
        bad += [f"{c.case}: {p}" for p in c.problems]
    elif not c.problems:
        bad.append(f"{c.case}: {who} now serves this config as trained, but engine_rope_deviations says "
                   f"{deviation!r} (and eval.export refuses it): update redraft.core.drafter.rope")
    return bad


def verdict(comparisons: Sequence[Comparison], cases: Sequence[RopeCase] = CASES) -> list[str]:
    """Every comparison's :func:`failures`."""
    by_id = {case_id(c): c for c in cases}
    return [line for c in comparisons for line in failures(c, by_id[c.case])]


def refusal_facts(case: RopeCase, by_engine: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """For a rope an MLA drafter is not trained with: our refusal, and what each engine builds for it."""
    try:
        Rope(drafter_config(case))
        ours = None
    except ValueError as e:
        ours = str(e)
    engines = {}
    for engine, facts in by_engine.items():
        f = facts[case_id(case)]
        engines[engine] = ({"error": f["error"]} if "error" in f else
                           {"rope_class": f["rope_class"], "rope_type": (f.get("rope_parameters") or {}).get("rope_type"),
                            "softmax_scale": f["scales"]["scaling"]})
    return {"case": case_id(case), "ours": ours, "engines": engines}


def table(comparisons: Sequence[Comparison], cases: Sequence[RopeCase] = CASES) -> str:
    """Markdown: case x engine -> max relative difference of cos/sin, rotation, magnitude and softmax scale."""
    by_id = {case_id(c): c for c in cases}
    rows = ["| case | engine | engine rope class | cos/sin | rotation | magnitude (engine / ours) | softmax scale "
            "(engine / ours) | verdict |", "|---|---|---|---:|---:|---|---|---|"]
    for c in comparisons:
        if c.error:
            rows.append(f"| {c.case} | {c.engine} | - | - | - | - | - | refused: {c.error[:80]} |")
            continue
        known = c.problems and c.engine in engine_rope_deviations(drafter_config(by_id[c.case]))
        rows.append(f"| {c.case} | {c.engine} | {c.rope_class} | {c.cos_sin:.1e} | {c.rotation:.1e} | "
                    f"{c.magnitude:.1e} ({c.engine_magnitude:.6g} / {c.ours_magnitude:.6g}) | {c.softmax:.1e} "
                    f"({c.engine_softmax:.6g} / {c.ours_softmax:.6g}) | "
                    f"{'match' if c.ok else ('engine deviation, export refused: ' if known else 'MISMATCH: ')}"
                    f"{'' if c.ok else '; '.join(c.problems)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", action="append", choices=sorted(ENGINE_NAMES))
    ap.add_argument("--python", default=sys.executable, help="the engine's interpreter (default: this one)")
    ap.add_argument("--json", help="write every comparison here")
    ap.add_argument("--verbose", action="store_true", help="show the engines' own logs")
    args = ap.parse_args(argv)
    comparisons: list[Comparison] = []
    for engine in args.engine or ["sglang", "vllm"]:
        comparisons += check(engine, args.python, verbose=args.verbose)
    print(table(comparisons))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(c) for c in comparisons], indent=1))
    bad = verdict(comparisons)
    for line in bad:
        print("FAIL", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("conformance.rope_check")))
