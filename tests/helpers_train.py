"""A tiny target + a learnable tiny dataset for the trainer's tests, and an in-process runner.

The dataset is learnable on purpose: token t+1 is a fixed function of token t (a permutation
cycle over a few ids), aux features are a fixed random code of the token, and the teacher puts
most mass on the true next token. A drafter that learns the cycle gets high step-0 accuracy
within a few dozen steps, so "loss goes down" is a real signal.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from redraft.core.dataset.format import SampleFeatures, dataset_header
from redraft.core.dataset.writer import finalize_dataset, write_shard

HIDDEN = 64  # tiny_llama_config's hidden size
NUM_LAYERS = 6
AUX_IDS = [1, 2, 4]
CYCLE_IDS = list(range(20, 52))  # the tokens the data uses (32 of them)
TOPK = 4


def make_target(path: Path) -> tuple[Path, int]:
    """Tiny Llama target folder (config.json, safetensors, tokenizer); returns (path, vocab size)."""
    from redraft.catalog.tiny_models import make_tiny_llama

    make_tiny_llama(path, num_layers=NUM_LAYERS)
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    return path, vocab


def _sample(i: int, length: int, vocab: int, code: torch.Tensor, cycle: Sequence[int]) -> SampleFeatures:
    g = torch.Generator().manual_seed(1000 + i)
    n = len(cycle)
    start = int(torch.randint(0, n, (1,), generator=g))
    pos = [(start + 7 * t) % n for t in range(length)]  # next = (cur + 7) mod n: a single n-cycle when 7 ∤ n
    ids = torch.tensor([cycle[p] for p in pos], dtype=torch.int64)
    nxt = torch.tensor([cycle[(p + 7) % n] for p in pos], dtype=torch.int64)
    others = torch.stack([torch.tensor(cycle[(p + 1 + j) % n]) for p in pos for j in range(TOPK - 1)])
    topk_ids = torch.cat([nxt[:, None], others.view(length, TOPK - 1)], dim=1)
    probs = torch.tensor([0.85] + [0.04] * (TOPK - 1))
    topk_lp = probs.log().expand(length, TOPK).clone()
    aux = code[ids] + 0.05 * torch.randn(length, 3 * HIDDEN, generator=g)
    loss_mask = torch.ones(length, dtype=torch.bool)
    loss_mask[: min(3, length)] = False  # a short "prompt"
    return SampleFeatures(
        sample_id=f"s{i:04d}",
        source="unit",
        category="chat",
        input_ids=ids,
        loss_mask=loss_mask,
        aux_hidden=aux,
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
    )


def make_dataset(root: Path, target: Path, vocab: int, *, num_samples: int = 64, per_shard: int = 16,
                 min_len: int = 12, max_len: int = 40, cycle_ids: Sequence[int] = CYCLE_IDS) -> Path:
    """Finalized dataset folder whose manifest points at ``target``; its tokens are ``cycle_ids``."""
    g = torch.Generator().manual_seed(7)
    code = torch.randn(vocab, 3 * HIDDEN, generator=g)
    lengths = torch.randint(min_len, max_len + 1, (num_samples,), generator=g).tolist()
    samples = [_sample(i, n, vocab, code, cycle_ids) for i, n in enumerate(lengths)]
    shards = [samples[s : s + per_shard] for s in range(0, num_samples, per_shard)]
    for index, chunk in enumerate(shards):
        write_shard(root, index, chunk, hidden_dtype="bf16", num_aux=3)
    header = dataset_header(
        {"name": "tiny-llama", "path": str(target), "config_hash": "h" * 64, "architecture": "LlamaForCausalLM"},
        hidden_size=HIDDEN, num_layers=NUM_LAYERS, vocab_size=vocab, aux_layer_ids=AUX_IDS,
        tokenizer_hash="t" * 64, chat_template_hash="c" * 64, teacher=["topk"], topk=TOPK, hidden_dtype="bf16",
        max_length=max_len,
    )
    finalize_dataset(root, num_shards=len(shards), header=header, vocab_size=vocab)
    return root


def foreign_folder(src: Path, dst: Path, **config_changes) -> Path:
    """An SGLang/SpecForge-style drafter folder (config.json + model.safetensors, no redraft.json)."""
    dst.mkdir(parents=True)
    shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    for key, value in config_changes.items():
        if key == "layer_ids":
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = value
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def base_args(data: Path, out: Path, **extra: object) -> list[str]:
    """CLI args for a fast fp32 run of a tiny drafter (sizes come from the tiny target)."""
    args = {
        "data": data, "out": out, "dtype": "fp32", "draft_vocab_size": 64, "tokens_per_batch": 160,
        "max_steps": 8, "lr": 3e-3, "warmup_ratio": 0.1, "ttt_steps": 3, "val_fraction": 0.15,
        "val_max_samples": 8, "save_every": 0, "eval_every": 0, "log_every": 2, "keep_last": 0,
        "intermediate_size": 128, "report_to": "none",
    }
    args.update(extra)
    out_args: list[str] = []
    for k, v in args.items():
        out_args += [f"--{k}", str(v)]
    return out_args


def run_main(argv: list[str]) -> dict:
    """Run train.main.main in this process with fresh accelerate singletons (as a new process would)."""
    from accelerate.state import AcceleratorState, GradientState

    from train.main import main

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        return main(argv)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def read_metrics(out: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]
