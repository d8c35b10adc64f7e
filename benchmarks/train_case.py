"""One drafter training step's case, shared by the training benchmarks: the shapes, their FLOPs, the machine's
matmul peak, a drafter and a batch of random inputs at a shape, and the step train/main.py runs per micro-batch.

Below ``train_throughput.py`` (the benchmark) and ``train_sidebyside.py`` (its side-by-side worker), which both
import it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Shape:
    """One drafter + micro-batch shape (hidden sizes follow the SmolLM2-135M demo target)."""

    name: str
    intermediate: int
    draft_vocab: int
    batch: int  # samples per micro-batch
    seq: int  # tokens per sample (no padding: every token is real)
    hidden: int = 576
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    target_hidden: int = 576
    vocab: int = 16384  # target vocab (only the frozen embedding and t2d see it)
    ttt_steps: int = 7
    topk: int = 64

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


SHAPES = {
    "demo": Shape("demo", intermediate=768, draft_vocab=4096, batch=2, seq=512),  # configs/demo/train.yaml
    "large": Shape("large", intermediate=1536, draft_vocab=8000, batch=2, seq=1024),  # old demo: 2048 tok/batch
    # a drafter for Llama-3.2-1B (its hidden size, heads, MLP width and vocab) with a 32k draft vocab
    "1b": Shape("1b", intermediate=8192, draft_vocab=32000, batch=1, seq=2048, hidden=2048, heads=32, kv_heads=8,
                head_dim=64, target_hidden=2048, vocab=128256),
}


# ----------------------------------------------------------------------------- FLOPs


def flops_per_token(s: Shape) -> dict[str, float]:
    """Matmul FLOPs per token of one training step (forward + backward), by component."""
    h, hd, nh, nkv = s.hidden, s.head_dim, s.heads, s.kv_heads
    fwd = {
        "fc": 2 * 3 * s.target_hidden * h,
        "qkv": s.ttt_steps * 2 * 2 * h * (nh + 2 * nkv) * hd,
        "o": s.ttt_steps * 2 * nh * hd * h,
        "mlp": s.ttt_steps * 3 * 2 * h * s.intermediate,
        "lm_head": s.ttt_steps * 2 * h * s.draft_vocab,
        "attention": sum(4 * nh * hd * ((s.seq + 1) / 2 + k) for k in range(s.ttt_steps)),
    }
    total = {k: (2 if k == "fc" else 3) * v for k, v in fwd.items()}
    return {"forward": float(sum(fwd.values())), "total": float(sum(total.values())),
            **{f"total_{k}": float(v) for k, v in total.items()}}


# ----------------------------------------------------------------------------- peak


def matmul_peak(threads: int, n: int = 2048, repeats: int = 3) -> float:
    """Best fp32 FLOP/s of an n x n matmul at ``threads`` threads (restores the thread count).

    2048 is where this machine's BLAS gets closest to its best (1536 and below read 10-40% lower).
    """
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------- in-process step


def drafter_config(s: Shape):
    from redraft.core.drafter.config import DrafterConfig

    return DrafterConfig(
        hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
        intermediate_size=s.intermediate, vocab_size=s.vocab, draft_vocab_size=s.draft_vocab,
        target_hidden_size=s.target_hidden, aux_layer_ids=[1, 14, 26], target_num_layers=30,
        max_position_embeddings=8192, torch_dtype="float32",
    )


def _drafter_and_batch(s: Shape, seed: int = 0):
    from redraft.core.dataset.batch import Batch
    from redraft.core.drafter.modeling import Eagle3Drafter
    from redraft.core.drafter.vocab import build_vocab_mapping, draft_token_ids
    from train.ttt import TTTModel

    torch.manual_seed(seed)
    cfg = drafter_config(s)
    drafter = Eagle3Drafter(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        drafter.embed_tokens.weight.normal_(0, 0.02, generator=g)
    counts = torch.randint(0, 10_000, (s.vocab,), generator=g)
    drafter.set_vocab_mapping(*build_vocab_mapping(counts, s.draft_vocab))
    model = TTTModel(drafter, steps=s.ttt_steps, decay=0.8)
    draft_ids = draft_token_ids(drafter.d2t)
    b, t, k = s.batch, s.seq, s.topk
    in_draft = draft_ids[torch.randint(0, s.draft_vocab, (b, t, k), generator=g)]
    anywhere = torch.randint(0, s.vocab, (b, t, k), generator=g)
    topk_ids = torch.where(torch.rand(b, t, k, generator=g) < 0.9, in_draft, anywhere)
    topk_lp = torch.log_softmax(2 * torch.randn(b, t, k, generator=g), -1).sort(-1, descending=True).values
    loss_mask = torch.ones(b, t, dtype=torch.int64)
    loss_mask[:, : t // 10] = 0  # a prompt
    batch = Batch(
        input_ids=torch.randint(0, s.vocab, (b, t), generator=g),
        attention_mask=torch.ones(b, t, dtype=torch.int64),
        loss_mask=loss_mask,
        aux_hidden=torch.randn(b, t, 3 * s.target_hidden, generator=g),
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
        last_hidden=None,
        sample_ids=[f"s{i}" for i in range(b)],
    )
    return model, batch


def _train_step(model, optimizer, batch) -> Any:
    """What train/main.py does per micro-batch with grad_accum 1 in one plain process."""
    out = model(batch)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out
