"""Produce the exported drafters the engine check loads, through the product's own commands.

    python -m conformance.make_drafters demo  WORK [--shared-tools DIR]
    python -m conformance.make_drafters kimi  WORK
    python -m conformance.make_drafters warm  WORK --shared-tools DIR

Each writes ``WORK/exports/<name>-{sglang,vllm}`` with ``python -m eval.export`` (the command users
run) and ``WORK/exports/<name>.json`` naming the context length the engine check should use and
whether each format is loaded by both engines or only by its own (``engines``):

- ``demo``: a real tiny pipeline: 6 chitchat samples through SmolLM2 (no regeneration), 2 training
  steps of configs/demo/train.yaml, export;
- ``kimi``: a drafter with the Kimi-K2.5 shape (hidden 7168, 64/64 heads, intermediate 18432, vocab
  163840, draft vocab 32000, 61-layer target, our ids [1, 29, 57]); random bf16 weights written by
  ``train.checkpoint.write_drafter_folder`` (1.2B parameters: built tensor by tensor in bf16);
- ``warm``: an SGLang-layout drafter written by the peer tool make_fake_drafter.py (SmolLM2 demo
  shape), imported by ``train/main.py --init-from`` for one step, export.
Reruns reuse finished pieces (the dataset, checkpoints); exports are always redone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("conformance.make_drafters")

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONTEXT = 8192  # SmolLM2-135M-Instruct's max_position_embeddings
KIMI_CONTEXT = 262144
KIMI = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, head_dim=128,
            intermediate_size=18432, vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168,
            aux_layer_ids=[1, 29, 57], target_num_layers=61, target_architecture="KimiK25ForConditionalGeneration",
            rope_theta=1e6, max_position_embeddings=KIMI_CONTEXT, torch_dtype="bfloat16")
# make_fake_drafter.py sized like the demo drafter (configs/demo/train.yaml), SGLang ids of a Llama target
WARM_FAKE_ARGS = ["--hidden", "576", "--heads", "9", "--kv-heads", "3", "--head-dim", "64", "--intermediate", "768",
                  "--vocab", "49152", "--draft-vocab", "4096", "--target-hidden", "576",
                  "--aux-layer-ids", "1", "14", "26", "--max-pos", str(DEMO_CONTEXT), "--dtype", "bfloat16"]


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


def make_warm(work: Path, shared_tools: Path) -> None:
    data = make_data(work)
    fake = work / "imported-sglang"
    if not (fake / "model.safetensors").is_file():
        run([sys.executable, str(shared_tools / "make_fake_drafter.py"), str(fake), *WARM_FAKE_ARGS])
    train(data, work / "runs" / "warm", steps=1, extra=["--init-from", str(fake)])
    export_both(work / "runs" / "warm", work / "exports", "warm", DEMO_CONTEXT)


def kimi_state(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random serving weights of ``cfg`` in bf16, one tensor at a time (never an fp32 copy of the model)."""
    from core.drafter.serving_format import expected_tensors
    from core.drafter.vocab import build_vocab_mapping

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
    from core.drafter.config import DrafterConfig
    from core.drafter.folder import write_drafter_folder

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.make_drafters", description=__doc__.split("\n\n")[0])
    p.add_argument("which", choices=("demo", "kimi", "warm"))
    p.add_argument("work", type=Path)
    p.add_argument("--shared-tools", type=Path, default=Path(os.environ.get("REDRAFT_SHARED_TOOLS", "../shared/tools")))
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[make_drafters] %(message)s")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    a.work.mkdir(parents=True, exist_ok=True)
    if a.which == "demo":
        make_demo(a.work)
    elif a.which == "kimi":
        make_kimi(a.work)
    else:
        make_warm(a.work, a.shared_tools.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
