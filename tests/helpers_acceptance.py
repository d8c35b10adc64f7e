"""Synthetic cases where a drafter's own drafts often match the "teacher", so acceptance is not trivially zero.

The teacher argmax of row r is, with probability ``agree``, the chain draft made from an anchor
position (anchors restart at random), and the next data token follows the argmax with probability
``follow``: long accepted runs, data leaving the argmax path, and plain misses all occur.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eval import simulate as sim
from redraft.core.dataset.format import SampleFeatures, dataset_header
from redraft.core.dataset.writer import finalize_dataset, write_shard


def _chain_drafts(drafter, ids: torch.Tensor, aux: torch.Tensor, p: int, steps: int) -> list[int]:
    """Greedy chain drafts at position p, from the prefix only (tokens after p+1 do not matter)."""
    n = p + 3
    seq = torch.cat([ids[: p + 2], torch.zeros(1, dtype=torch.int64)])[:n]
    res, _ = sim.simulate_chain_greedy(
        drafter, input_ids=seq[None], aux_hidden=aux[:n][None], attention_mask=torch.ones(1, n, dtype=torch.bool),
        loss_mask=torch.ones(1, n, dtype=torch.bool), target_ids=torch.full((1, n), -1), steps=steps,
    )
    row = (res.position == p).nonzero().squeeze(-1)
    return res.drafts[row[0]].tolist()


@torch.no_grad()
def make_case(drafter, lengths: list[int], steps: int, seed: int = 0, agree: float = 0.85,
              follow: float = 0.85, hole: bool = True) -> dict:
    """Right-padded batch: input_ids, aux_hidden, attention_mask, loss_mask, target_ids (argmax rows)."""
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    width = cfg.num_aux_layers * cfg.target_hidden_size
    vocab = cfg.vocab_size
    seq = max(lengths)
    out = {
        "input_ids": torch.zeros(len(lengths), seq, dtype=torch.int64),
        "aux_hidden": torch.zeros(len(lengths), seq, width),
        "attention_mask": torch.zeros(len(lengths), seq, dtype=torch.bool),
        "loss_mask": torch.zeros(len(lengths), seq, dtype=torch.bool),
        "target_ids": torch.zeros(len(lengths), seq, dtype=torch.int64),
    }

    def rand_tok() -> int:
        return int(torch.randint(0, vocab, (1,), generator=g))

    for b, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=g)
        aux = torch.randn(n, width, generator=g).bfloat16().float()  # exactly what a bf16 store returns
        tgt = torch.randint(0, vocab, (n,), generator=g)
        anchor = 0
        for r in range(1, n - 1):
            k = r - 1 - anchor
            if k >= steps or float(torch.rand(1, generator=g)) < 0.15:
                anchor, k = r - 1, 0
            drafts = _chain_drafts(drafter, ids, aux, anchor, steps)
            tgt[r] = drafts[k] if float(torch.rand(1, generator=g)) < agree else rand_tok()
            ids[r + 1] = tgt[r] if float(torch.rand(1, generator=g)) < follow else rand_tok()
        lm = torch.ones(n, dtype=torch.bool)
        lm[:2] = False
        if hole and n > 12:
            lm[n // 2] = False  # a non-assistant token inside: chains must stop before it
        out["input_ids"][b, :n] = ids
        out["aux_hidden"][b, :n] = aux
        out["attention_mask"][b, :n] = True
        out["loss_mask"][b, :n] = lm
        out["target_ids"][b, :n] = tgt
    return out


def write_target(path: Path, drafter, lm_head: torch.Tensor, architecture: str = "LlamaForCausalLM") -> Path:
    """A minimal target folder: config.json + the two tensors eval reads (embedding and lm_head)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config
    (path / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": "llama", "hidden_size": cfg.target_hidden_size,
        "vocab_size": cfg.vocab_size, "num_hidden_layers": cfg.target_num_layers, "tie_word_embeddings": False,
        "max_position_embeddings": cfg.max_position_embeddings,
    }))
    save_file({"model.embed_tokens.weight": drafter.embed_tokens.weight.detach().clone().contiguous(),
               "lm_head.weight": lm_head.contiguous()}, str(path / "model.safetensors"))
    return path


def write_case_dataset(root: Path, case: dict, drafter, target: Path, lm_head: torch.Tensor, *,
                       topk: int = 4, generation: dict | None = None, per_shard: int = 2,
                       sources: list[str] | None = None) -> Path:
    """Dataset whose teacher argmax is ``case['target_ids']``: last_hidden = 5 * lm_head[argmax] (so the
    lm_head's argmax is that token), top-k from the same logits."""
    cfg = drafter.config
    samples = []
    for b in range(case["input_ids"].shape[0]):
        n = int(case["attention_mask"][b].sum())
        tgt = case["target_ids"][b, :n]
        last = 5.0 * lm_head[tgt]
        lp = torch.log_softmax(last @ lm_head.T, -1)
        top = lp.topk(topk, -1)
        samples.append(SampleFeatures(
            sample_id=f"c{b}", source=(sources[b] if sources else "unit"), category="even" if b % 2 == 0 else "odd",
            input_ids=case["input_ids"][b, :n], loss_mask=case["loss_mask"][b, :n],
            aux_hidden=case["aux_hidden"][b, :n], topk_ids=top.indices, topk_logprobs=top.values,
            last_hidden=last, truncated=False,
        ))
    shards = [samples[i : i + per_shard] for i in range(0, len(samples), per_shard)]
    for s, chunk in enumerate(shards):
        write_shard(root, s, chunk, hidden_dtype="bf16", num_aux=cfg.num_aux_layers)
    header = dataset_header(
        {"name": "tiny", "path": str(target), "config_hash": "0" * 64, "architecture": cfg.target_architecture},
        hidden_size=cfg.target_hidden_size, num_layers=cfg.target_num_layers, vocab_size=cfg.vocab_size,
        aux_layer_ids=cfg.aux_layer_ids, tokenizer_hash="t" * 64, chat_template_hash="c" * 64,
        teacher=["topk", "last_hidden"], topk=topk, hidden_dtype="bf16", max_length=64, generation=generation,
    )
    finalize_dataset(root, num_shards=len(shards), header=header, vocab_size=cfg.vocab_size)
    return root
