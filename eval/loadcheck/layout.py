"""Which checkpoint tensor fills which rows of the engines' stacked parameters.

Both engines stack the same way at TP=1 (read from SGLang 0.5.23 / vLLM 0.33.0): Llama attention
``qkv_proj`` = q, k, v rows; the MLP's ``gate_up_proj`` = gate, up; MLA's fused down-projection
(``fused_qkv_a_proj_with_mqa`` in SGLang, ``fused_qkv_a_proj`` in vLLM) = ``q_a_proj`` rows then
``kv_a_proj_with_mqa`` rows. Used only to NAME what is missing ("rows 128..255: the up_proj shard");
whether something is missing is decided by the sentinels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from eval.loadcheck.probe import Shard


def _cut(labels_sizes: list[tuple[str, int]]) -> list[Shard]:
    out, start = [], 0
    for label, size in labels_sizes:
        out.append(Shard(label, start, start + size))
        start += size
    return out


def stacked_shards(param_rows: Iterable[tuple[str, int]], config: Mapping[str, Any]) -> dict[str, list[Shard]]:
    """``{parameter: [Shard, ...]}`` for the stacked parameters among ``(name, rows)``; sizes must add up."""
    c = config
    out: dict[str, list[Shard]] = {}
    for name, rows in param_rows:
        table: list[tuple[str, int]] = []
        if name.endswith("gate_up_proj.weight"):
            table = [("gate_proj", int(c["intermediate_size"])), ("up_proj", int(c["intermediate_size"]))]
        elif name.endswith(".qkv_proj.weight"):
            heads = int(c["num_attention_heads"])
            kv = int(c.get("num_key_value_heads") or heads)
            hd = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
            table = [("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)]
        elif name.endswith(("fused_qkv_a_proj_with_mqa.weight", "fused_qkv_a_proj.weight")) and c.get("q_lora_rank"):
            table = [("q_a_proj", int(c["q_lora_rank"])),
                     ("kv_a_proj_with_mqa", int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"]))]
        if table and sum(size for _, size in table) == rows:
            out[name] = _cut(table)
    return out
