"""One sample of more than 32,768 tokens, captured by the HF backend in chunks, and the check an engine's capture of
the same ids must pass: what tests/engine/{vllm,sglang}/test_long_capture_*.py share (issue 45's goals)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from capture_speed import compare_captures

from extract.backends.base import TeacherSpec
from extract.backends.hf import HFTarget
from redraft.catalog.tiny_models import make_tiny_llama

LENGTH = 32_800
MEDIAN_REL, TOP1 = 1e-5, 0.999
TEACHER = TeacherSpec(kinds=("topk",), topk=8)


def long_sample(root: Path) -> tuple[Path, HFTarget, list[int], list[Any]]:
    """(target folder, its HF backend, LENGTH random ids, HF's capture of them in chunks of 8,192): a 64-wide Llama
    with a 64K context, the length being what is tested."""
    target = make_tiny_llama(root / "target", num_layers=4, heads=(2, 1), max_positions=65_536)
    hf = HFTarget(str(target), chunk_tokens=8192)
    ids = torch.randint(4, hf.info.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(0)).tolist()
    return target, hf, ids, hf.capture([ids], TEACHER)


def assert_equal_capture(hf: HFTarget, ours: list[Any], theirs: list[Any]) -> None:
    """Per aux layer median relative difference <= 1e-5, teacher top-1 the same at >= 99.9% of positions."""
    assert theirs[0].aux_hidden.shape == ours[0].aux_hidden.shape == (LENGTH, 3 * hf.info.hidden_size)
    stats = compare_captures(ours, theirs, hf.info.hidden_size, len(hf.info.aux_layer_ids))
    print(json.dumps(stats))
    for k, layer in enumerate(stats["layers"]):
        assert layer["median"] <= MEDIAN_REL, (k, layer)
    assert stats["top1_equal"] >= TOP1, stats
