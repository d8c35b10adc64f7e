"""Loss-masked token counts over a dataset's shards: what the draft vocabulary is chosen from.

The writer stores them with the manifest; the reader counts them itself while a folder is still being written
(a streamed run); extract.verify recounts them. One reading of the shards for all three, here, so the reader does
not reach into the writer."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from redraft.core.dataset.format import DatasetError

_COUNT_BATCH_IDS = 1 << 24  # ids counted per bincount: one pass over the vocabulary per batch, not per shard


def count_tokens(shard_paths: list[Path], vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size] counts of loss-masked tokens, reading only input_ids/loss_mask of each shard.

    The ids of consecutive shards are counted together (up to _COUNT_BATCH_IDS at a time): a bincount over
    Kimi's 163,840-id vocabulary per shard cost more than reading the shard's ids at 2,000 small shards."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    pending: list[torch.Tensor] = []
    held = 0
    for path in shard_paths:
        try:
            with safe_open(str(path), framework="pt") as f:
                ids = f.get_tensor("input_ids")
                mask = f.get_tensor("loss_mask").bool()
        except SafetensorError as e:
            raise DatasetError(f"{path}: not a readable safetensors file (truncated or corrupt): {e}") from e
        sel = ids[mask]
        if sel.numel() and (int(sel.max()) >= vocab_size or int(sel.min()) < 0):
            raise DatasetError(
                f"{path}: key 'input_ids' holds id {int(sel.max())} outside vocab_size {vocab_size}"
            )
        pending.append(sel)
        held += sel.numel()
        if held >= _COUNT_BATCH_IDS:
            counts += torch.bincount(torch.cat(pending).long(), minlength=vocab_size)
            pending, held = [], 0
    if pending:
        counts += torch.bincount(torch.cat(pending).long(), minlength=vocab_size)
    return counts
