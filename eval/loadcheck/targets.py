"""The target config vLLM needs to build a drafter: given as a file, or synthesised from the draft.

Why vLLM needs one: ``EngineArgs(model=TARGET, speculative_config=...)`` sizes the draft's
``draft_id_to_target_id`` (present only when the draft vocab differs from the TARGET's), numbers the
draft layer after the target's layers, and decides whether the target's embedding can be shared.
A synthesised target is sized from the draft (vocab, hidden = ``target_hidden_size``, enough layers
for the aux ids); for an MLA drafter it is a DeepSeek-V3-style MoE config with the draft's MLA
dimensions, which is what Kimi-K2.x targets are. A real target's ``config.json`` is better: pass it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eval.loadcheck.folder import MLA, DrafterFolder, FolderError


def synth_target(folder: DrafterFolder, context_length: int | None = None) -> dict[str, Any]:
    """A target config the drafter fits; MLA drafters get a DeepSeek-V3 (Kimi-K2-style) target."""
    c = folder.config
    layers = max([*folder.aux_layer_ids, 3]) + 1
    hidden = int(c.get("target_hidden_size") or c["hidden_size"])
    heads = int(c["num_attention_heads"])
    common = {
        "hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": folder.vocab,
        "num_attention_heads": heads, "num_key_value_heads": int(c.get("num_key_value_heads") or heads),
        "intermediate_size": int(c.get("intermediate_size") or 4 * hidden), "hidden_act": "silu",
        "rms_norm_eps": c.get("rms_norm_eps", 1e-6), "rope_theta": c.get("rope_theta", 10000.0),
        "max_position_embeddings": int(context_length or c.get("max_position_embeddings") or 4096),
        "torch_dtype": c.get("torch_dtype", "bfloat16"), "tie_word_embeddings": False,
    }
    if folder.kind != MLA:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "head_dim": int(c.get("head_dim") or int(c["hidden_size"]) // heads), **common}
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
        "q_lora_rank": c.get("q_lora_rank"), "kv_lora_rank": c["kv_lora_rank"],
        "qk_nope_head_dim": c["qk_nope_head_dim"], "qk_rope_head_dim": c["qk_rope_head_dim"],
        "v_head_dim": c["v_head_dim"], "moe_intermediate_size": max(16, common["intermediate_size"] // 8),
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "rope_scaling": c.get("rope_scaling"),
    }


def target_config(folder: DrafterFolder, given: str | Path | None, context_length: int | None) -> dict[str, Any]:
    """The given target config.json (a folder or the file itself), else a synthesised one."""
    if given is None:
        return synth_target(folder, context_length)
    path = Path(given)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FolderError(f"--target-config {given}: no such file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise FolderError(f"--target-config {path}: not JSON ({e})") from e
