"""Which input records go to which shard: byte-bounded, decided before anything is captured.

Shards are the unit of work (rank ``r`` of ``W`` owns shards ``s ≡ r mod W``), of resume and of
regeneration, so every rank must agree on them without seeing another rank's output, and a rerun
with any world size must find the same ones. Boundaries are therefore a pure function of the parsed
records and the options, cut greedily in input order: a shard closes before the record that would
take its feature bytes past ``--shard-bytes`` or its record count past ``--samples-per-shard``
(a record bigger than the budget on its own gets a shard of its own).

A record's size is what its samples will cost in the shard (tokens × bytes per token, plus the
sample's offset entry):

- without regeneration, exactly: its samples are tokenized when the plan is made;
- with regeneration, the replies are not known yet, so its largest possible size: each answered user
  turn yields at most one sample of at most ``max_length`` tokens. Regenerated shards are therefore
  smaller than the budget by about (mean sample length / max_length). Planning from the real lengths
  would need every earlier shard regenerated first, i.e. ranks waiting on each other.

The boundaries are stored in ``plan.json``; a rerun with the same settings reuses them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from extract.records import Record
from redraft.core import layers
from redraft.core.config import ConfigError
from redraft.core.target_weights import text_config

log = logging.getLogger(__name__)

OFFSET_BYTES = 8  # one int64 sample_offsets entry per sample


def sample_bytes(num_tokens: int, bytes_per_token: int) -> int:
    """What one sample of ``num_tokens`` tokens costs in a shard's tensor data."""
    return num_tokens * bytes_per_token + OFFSET_BYTES


def regenerated_bytes_bound(record: Record, *, max_length: int, max_user_turns: int, bytes_per_token: int) -> int:
    """The most a record can cost once regenerated: one sample of max_length tokens per answered user turn."""
    turns = sum(m.role == "user" for m in record.messages)
    if max_user_turns > 0:
        turns = min(turns, max_user_turns)
    return turns * sample_bytes(max_length, bytes_per_token)


def cut_shards(sizes: Sequence[int], *, shard_bytes: int, max_records: int) -> list[int]:
    """Shard starts (record indices) plus the end: shard s holds records [starts[s], starts[s+1])."""
    if shard_bytes < 1 or max_records < 1:
        raise ValueError(f"shard_bytes and max_records must be >= 1, got {shard_bytes}, {max_records}")
    starts = [0]
    used = 0
    for i, size in enumerate(sizes):
        count = i - starts[-1]
        if count and (used + size > shard_bytes or count >= max_records):
            starts.append(i)
            used = 0
        used += size
    if sizes:
        starts.append(len(sizes))
    return starts


def feature_widths(target_path: Path, aux_layer_ids: Sequence[int], trust_remote_code: bool) -> tuple[int, int]:
    """(hidden_size, number of aux layers) from the target's config, without loading weights."""
    folder = Path(target_path)
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the target's config: {e}") from None
    cfg: Any = raw.get("text_config") or raw
    try:  # AutoConfig maps aliases (n_embd -> hidden_size) the way the backends see them
        from transformers import AutoConfig

        cfg = text_config(AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code,
                                                     local_files_only=True))
    except (ValueError, KeyError, OSError) as e:
        log.debug("%s: transformers cannot parse it (%s); reading the raw JSON", path, e)

    def need(key: str) -> int:
        value = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
        if value is None:
            raise ConfigError(f"{path}: the text config has no {key!r}")
        return int(value)

    hidden, num_layers = need("hidden_size"), need("num_hidden_layers")
    ids = layers.validate_aux_layer_ids(aux_layer_ids, num_layers) if aux_layer_ids else \
        layers.default_aux_layer_ids(num_layers)
    return hidden, len(ids)
