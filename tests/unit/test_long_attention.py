"""Training memory linear in the sequence length T (issue 45): no tensor of a training step grows as T².

Every op's output of a whole step (the TTT unroll, the loss, the backward) is watched below autograd with a
TorchDispatchMode, at T and at 4T. With the kernels' per-block budgets made small (so that a block is a few rows at
these tiny shapes, as it is at Kimi length with the real budgets), the largest tensor may grow 4x, not 16x: a [T, T]
mask, score matrix or kept probabilities anywhere in a path fails it. Each attention path that trains on a CPU
(eager, sdpa) and each drafter kind (EAGLE-3 GQA and MLA, P-EAGLE, DFlash) is stepped.
"""

from __future__ import annotations

import pytest
import torch
from helpers_drafter import TINY_MLA, tiny_drafter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import redraft.core.drafter.dflash as dflash
import redraft.core.drafter.ttt_attention as ttt_attention
from redraft.core.teacher_targets import TeacherTargets
from train.ttt import ttt_forward

torch.set_num_threads(1)

KINDS = {
    "eagle3-gqa": {},
    "eagle3-mla": TINY_MLA,
    "p-eagle": dict(method="p-eagle", mask_token_id=7),
    "dflash": dict(method="dflash", mask_token_id=7, num_layers=1, block_size=4, target_hidden_size=32),
}


class LargestTensor(TorchDispatchMode):
    """Records, per op, the largest element count of a tensor it returns while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.numel: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel[str(func)] = max(self.numel.get(str(func), 0), t.numel())
        return out


def _step_largest(kind: str, impl: str, seq: int) -> dict[str, int]:
    d = tiny_drafter(seed=3, max_position_embeddings=4 * seq, **KINDS[kind])
    d.attention_impl = impl
    c = d.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (2, seq), generator=g)
    aux = torch.randn(2, seq, 3 * c.target_hidden_size, generator=g)
    real = torch.ones(2, seq, dtype=torch.long)
    real[1, seq * 3 // 4:] = 0  # right padding, as every batch is built
    loss_mask = real.clone()
    target_ids = torch.randint(0, c.vocab_size, (2, seq), generator=g)
    p = torch.softmax(torch.randn(2, seq, c.draft_vocab_size, generator=g), -1)
    teacher = TeacherTargets(target_p=p, target_ids=target_ids, p_on_draft=p)
    with LargestTensor() as mode:
        out = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=loss_mask,
                          teacher=teacher, steps=3)
        out.loss.backward()
    return mode.numel


@pytest.mark.parametrize("kind,impl", [("eagle3-gqa", "eager"), ("eagle3-gqa", "sdpa"), ("eagle3-mla", "eager"),
                                       ("eagle3-mla", "sdpa"), ("p-eagle", "eager"), ("dflash", "eager")])
def test_no_tensor_of_a_training_step_grows_as_t_squared(kind, impl, monkeypatch):
    monkeypatch.setattr(ttt_attention, "EAGER_BLOCK_ELEMENTS", 1)  # blocks of MIN_BLOCK_ROWS query rows
    monkeypatch.setattr(ttt_attention, "MIN_BLOCK_ROWS", 16)
    monkeypatch.setattr(dflash, "BLOCK_SCORE_BYTES", 1)  # one drafting row per chunk
    short, long = _step_largest(kind, impl, 128), _step_largest(kind, impl, 512)
    # per op (a fixed-size buffer, e.g. the loss head's chunk, hides nothing); vectors of a few T are noise
    grown = {op: (short.get(op, 0), n) for op, n in long.items() if n > 4 * 512 and n > 4.5 * short.get(op, 0)}
    assert not grown, f"{kind}/{impl}: ops whose largest output grows faster than T from T=128 to 512: {grown}"


def test_sdpa_in_bf16_is_as_close_to_the_reference_as_eager():
    """The sdpa path joins the diagonal keys through one extra key whose score (a logsumexp) rides in q's dtype:
    in bf16 it stays as close to the fp64 reference as the eager kernel does in bf16 (within 2x of its error)."""
    torch.manual_seed(4)
    bsz, nkv, groups, seq, hd = 2, 2, 2, 96, 16
    mask = torch.ones(bsz, seq, dtype=torch.long)
    mask[1, 70:] = 0
    q = torch.randn(bsz, nkv, groups, seq, hd, dtype=torch.float64) * 3  # sharp scores, a large logsumexp
    ks = [torch.randn(bsz, nkv, seq, hd, dtype=torch.float64) for _ in range(4)]
    vs = [torch.randn(bsz, nkv, seq, hd, dtype=torch.float64) for _ in range(4)]
    real = mask.bool()[:, None, None, :, None]

    def run(fn, dtype):
        cache = ttt_attention.TTTCache(keys=[k.to(dtype) for k in ks], values=[v.to(dtype) for v in vs])
        return (fn(q.to(dtype), cache, mask) * real).double()

    want = run(ttt_attention._eager_attention, torch.float64)
    eager = (run(ttt_attention._eager_attention, torch.bfloat16) - want).abs().max()
    sdpa = (run(ttt_attention._sdpa_attention, torch.bfloat16) - want).abs().max()
    assert sdpa <= 2 * eager, (float(sdpa), float(eager))


def _batch(d, seq: int):
    c = d.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (2, seq), generator=g)
    aux = torch.randn(2, seq, 3 * c.target_hidden_size, generator=g)
    real = torch.ones(2, seq, dtype=torch.long)
    real[1, seq * 3 // 4:] = 0
    p = torch.softmax(torch.randn(2, seq, c.draft_vocab_size, generator=g), -1)
    teacher = TeacherTargets(target_p=p, target_ids=torch.randint(0, c.vocab_size, (2, seq), generator=g),
                             p_on_draft=p)
    return dict(input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=real.clone(), teacher=teacher, steps=3)


@pytest.mark.parametrize("kind,impl", [("eagle3-gqa", "eager"), ("eagle3-gqa", "sdpa"), ("eagle3-mla", "eager"),
                                       ("p-eagle", "sdpa")])
def test_activation_checkpointing_per_ttt_step_changes_no_gradient_and_keeps_less(kind, impl):
    """``activation_checkpointing``: each TTT step recomputed in the backward gives the same loss (bit for bit: the
    same ops on the same inputs) and the same gradients to fp32 rounding (the backward adds the steps' contributions
    in another order), and keeps less for the backward."""
    results = []
    for recompute in (False, True):
        d = tiny_drafter(seed=5, **KINDS[kind])
        d.attention_impl = impl
        kept: list[int] = []

        def pack(t: torch.Tensor, kept: list[int] = kept) -> torch.Tensor:
            kept.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = ttt_forward(d, **_batch(d, 64), recompute=recompute)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in d.named_parameters() if p.grad is not None},
                        sum(kept)))
    (loss, grads, kept_all), (loss_r, grads_r, kept_r) = results
    assert torch.equal(loss, loss_r)
    assert grads.keys() == grads_r.keys() and len(grads) > 5
    for name, g in grads.items():
        torch.testing.assert_close(grads_r[name], g, atol=1e-6, rtol=1e-5, msg=name)
    assert kept_r < 0.6 * kept_all, (kept_r, kept_all)


def test_sdpa_refuses_a_mask_with_a_hole():
    """sdpa reads key padding as right padding (no mask tensor); a real token after a padded one is refused by
    name rather than attended wrongly."""
    q = torch.randn(1, 1, 1, 4, 8)
    cache = ttt_attention.TTTCache(keys=[torch.randn(1, 1, 4, 8)], values=[torch.randn(1, 1, 4, 8)])
    with pytest.raises(ValueError, match="right padding"):
        ttt_attention._sdpa_attention(q, cache, torch.tensor([[1, 0, 1, 1]]))
    assert ttt_attention._sdpa_attention(q, cache, torch.tensor([[1, 1, 0, 0]])).shape == (1, 1, 1, 4, 8)
