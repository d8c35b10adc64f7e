"""kimi-k25-mini's folder: transformers' own, made explicit for the engines, with its build record."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from redraft.catalog.kimi_mini.architecture import (
    BUILD_VERSION,
    KIMI_K25_SHRUNK,
    KIMI_K25_SOURCE,
    KIMI_K25_TEXT_CONFIG,
    NAME,
    text_config,
)
from redraft.catalog.kimi_mini.tokenizer import (
    CHAT_TEMPLATE,
    END_OF_TURN,
    SPECIAL_TOKENS,
    TOKENIZER_ROLES,
    build_tokenizer,
    chat_ids,
)
from redraft.catalog.kimi_mini.training import PROMPTS, RECIPE, Recipe, Trained, recipe_digest, train

logger = logging.getLogger(__name__)


def _full_model(trained: Trained, seed: int) -> Any:
    """The saved model: the trained weights at full vocabulary; rows of ids outside the support are the
    initial embedding rows (never updated: those ids never occur in training) and zero lm_head rows."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = text_config()
    torch.manual_seed(seed + 2)
    full = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).float().eval()
    src = trained.model.state_dict()
    idx = torch.tensor(trained.support)
    with torch.no_grad():
        for name, tensor in full.state_dict().items():
            if name == "model.embed_tokens.weight":
                tensor[idx] = src[name]
            elif name == "lm_head.weight":
                tensor.zero_()
                tensor[idx] = src[name]
            else:
                tensor.copy_(src[name])
    return full


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _gate_bias_keys(config: dict[str, Any], prefix: str = "") -> list[str]:
    n = int(config["num_hidden_layers"])
    first = int(config["first_k_dense_replace"])
    return [f"{prefix}model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(first, n)]


def write_config_json(out: Path) -> dict[str, Any]:
    """Make config.json say what the model is: Kimi's MoE and rope keys, which transformers 5 does not write."""
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    for key in ("topk_method", "scoring_func", "seq_aux", "moe_layer_freq", "rope_theta", "rope_scaling",
                "num_nextn_predict_layers"):
        cfg[key] = KIMI_K25_TEXT_CONFIG[key]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


def ensure_gate_bias(out: Path, model: Any) -> None:
    """The gates' correction biases are in model.safetensors under the serving names (written if missing)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    keys = _gate_bias_keys(json.loads((out / "config.json").read_text()))
    state = model.state_dict()
    with safe_open(str(path), framework="pt") as f:
        present = set(f.keys())
        metadata = f.metadata()
    missing = [k for k in keys if k not in present]
    if missing:
        tensors = load_file(str(path))
        tensors.update({k: state[k].detach().float().contiguous() for k in missing})
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file(tensors, str(tmp), metadata=metadata or {"format": "pt"})
        os.replace(tmp, path)


def write_tokenizer(tokenizer: Any, out: Path) -> None:
    """The tokenizer in a form transformers 4.57 and 5.x (and the engines) read alike, plus the template file."""
    tokenizer.save_pretrained(out)
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **TOKENIZER_ROLES,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": KIMI_K25_TEXT_CONFIG["max_position_embeddings"],
        "model_input_names": ["input_ids", "attention_mask"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").unlink(missing_ok=True)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def greedy_replies(model: Any, tokenizer: Any, prompts: tuple[str, ...] = PROMPTS,
                   max_new_tokens: int = 48) -> list[dict[str, Any]]:
    """Greedy replies to single-turn chat prompts, stopping at <|im_end|> (ids, text, whether the turn ended)."""
    import torch

    eot = SPECIAL_TOKENS[END_OF_TURN]
    out = []
    for prompt in prompts:
        ids = chat_ids(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        with torch.inference_mode():
            gen = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[eot],
                                 pad_token_id=SPECIAL_TOKENS["[PAD]"])
        reply = [int(t) for t in gen[0, len(ids):]]
        out.append({"prompt": prompt, "prompt_ids": ids, "reply_ids": reply, "ended_turn": eot in reply,
                    "text": tokenizer.decode(reply)})
    return out


def _probe(model: Any, out: Path, input_ids: list[int], k: int = 5) -> tuple[dict[str, Any], float]:
    """The saved folder reloads exactly: transformers' logits from ``out`` against the in-memory model's
    (max |difference|), and the top-k logits per position for later checks on other machines."""
    import torch
    from transformers import AutoModelForCausalLM

    x = torch.tensor([input_ids])
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        a = model(input_ids=x).logits[0]
        b = reloaded(input_ids=x).logits[0]
    top = a.topk(k, dim=-1)
    probe = {"input_ids": input_ids, "top_ids": top.indices.tolist(), "top_logits": top.values.tolist()}
    return probe, float((a - b).abs().max())


def build(out: Path, recipe: Recipe = RECIPE) -> Path:
    """Build the float32 miniature into ``out`` (a new folder): tokenizer, training, saving, build record."""
    import torch
    import transformers
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(recipe.threads, os.cpu_count() or 1)))
    try:
        tokenizer = build_tokenizer()
        trained = train(tokenizer, recipe)
        model = _full_model(trained, recipe.seed)
        model.generation_config = GenerationConfig(
            bos_token_id=SPECIAL_TOKENS["[BOS]"], eos_token_id=SPECIAL_TOKENS[END_OF_TURN],
            pad_token_id=SPECIAL_TOKENS["[PAD]"])
        replies = greedy_replies(model, tokenizer)
        used_threads = torch.get_num_threads()
        model.save_pretrained(out)
        write_config_json(out)
        ensure_gate_bias(out, model)
        write_tokenizer(tokenizer, out)
        probe, reload_diff = _probe(model, out, replies[0]["prompt_ids"] + replies[0]["reply_ids"])
    finally:
        torch.set_num_threads(threads)
    support = set(trained.support)
    record = {
        "name": NAME,
        "what": "Kimi-K2.5's text architecture and values (DeepSeek-V3 MLA + MoE, YaRN, 163,840 ids) at a miniature "
                "size, trained briefly on chitchat; not Kimi's weights or tokenizer",
        "recipe_digest": recipe_digest(),
        "build_version": BUILD_VERSION,
        "kimi_k25_source": KIMI_K25_SOURCE,
        "kept_from_kimi_k25": KIMI_K25_TEXT_CONFIG,
        "shrunk": {k: {"kimi_k25": kimi, "mini": mini} for k, (kimi, mini) in KIMI_K25_SHRUNK.items()},
        "recipe": asdict(recipe),
        "data": {"source": "chitchat-dataset (redraft.catalog.builtin.chitchat_records), never MT-bench",
                 "loss": "every token after the fixed system prompt",
                 "softmax": "over the training data's ids; all other ids have zero lm_head rows (logit 0) whose "
                            "exp(0) mass is in the loss (full-vocabulary cross-entropy)"},
        "training": trained.log,
        "tokenizer": {"text": "SmolLM2-135M-Instruct byte-level BPE (ids 0..49151; its specials renamed)",
                      "special_tokens": SPECIAL_TOKENS, "ids_covered": len(tokenizer)},
        "greedy_replies": [{k: r[k] for k in ("prompt", "text", "ended_turn")}
                           | {"reply_ids_outside_support": sum(i not in support for i in r["reply_ids"])}
                           for r in replies],
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "threads": used_threads, "machine": platform.machine(), "processor": platform.processor()},
        "parameters": sum(p.numel() for p in model.parameters()),
        "probe": probe,
        "reload_max_abs_logit_diff": reload_diff,
        "seconds_total": round(time.perf_counter() - t0, 2),
        "model_safetensors_sha256": _sha256(out / "model.safetensors"),
    }
    (out / "redraft_build.json").write_text(json.dumps(record, indent=2) + "\n")
    logger.info("built %s in %.0f s: loss %.2f -> %.2f", NAME, record["seconds_total"],
                trained.log["loss_first_mean10"], trained.log["loss_last_mean10"])
    return out


def cast_folder(src: Path, out: Path, dtype: str) -> Path:
    """A copy of a built folder with its weights in ``dtype`` (the gates' correction biases stay float32,
    as in Kimi-K2.5's checkpoint)."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=False)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    target = getattr(torch, dtype)
    tensors = {k: (v if k.endswith("e_score_correction_bias") or not v.is_floating_point() else v.to(target))
               for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out
