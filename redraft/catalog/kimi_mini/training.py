"""kimi-k25-mini's training: the recipe (what the build digest covers) and the short deterministic run."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from redraft.catalog.kimi_mini.architecture import BUILD_VERSION, NAME, text_config
from redraft.catalog.kimi_mini.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, TOKENIZER_ROLES, chat_ids
from redraft.catalog.packaged import chitchat_records

logger = logging.getLogger(__name__)


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
