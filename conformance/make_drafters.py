"""Produce the exported drafters the engine check loads, through the product's own commands.

    python -m conformance.make_drafters demo  WORK
    python -m conformance.make_drafters demo-mla WORK
    python -m conformance.make_drafters kimi  WORK
    python -m conformance.make_drafters warm  WORK
    python -m conformance.make_drafters mla   WORK

Each writes ``WORK/exports/<name>-{sglang,vllm}`` with ``python -m eval.export`` (the command users
run) and ``WORK/exports/<name>.json`` naming the context length the engine check should use and
whether each format is loaded by both engines or only by its own (``engines``):

- ``demo``: a real tiny pipeline: 6 chitchat samples through SmolLM2 (no regeneration), 2 training
  steps of configs/demo/train.yaml, export;
- ``demo-mla``: the same data and 2 steps with ``--drafter-attention mla`` (the sizes of
  configs/demo/drafter_kinds.yaml: q_lora 576, kv_lora 512, nope 64, rope 64, v 64), exported as
  ``Eagle3DeepseekV2ForCausalLM``: our own MLA export in both engines;
- ``kimi``: a drafter with the Kimi-K2.5 shape (hidden 7168, 64/64 heads, intermediate 18432, vocab
  163840, draft vocab 32000, 61-layer target, our ids [1, 29, 57]); random bf16 weights written by
  ``train.checkpoint.write_drafter_folder`` (1.2B parameters: built tensor by tensor in bf16);
- ``warm``: an SGLang-layout drafter written by ``conformance.foreign_drafter`` (SmolLM2 demo shape;
  not through ``redraft.core.drafter``: it stands for a drafter made elsewhere), imported by
  ``train/main.py --init-from`` for one step, export;
- ``mla``: MLA drafters (``Eagle3DeepseekV2ForCausalLM``) in the engines' layout, which our exporter
  does not write yet, written by ``conformance.foreign_drafter`` into ``WORK/foreign/<name>`` with
  ``WORK/foreign/<name>.json`` saying what each engine must answer: a small one (PASS in both), a
  Kimi-K2.5-sized one (hidden 7168, 64 heads, q_lora 1536, kv_lora 512, draft vocab 32000, vocab
  163840; about 0.9 B parameters in bf16) checked against a Kimi-K2.5-shaped target config, and one
  with ``q_lora_rank: null`` (a direct ``q_proj``) that both engines must refuse (they do in
  SGLang 0.5.23 / vLLM 0.33.0: the day one accepts it, the lane says so).
Reruns reuse finished pieces (the dataset, checkpoints, foreign folders); exports are always redone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from redraft.core import cli as ending

log = logging.getLogger("conformance.make_drafters")

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONTEXT = 8192  # SmolLM2-135M-Instruct's max_position_embeddings
KIMI_CONTEXT = 262144
KIMI = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, head_dim=128,
            intermediate_size=18432, vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168,
            aux_layer_ids=[1, 29, 57], target_num_layers=61, target_architecture="KimiK25ForConditionalGeneration",
            rope_theta=1e6, max_position_embeddings=KIMI_CONTEXT, torch_dtype="bfloat16")
# the foreign drafters of the engine-loading phase: name -> (preset, expected verdict per engine, why, target)
MLA_DRAFTERS = {
    "mla-small": ("mla-tiny", "PASS", "a small random MLA drafter", None),
    "mla-kimi": ("mla-kimi", "PASS", "Kimi-K2.5-sized MLA drafter", "kimi-k25-target.json"),
    "mla-direct-q": ("mla-tiny-direct-q", "FAIL", "q_lora_rank null: SGLang's Eagle3 MLA layer requires q_lora_rank, "
                     "vLLM's stacked mapper sends kv_a_proj_with_mqa to a fused_qkv_a_proj that does not exist", None),
}


def run(cmd: list[str]) -> None:
    """Run one product command from the repo root; its failure is the lane's failure."""
    log.info("$ %s", " ".join(cmd))
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"command failed with exit code {proc.returncode}: {' '.join(cmd)}")
    log.info("  ok in %.1f s", time.time() - t0)


def export_both(ckpt: Path, exports: Path, name: str, context: int, extra: list[str] | None = None,
                engines: str = "both") -> None:
    """Both formats of ``ckpt``; ``engines`` tells the check to load each in both engines or only its own."""
    exports.mkdir(parents=True, exist_ok=True)
    for fmt in ("sglang", "vllm"):
        run([sys.executable, "-m", "eval.export", str(ckpt), str(exports / f"{name}-{fmt}"), "--format", fmt,
             "--force", "-q", *(extra or [])])
    meta = {"name": name, "context_length": context, "engines": engines}
    (exports / f"{name}.json").write_text(json.dumps(meta) + "\n")


def train(data: Path, out: Path, steps: int, extra: list[str] | None = None) -> None:
    if (out / "latest").is_file():
        log.info("reusing %s", out)
        return
    run([sys.executable, "train/main.py", "--config", "configs/demo/train.yaml", "--data", str(data), "--out", str(out),
         "--max-steps", str(steps), "--save-every", str(steps), "--eval-every", "0", "--val-fraction", "0",
         "--report-to", "none", *(extra or [])])


def make_data(work: Path) -> Path:
    data = work / "data"
    if not (data / "manifest.json").is_file():
        run([sys.executable, "-m", "extract", "--target", "smollm2-135m-instruct", "--data", "chitchat",
             "--max-samples", "6", "--no-regenerate", "--max-length", "256", "--samples-per-shard", "6",
             "--topk", "64", "--out", str(data)])
    return data


def make_demo(work: Path) -> None:
    data = make_data(work)
    train(data, work / "runs" / "demo", steps=2)
    export_both(work / "runs" / "demo", work / "exports", "demo", DEMO_CONTEXT)


# the demo's MLA drafter sizes (configs/demo/drafter_kinds.yaml): SmolLM2 has no latent sizes of its own;
# configs/demo/train.yaml's GQA-only keys are unset ("none"), as benchmarks/drafter_kinds.py does
DEMO_MLA = ["--drafter-attention", "mla", "--q-lora-rank", "576", "--kv-lora-rank", "512", "--qk-nope-head-dim", "64",
            "--qk-rope-head-dim", "64", "--v-head-dim", "64", "--num-key-value-heads", "none", "--head-dim", "none"]


def make_demo_mla(work: Path) -> None:
    data = make_data(work)
    train(data, work / "runs" / "demo-mla", steps=2, extra=DEMO_MLA)
    export_both(work / "runs" / "demo-mla", work / "exports", "demo-mla", DEMO_CONTEXT)


def make_warm(work: Path) -> None:
    from conformance.foreign_drafter import PRESETS, write_folder

    data = make_data(work)
    fake = work / "imported-sglang"
    if not (fake / "model.safetensors").is_file():
        write_folder(fake, PRESETS["llama-smollm"], seed=1)
        log.info("wrote the SGLang-layout drafter %s", fake)
    train(data, work / "runs" / "warm", steps=1, extra=["--init-from", str(fake)])
    export_both(work / "runs" / "warm", work / "exports", "warm", DEMO_CONTEXT)


def kimi_state(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random serving weights of ``cfg`` in bf16, one tensor at a time (never an fp32 copy of the model)."""
    from redraft.core.drafter.serving_format import expected_tensors
    from redraft.core.drafter.vocab import build_vocab_mapping

    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for key, spec in expected_tensors(cfg, "sglang").items():
        if spec.kind != "float":
            continue
        if len(spec.shape) == 1:  # norm weights
            state[key] = torch.ones(spec.shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(spec.shape, dtype=torch.bfloat16)
            t.normal_(0.0, 0.02, generator=g)
            state[key] = t
    counts = torch.randint(0, 1000, (cfg.vocab_size,), generator=g, dtype=torch.int64)
    state["d2t"], state["t2d"] = build_vocab_mapping(counts, cfg.draft_vocab_size)
    return state


def make_kimi(work: Path) -> None:
    from redraft.core.drafter.config import DrafterConfig
    from redraft.core.drafter.folder import write_drafter_folder

    cfg = DrafterConfig(**KIMI)
    ckpt = work / "runs" / "kimi"
    if not (ckpt / "redraft.json").is_file():
        tmp = ckpt.with_name(".tmp-kimi")
        tmp.mkdir(parents=True, exist_ok=True)
        state = kimi_state(cfg)
        n = sum(t.numel() for t in state.values() if t.is_floating_point())
        log.info("Kimi-K2.5-shaped drafter: %.2fB parameters (bf16)", n / 1e9)
        write_drafter_folder(tmp, cfg, state, {"format": "redraft-conformance", "note": "random weights"})
        del state
        os.replace(tmp, ckpt)
    # each format in its own engine only: one engine check of 1.2B parameters takes minutes on 2 cores
    export_both(ckpt, work / "exports", "kimi", KIMI_CONTEXT, ["--max-position-embeddings", str(KIMI_CONTEXT)],
                engines="matching")
    # 2.4 GB that nothing reads after the export (the engines load the exports): gone before the next drafters
    # are written, so the lane's peak disk is one Kimi-sized copy lower
    shutil.rmtree(ckpt)


def make_mla(work: Path) -> None:
    """The MLA drafters (and the Kimi-K2.5-shaped target config) with what each engine must say."""
    from conformance.foreign_drafter import PRESETS, kimi_k25_target_config, write_folder

    root = work / "foreign"
    root.mkdir(parents=True, exist_ok=True)
    (root / "kimi-k25-target.json").write_text(json.dumps(kimi_k25_target_config(), indent=1) + "\n")
    for name, (preset, verdict, why, target) in MLA_DRAFTERS.items():
        folder = root / name
        if not (folder / "model.safetensors").is_file():
            t0 = time.time()
            write_folder(folder, PRESETS[preset], seed=2)
            log.info("wrote %s (%s) in %.1f s", folder, preset, time.time() - t0)
        meta = {"name": name, "folder": name, "expect": {"sglang": verdict, "vllm": verdict}, "why": why,
                "target_config": target, "context_length": None}
        (root / f"{name}.json").write_text(json.dumps(meta) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.make_drafters", description=__doc__.split("\n\n")[0])
    p.add_argument("which", choices=("demo", "demo-mla", "kimi", "warm", "mla"))
    p.add_argument("work", type=Path)
    a = p.parse_args(argv)
    ending.configure_logging(logging.INFO, "[make_drafters] %(message)s")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    a.work.mkdir(parents=True, exist_ok=True)
    if a.which == "demo":
        make_demo(a.work)
    elif a.which == "demo-mla":
        make_demo_mla(a.work)
    elif a.which == "kimi":
        make_kimi(a.work)
    elif a.which == "mla":
        make_mla(a.work)
    else:
        make_warm(a.work)
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("conformance.make_drafters")))
