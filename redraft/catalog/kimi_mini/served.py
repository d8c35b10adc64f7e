"""kimi-k25-mini in Kimi-K2.5's served layout (``KimiK25ForConditionalGeneration``), for SGLang and vLLM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from redraft.catalog.kimi_mini.tokenizer import SPECIAL_TOKENS

REMOTE_CODE = Path(__file__).resolve().parents[1] / "kimi_remote"
REMOTE_FILES = ("configuration_kimi_k25.py", "modeling_kimi_k25.py", "kimi_k25_processor.py",
                "kimi_k25_vision_processing.py")
WRAPPED_ARCHITECTURE = "KimiK25ForConditionalGeneration"

# The vision tower and projector: never run on text, but SGLang builds Kimi's MoonViT from vision_config and loads
# its weights by name while it starts, so the layout carries a complete one at a token size. Kimi-K2.5's values
# where size does not matter; the shrunk ones below with Kimi's value next to the miniature's.
KIMI_K25_VISION: dict[str, Any] = {
    "patch_size": 14,
    "merge_kernel_size": [2, 2],
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "video_attn_type": "spatial_temporal",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-05,
}
KIMI_K25_VISION_SHRUNK: dict[str, tuple[int, int]] = {
    "vt_hidden_size": (1152, 32),
    "vt_num_hidden_layers": (27, 1),
    "vt_num_attention_heads": (16, 2),
    "vt_intermediate_size": (4304, 64),
    "init_pos_emb_height": (64, 8),
    "init_pos_emb_width": (64, 8),
}
# Kimi-K2.5's media budget (preprocessor_config.json's media_proc_cfg), kept: SGLang reads every key while it starts.
KIMI_K25_MEDIA_PROC: dict[str, Any] = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 16384,
    "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def vision_config(text_hidden: int) -> dict[str, Any]:
    """The served layout's vision_config: Kimi's ``vt_*`` keys (its checkpoint's, the stand-in's) and the same sizes
    under the names SGLang's KimiK25VisionConfig builds the tower from (hidden_size, num_hidden_layers, ...)."""
    cfg = dict(KIMI_K25_VISION)
    cfg.update({k: mini for k, (_, mini) in KIMI_K25_VISION_SHRUNK.items()})
    cfg.update({"hidden_size": cfg["vt_hidden_size"], "num_hidden_layers": cfg["vt_num_hidden_layers"],
                "num_attention_heads": cfg["vt_num_attention_heads"], "intermediate_size": cfg["vt_intermediate_size"],
                "mm_hidden_size": cfg["vt_hidden_size"], "text_hidden_size": int(text_hidden)})
    return cfg


def _vision_tensors(vision: dict[str, Any], text_hidden: int, dtype: Any) -> dict[str, Any]:
    """Seeded weights for the stand-in tower and projector, named as Kimi-K2.5's checkpoint names them (the
    stand-in module in kimi_remote defines the names and shapes; SGLang maps wqkv/wo/proj.N to its own)."""
    import torch

    from redraft.catalog.kimi_remote.modeling_kimi_k25 import ProjectorStandin, VisionTowerStandin

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        parts = {"vision_tower": VisionTowerStandin(vision), "mm_projector": ProjectorStandin(vision, text_hidden)}
    return {f"{prefix}.{k}": v.detach().to(dtype).contiguous() for prefix, module in parts.items()
            for k, v in module.state_dict().items()}


def write_processor_config(out: Path) -> None:
    """preprocessor_config.json as Kimi-K2.5 ships it: the remote processor classes (auto_map) and the media budget.
    Without it AutoProcessor falls back to the bare tokenizer, and SGLang's kimi_k25 processor stops at start-up
    (no ``media_processor``)."""
    cfg = {"auto_map": {"AutoProcessor": "kimi_k25_processor.KimiK25Processor",
                        "AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"},
           "image_processor_type": "KimiK25VisionProcessor",
           "media_proc_cfg": dict(KIMI_K25_MEDIA_PROC)}
    (out / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_wrapped(plain: Path, out: Path) -> Path:
    """The miniature in Kimi-K2.5's served layout: the same text weights under ``language_model.``, the text
    config nested as ``text_config``, a token-sized vision tower and projector, the processor files, and the
    model and processor code that ``trust_remote_code`` loads (``auto_map``), as in the real checkpoint."""
    from safetensors.torch import load_file, save_file

    plain, out = Path(plain), Path(out)
    out.mkdir(parents=True, exist_ok=False)
    text = json.loads((plain / "config.json").read_text())
    text.pop("transformers_version", None)
    hidden = int(text["hidden_size"])
    cfg = {
        "architectures": [WRAPPED_ARCHITECTURE],
        "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "text_config": text,
        "vision_config": vision_config(hidden),
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "media_placeholder_token_id": SPECIAL_TOKENS["<|media_pad|>"],
        "tie_word_embeddings": False,
        "dtype": text.get("dtype", "float32"),
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tensors = {f"language_model.{k}": v for k, v in load_file(str(plain / "model.safetensors")).items()}
    tensors.update(_vision_tensors(cfg["vision_config"], hidden, next(iter(tensors.values())).dtype))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in plain.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "redraft_build.json"):
            shutil.copy2(f, out / f.name)
    for name in REMOTE_FILES:
        shutil.copy2(REMOTE_CODE / name, out / name)
    write_processor_config(out)
    return out
