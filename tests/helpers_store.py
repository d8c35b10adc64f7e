"""Builders for tiny random datasets written through redraft.core.dataset.writer (usable by any test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from redraft.core.dataset.format import SampleFeatures, dataset_header
from redraft.core.dataset.writer import finalize_dataset, write_shard


def make_sample(
    sample_id: str,
    length: int,
    *,
    hidden: int = 16,
    num_aux: int = 3,
    vocab: int = 100,
    topk: int | None = 4,
    last_hidden: bool = False,
    seed: int = 0,
    category: str | None = "chat",
) -> SampleFeatures:
    """A random sample with hidden-state magnitudes that differ per layer (like real targets)."""
    g = torch.Generator().manual_seed(seed)
    layer_scale = torch.tensor([0.5 * 8.0**i for i in range(num_aux)]).view(1, -1, 1)
    aux = torch.randn(length, num_aux, hidden, generator=g) * layer_scale
    logits = torch.randn(length, vocab, generator=g)
    lp = torch.log_softmax(logits, dim=-1)
    top = lp.topk(topk, dim=-1) if topk else None
    mask = torch.rand(length, generator=g) > 0.3
    return SampleFeatures(
        sample_id=sample_id,
        source="unit",
        category=category,
        input_ids=torch.randint(0, vocab, (length,), generator=g),
        loss_mask=mask,
        aux_hidden=aux.reshape(length, num_aux * hidden),
        topk_ids=top.indices if top is not None else None,
        topk_logprobs=top.values if top is not None else None,
        last_hidden=torch.randn(length, hidden, generator=g) * 3 if last_hidden else None,
        truncated=False,
    )


def make_header(
    *,
    hidden: int = 16,
    vocab: int = 100,
    hidden_dtype: str = "bf16",
    topk: int | None = 4,
    last_hidden: bool = False,
    num_aux: int = 3,
) -> dict[str, Any]:
    kinds = (["topk"] if topk else []) + (["last_hidden"] if last_hidden else [])
    return dataset_header(
        {"name": "tiny", "path": "/nowhere", "config_hash": "0" * 64, "architecture": "LlamaForCausalLM"},
        hidden_size=hidden, num_layers=8, vocab_size=vocab, aux_layer_ids=range(1, 1 + num_aux),
        tokenizer_hash="t" * 64, chat_template_hash="c" * 64, teacher=kinds, topk=topk or None,
        hidden_dtype=hidden_dtype, max_length=64, skipped={"too_long": 1},
    )


def make_dataset(
    root: Path,
    *,
    shard_lengths: list[list[int]] | None = None,
    hidden: int = 16,
    vocab: int = 100,
    hidden_dtype: str = "bf16",
    topk: int | None = 4,
    last_hidden: bool = False,
    num_aux: int = 3,
) -> dict:
    """Write and finalize a dataset; shard_lengths[s] lists the token counts of shard s's samples."""
    shard_lengths = shard_lengths if shard_lengths is not None else [[5, 7], [3], []]
    n = 0
    for s, lengths in enumerate(shard_lengths):
        samples = []
        for length in lengths:
            samples.append(
                make_sample(
                    f"s{n}",
                    length,
                    hidden=hidden,
                    num_aux=num_aux,
                    vocab=vocab,
                    topk=topk,
                    last_hidden=last_hidden,
                    seed=n,
                )
            )
            n += 1
        write_shard(root, s, samples, hidden_dtype=hidden_dtype, num_aux=num_aux, skipped={"empty": s})
    header = make_header(
        hidden=hidden,
        vocab=vocab,
        hidden_dtype=hidden_dtype,
        topk=topk,
        last_hidden=last_hidden,
        num_aux=num_aux,
    )
    return finalize_dataset(root, num_shards=len(shard_lengths), header=header, vocab_size=vocab)
