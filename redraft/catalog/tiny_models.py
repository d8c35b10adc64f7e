"""Tiny random target models saved to local folders, shared by every area's tests.

Each builder writes config.json + safetensors weights + a chat tokenizer (model vocab = len(tokenizer))
and returns the folder. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    GenerationMixin,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from redraft.catalog.tiny_tokenizers import build_chat_tokenizer

WRAPPER_MODEL_TYPE = "redraft_tiny_vlm"


def _vocab(tokenizer, vocab_size: int | None) -> int:
    n = len(tokenizer)
    if vocab_size is None:
        return n
    if vocab_size < n:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n} tokens")
    return vocab_size


def _special_ids(config: PretrainedConfig, tokenizer) -> None:
    """Make the model's bos/eos/pad agree with the tokenizer's (generate falls back to them)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    text = getattr(config, "text_config", None)
    for cfg in (config, text) if text is not None else (config,):
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id, pad


def _save(model: nn.Module, tokenizer, path: str | Path) -> Path:
    _special_ids(model.config, tokenizer)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.bos_token_id = model.config.bos_token_id
        model.generation_config.eos_token_id = model.config.eos_token_id
        model.generation_config.pad_token_id = model.config.pad_token_id
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_llama_config(vocab_size: int, num_layers: int = 6, tie_word_embeddings: bool = False,
                      heads: tuple[int, int] = (4, 2), max_positions: int = 4096) -> LlamaConfig:
    """``heads``: (query, key/value) heads of the 64-wide model; (2, 1) gives head_dim 32, which vLLM CPU's
    attention supports (16 it refuses). ``max_positions``: its context (the long-sample tests' 32K and more)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.1,
    )


def tiny_deepseek_v3_config(vocab_size: int, num_layers: int = 6) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.0,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=4096,
        rope_scaling=None,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )


def make_tiny_llama(
    path: str | Path, vocab_size: int | None = None, num_layers: int = 6, *, tie_word_embeddings: bool = False,
    seed: int = 0, chat: str = "chatml", heads: tuple[int, int] = (4, 2), max_positions: int = 4096,
) -> Path:
    """A 64-wide LlamaForCausalLM (GQA 4/2 heads by default); vocab defaults to len(tokenizer)."""
    tok = build_chat_tokenizer(chat)
    torch.manual_seed(seed)
    cfg = tiny_llama_config(_vocab(tok, vocab_size), num_layers, tie_word_embeddings, heads, max_positions)
    return _save(AutoModelForCausalLM.from_config(cfg), tok, path)


def make_kimi_shaped_standin(path: str | Path, *, hidden_size: int = 7168, num_layers: int = 4, seed: int = 0) -> Path:
    """Kimi-K2.5's hidden size on an otherwise tiny Llama, for memory measurements of the extraction.

    Captured features are Kimi-sized (3 aux layers x 7168 fp32 = 86 KB per token) while the weights stay
    small: one attention head of 16 dims, a 16-wide MLP and the tiny Kimi-style tokenizer's vocab (~40 MB).
    """
    tok = build_chat_tokenizer("kimi_k25")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=_vocab(tok, None), hidden_size=hidden_size, intermediate_size=16,
                      num_hidden_layers=num_layers, num_attention_heads=1, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return _save(AutoModelForCausalLM.from_config(cfg), tok, path)


def make_tiny_deepseek_v3(
    path: str | Path, vocab_size: int | None = None, num_layers: int = 6, *, seed: int = 0, chat: str = "deepseek_v3"
) -> Path:
    """A DeepseekV3ForCausalLM with MLA and MoE (layer 0 dense, the rest 8 routed + 1 shared experts)."""
    tok = build_chat_tokenizer(chat)
    torch.manual_seed(seed)
    cfg = tiny_deepseek_v3_config(_vocab(tok, vocab_size), num_layers)
    return _save(AutoModelForCausalLM.from_config(cfg), tok, path)


class TinyVLMConfig(PretrainedConfig):
    """A Kimi-K2.5-style wrapper config: the decoder's config nested as text_config."""

    model_type = WRAPPER_MODEL_TYPE
    sub_configs = {"text_config": AutoConfig}

    def __init__(self, text_config: dict | PretrainedConfig | None = None, **kwargs) -> None:
        if isinstance(text_config, dict):
            text_config = CONFIG_MAPPING[text_config.get("model_type", "llama")](**text_config)
        self.text_config = text_config if text_config is not None else LlamaConfig()
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class TinyVLMForConditionalGeneration(PreTrainedModel, GenerationMixin):
    """The text model sits under ``language_model`` (weight keys ``language_model.model.*``), as in Kimi-K2.5."""

    config_class = TinyVLMConfig
    base_model_prefix = ""
    _supports_sdpa = True
    _supports_attention_backend = True

    def __init__(self, config: TinyVLMConfig) -> None:
        super().__init__(config)
        self.vision_tower = nn.Linear(8, config.text_config.hidden_size)  # stand-in, never run on text
        self.language_model = AutoModelForCausalLM.from_config(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


AutoConfig.register(WRAPPER_MODEL_TYPE, TinyVLMConfig, exist_ok=True)
AutoModelForCausalLM.register(TinyVLMConfig, TinyVLMForConditionalGeneration, exist_ok=True)


def make_wrapped_model(
    path: str | Path, vocab_size: int | None = None, num_layers: int = 6, *, text: str = "llama", seed: int = 0,
    chat: str = "kimi_k25",
) -> Path:
    """A multimodal-style wrapper around a tiny Llama (or DeepSeek-V3 with text="deepseek_v3").

    The class is registered with AutoModelForCausalLM when this module is imported, so loading the folder
    works in the importing process only.
    """
    tok = build_chat_tokenizer(chat)
    torch.manual_seed(seed)
    v = _vocab(tok, vocab_size)
    if text == "llama":
        text_cfg = tiny_llama_config(v, num_layers)
    elif text == "deepseek_v3":
        text_cfg = tiny_deepseek_v3_config(v, num_layers)
    else:
        raise ValueError(f"unknown wrapped text model {text!r}; expected 'llama' or 'deepseek_v3'")
    cfg = TinyVLMConfig(text_config=text_cfg, architectures=["TinyVLMForConditionalGeneration"])
    return _save(TinyVLMForConditionalGeneration(cfg), tok, path)


def make_served_deepseek_v3(path: str | Path, num_layers: int = 6, *, seed: int = 0,
                            moe_layer_freq: bool = True) -> Path:
    """:func:`make_tiny_deepseek_v3` made explicit for the serving engines, as kimi-k25-mini's build does it:
    the MoE routing keys transformers 5 does not write (``topk_method``, ``scoring_func``, ...; without
    ``moe_layer_freq`` when asked, to test its refusal), random, nonzero gate correction biases in the file
    (so that routing depends on them), and Kimi-K2.5's YaRN rope (SGLang 0.5.23's CPU path builds DeepSeek's rope
    only as ``deepseek_yarn``: "Only deepseek_yarn is supported for CPU for now")."""
    import json

    from redraft.catalog.kimi_mini import architecture as kimi_arch
    from redraft.catalog.kimi_mini import build as kimi_build

    tok = build_chat_tokenizer("deepseek_v3")
    torch.manual_seed(seed)
    cfg = tiny_deepseek_v3_config(_vocab(tok, None), num_layers).to_dict()
    kimi = kimi_arch.KIMI_K25_TEXT_CONFIG  # its YaRN: SGLang's CPU path serves DeepSeek only with deepseek_yarn
    cfg.update(rope_scaling=kimi["rope_scaling"], rope_theta=kimi["rope_theta"],
               max_position_embeddings=kimi["max_position_embeddings"])
    cfg.pop("rope_parameters", None)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**cfg))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.rand_like(tensor) * 0.2)
    path = _save(model, tok, path)
    cfg = json.loads((path / "config.json").read_text())
    for key in ("topk_method", "scoring_func", "seq_aux", "moe_layer_freq", "num_nextn_predict_layers", "rope_theta",
                "rope_scaling"):
        if key != "moe_layer_freq" or moe_layer_freq:
            cfg[key] = kimi_arch.KIMI_K25_TEXT_CONFIG[key]
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    kimi_build.ensure_gate_bias(path, model)
    return path
