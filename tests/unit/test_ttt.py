"""TTT loss: batched unroll vs a literal per-position reference, masks, normalisation, teachers."""

from __future__ import annotations

import math

import pytest
import torch
from helpers_drafter import tiny_drafter

from redraft.core.teacher_targets import TeacherTargets, teacher_from_last_hidden, teacher_from_topk
from train.ttt import soft_cross_entropy, ttt_forward

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- naive reference
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x [heads, hd] rotated to integer position pos (rotate-half)."""
    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = (pos * inv).to(torch.float32)
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1)
    return x * cos + rot * sin


class Naive:
    """One token, one step at a time, with explicit key/value lists (no batching, no masks)."""

    def __init__(self, d):
        self.d, self.c = d, d.config
        self.sd = {k: v.detach().float() for k, v in d.state_dict().items()}

    def qkv(self, tok, h, pos):
        sd, c = self.sd, self.c
        e = sd["embed_tokens.weight"][tok]
        x = torch.cat([_rms(e, sd["midlayer.input_layernorm.weight"], c.rms_norm_eps),
                       _rms(h, sd["midlayer.hidden_norm.weight"], c.rms_norm_eps)])
        q = (sd["midlayer.self_attn.q_proj.weight"] @ x).view(c.num_attention_heads, c.head_dim)
        k = (sd["midlayer.self_attn.k_proj.weight"] @ x).view(c.num_key_value_heads, c.head_dim)
        v = (sd["midlayer.self_attn.v_proj.weight"] @ x).view(c.num_key_value_heads, c.head_dim)
        return _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta), v

    def finish(self, h, q, keys, values):
        sd, c = self.sd, self.c
        g = c.num_attention_heads // c.num_key_value_heads
        heads = []
        for hh in range(c.num_attention_heads):
            kv = hh // g
            s = torch.stack([q[hh] @ k[kv] for k in keys]) / math.sqrt(c.head_dim)
            p = torch.softmax(s, 0)
            heads.append(sum(p[i] * values[i][kv] for i in range(len(keys))))
        h1 = h + sd["midlayer.self_attn.o_proj.weight"] @ torch.cat(heads)
        y = _rms(h1, sd["midlayer.post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = torch.nn.functional.silu(sd["midlayer.mlp.gate_proj.weight"] @ y)
        h2 = h1 + sd["midlayer.mlp.down_proj.weight"] @ (gate * (sd["midlayer.mlp.up_proj.weight"] @ y))
        logits = sd["lm_head.weight"] @ _rms(h2, sd["norm.weight"], c.rms_norm_eps)
        return h2, logits

    def unroll(self, ids, aux, real, pos, steps):
        """logits[k][t] for one sample: literally chain position t for k steps."""
        sd = self.sd
        n = len(ids)

        def tok(i):
            return int(ids[i]) if i < n and real[i] else 0

        fc = [sd["fc.weight"] @ aux[s] for s in range(n)]
        k0, v0 = [], []
        for s in range(n):
            _, k, v = self.qkv(tok(s + 1), fc[s], int(pos[s]))
            k0.append(k)
            v0.append(v)
        out = [[None] * n for _ in range(steps)]
        for t in range(n):
            ctx = [s for s in range(t + 1) if real[s]]
            h = fc[t]
            dk, dv = [], []
            for k in range(steps):
                q, kk, vv = self.qkv(tok(t + 1 + k), h, int(pos[t]) + k)
                if k > 0:
                    dk.append(kk)
                    dv.append(vv)
                h, logits = self.finish(h, q, [k0[s] for s in ctx] + dk, [v0[s] for s in ctx] + dv)
                out[k][t] = logits
        return [torch.stack(o) for o in out]


def naive_metrics(d, logits, loss_mask, real, teacher, steps, decay):
    """Per-step loss / counts / correct / accept with the documented masks, one position at a time."""
    t2d, d2t = d.t2d, d.d2t
    bsz, seq = loss_mask.shape
    res = {"loss": [], "n": [], "correct": [], "n_acc": [], "accept": []}
    for k in range(steps):
        tot, n, corr, n_acc, acc_sum = 0.0, 0, 0, 0, 0.0
        for b in range(bsz):
            for t in range(seq):
                j = t + 2 + k
                if j >= seq or not (loss_mask[b, j] and real[b, j]):
                    continue
                r = t + 1 + k
                lg = logits[b][k][t]
                n_acc += 1
                am = int(lg.argmax())
                corr += int(am + int(d2t[am]) == int(teacher.target_ids[b, r]))
                if not t2d[teacher.target_ids[b, r]]:
                    continue
                n += 1
                tot += float(-(teacher.target_p[b, r] * torch.log_softmax(lg, -1)).sum())
                acc_sum += float(torch.minimum(teacher.p_on_draft[b, r], torch.softmax(lg, -1)).sum())
        res["loss"].append(tot / max(n, 1))
        res["n"].append(n)
        res["correct"].append(corr)
        res["n_acc"].append(n_acc)
        res["accept"].append(acc_sum)
    res["total"] = sum(decay**k * v for k, v in enumerate(res["loss"]))
    return res


def full_teacher(full_logits, t2d):
    """Teacher from explicit full-vocab logits [B, T, V], written out directly."""
    return TeacherTargets(
        target_p=torch.softmax(full_logits[..., t2d], -1),
        target_ids=full_logits.argmax(-1),
        p_on_draft=torch.softmax(full_logits, -1)[..., t2d],
    )


def make_batch(d, seq=24, lengths=(24, 17), seed=0):
    g = torch.Generator().manual_seed(seed)
    c = d.config
    bsz = len(lengths)
    ids = torch.randint(0, c.vocab_size, (bsz, seq), generator=g)
    aux = torch.randn(bsz, seq, 3 * c.target_hidden_size, generator=g)
    real = torch.zeros(bsz, seq, dtype=torch.long)
    for b, n in enumerate(lengths):
        real[b, :n] = 1
        ids[b, n:] = 7  # a non-zero pad id: the unroll must replace it by 0
        aux[b, n:] = 0
    loss_mask = (torch.rand(bsz, seq, generator=g) < 0.7).long() * real
    full = torch.randn(bsz, seq, c.vocab_size, generator=g) * 3
    # push a few teacher argmaxes outside the draft vocab
    outside = torch.nonzero(~d.t2d).squeeze(-1)
    for b in range(bsz):
        for t in range(0, seq, 5):
            full[b, t, outside[t % len(outside)]] = 50.0
    return ids, aux, real, loss_mask, full


@pytest.mark.parametrize(
    ("heads", "kv", "steps", "pos_offset"),
    [(4, 4, 3, 0), (4, 2, 7, 0), (4, 1, 5, 3)],
)
def test_matches_naive_unroll(heads, kv, steps, pos_offset):
    d = tiny_drafter(seed=1, num_attention_heads=heads, num_key_value_heads=kv)
    ids, aux, real, loss_mask, full = make_batch(d)
    seq = ids.shape[1]
    position_ids = (torch.arange(seq) + pos_offset).expand(2, seq)
    naive = Naive(d)
    ref_logits = [naive.unroll(ids[b], aux[b], real[b], position_ids[b], steps) for b in range(2)]
    # make some teacher argmaxes equal the drafter's mapped step-0 prediction, so accuracy is not trivially 0
    for b in range(2):
        for t in range(1, seq, 2):
            am = int(ref_logits[b][0][t - 1].argmax())
            full[b, t, am + int(d.d2t[am])] = 80.0
    teacher = full_teacher(full, d.t2d)
    out = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=loss_mask,
                      teacher=teacher, steps=steps, position_ids=position_ids if pos_offset else None,
                      return_logits=True)
    assert len(out.logits) == steps
    for k in range(steps):
        ref = torch.stack([ref_logits[b][k] for b in range(2)])
        torch.testing.assert_close(out.logits[k], ref, atol=1e-5, rtol=1e-5, msg=f"step {k} logits")
    ref = naive_metrics(d, ref_logits, loss_mask, real, teacher, steps, 0.8)
    assert out.step_counts.tolist() == ref["n"]
    assert out.step_acc_counts.tolist() == ref["n_acc"]
    assert out.step_correct.tolist() == ref["correct"]
    assert sum(ref["correct"]) > 0 and min(ref["n"]) > 0
    torch.testing.assert_close(out.step_loss, torch.tensor(ref["loss"]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_accept_sum, torch.tensor(ref["accept"]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, torch.tensor(ref["total"]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.step_acc, torch.tensor(ref["correct"]) / torch.tensor(ref["n_acc"]))


def test_gradients_reach_trainable_params_only():
    d = tiny_drafter(seed=2)
    ids, aux, real, loss_mask, full = make_batch(d, seq=12, lengths=(12, 9))
    out = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=loss_mask,
                      teacher=full_teacher(full, d.t2d), steps=3)
    out.loss.backward()
    assert d.embed_tokens.weight.grad is None
    assert not d.embed_tokens.weight.requires_grad
    for name, p in d.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_matches_autograd(dtype):
    """The production loss (ttt_forward's soft_cross_entropy): values, gradient, softmax and argmax
    against plain autograd, for fp32 logits (q saved) and bf16 logits (q recomputed in the backward)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 11, generator=g).to(dtype)
    p = torch.softmax(torch.randn(3, 5, 11, generator=g), -1)
    p[0, 0] = 0  # a row without teacher mass
    p[1, 2] *= 0.5  # a row with partial mass (the teacher's mass outside the draft vocab)
    w = torch.randn(3, 5, generator=g)
    a = logits.clone().requires_grad_(True)
    ce, q, pred = soft_cross_entropy(a, p)
    (ce * w).sum().backward()
    b = logits.float().clone().requires_grad_(True)
    ref = -(p * torch.log_softmax(b, -1)).sum(-1)
    (ref * w).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ce, ref.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(a.grad.float(), b.grad, atol=tol, rtol=tol)
    assert a.grad.dtype == dtype
    torch.testing.assert_close(q, torch.softmax(logits.float(), -1), atol=1e-6, rtol=1e-6)
    assert torch.equal(pred, logits.float().argmax(-1))


def _hand_case():
    """B=1, T=8: loss_mask on tokens 3..7; teacher row 4 has its argmax outside the draft vocab."""
    d = tiny_drafter(seed=4)
    torch.manual_seed(5)
    seq = 8
    ids = torch.randint(0, d.config.vocab_size, (1, seq))
    aux = torch.randn(1, seq, 3 * d.config.target_hidden_size)
    real = torch.ones(1, seq, dtype=torch.long)
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    return d, ids, aux, real, loss_mask


def test_mask_rules_on_hand_made_case():
    d, ids, aux, real, loss_mask = _hand_case()
    steps = 2
    probe = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=loss_mask,
                        teacher=full_teacher(torch.randn(1, 8, d.config.vocab_size), d.t2d), steps=steps,
                        return_logits=True)
    # teacher: every row's argmax = the drafter's own mapped step-0 prediction at t = row - 1 (hits at step 0) ...
    full = torch.randn(1, 8, d.config.vocab_size)
    for r in range(1, 8):
        am = int(probe.logits[0][0, r - 1].argmax())
        full[0, r, am + int(d.d2t[am])] = 60.0
    # ... except row 4, whose argmax is a token outside the draft vocab
    outside = int(torch.nonzero(~d.t2d)[0])
    full[0, 4, outside] = 90.0
    teacher = full_teacher(full, d.t2d)
    out = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=loss_mask,
                      teacher=teacher, steps=steps, return_logits=True)
    # step 0: position t counts iff loss_mask[t+2]: t in {1..5}; teacher row t+1 -> row 4 at t=3 is excluded
    # step 1: loss_mask[t+3]: t in {0..4}; teacher row t+2 -> row 4 at t=2 is excluded
    assert out.step_acc_counts.tolist() == [5, 5]
    assert out.step_counts.tolist() == [4, 4]
    assert out.step_correct[0].item() == 4  # every step-0 hit except the out-of-vocab row (a miss)
    lg0 = out.logits[0][0]
    rows0 = [1, 2, 4, 5]
    expect0 = sum(float(-(teacher.target_p[0, t + 1] * torch.log_softmax(lg0[t], -1)).sum()) for t in rows0) / 4
    assert out.step_loss[0].item() == pytest.approx(expect0, rel=1e-5)
    lg1 = out.logits[1][0]
    rows1 = [0, 1, 3, 4]
    expect1 = sum(float(-(teacher.target_p[0, t + 2] * torch.log_softmax(lg1[t], -1)).sum()) for t in rows1) / 4
    assert out.step_loss[1].item() == pytest.approx(expect1, rel=1e-5)
    assert out.loss.item() == pytest.approx(expect0 + 0.8 * expect1, rel=1e-5)
    # the excluded row's teacher distribution does not matter; a row only used by uncounted positions neither
    other = TeacherTargets(teacher.target_p.clone(), teacher.target_ids, teacher.p_on_draft)
    other.target_p[0, 4] = torch.softmax(torch.randn(d.config.draft_vocab_size), -1)
    other.target_p[0, 1] = torch.softmax(torch.randn(d.config.draft_vocab_size), -1)  # row 1: t=0 at step 0 (no)
    again = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=loss_mask,
                        teacher=other, steps=steps)
    torch.testing.assert_close(again.loss, out.loss)


def test_loss_normalised_by_counted_positions_not_batch_size():
    d, ids, aux, real, loss_mask = _hand_case()
    full = torch.randn(1, 8, d.config.vocab_size)
    base = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=loss_mask,
                       teacher=full_teacher(full, d.t2d), steps=3)
    # add right padding and a second sample without any assistant token: nothing may change
    pad = 5
    ids2 = torch.cat([torch.cat([ids, torch.zeros(1, pad, dtype=ids.dtype)], 1),
                      torch.randint(0, 64, (1, 8 + pad))])
    aux2 = torch.cat([torch.cat([aux, torch.zeros(1, pad, aux.shape[-1])], 1), torch.randn(1, 8 + pad, aux.shape[-1])])
    real2 = torch.cat([torch.cat([real, torch.zeros(1, pad, dtype=real.dtype)], 1), torch.ones(1, 8 + pad).long()])
    lm2 = torch.cat([torch.cat([loss_mask, torch.zeros(1, pad, dtype=loss_mask.dtype)], 1),
                     torch.zeros(1, 8 + pad, dtype=loss_mask.dtype)])
    full2 = torch.cat([torch.cat([full, torch.randn(1, pad, 64)], 1), torch.randn(1, 8 + pad, 64)])
    more = ttt_forward(d, input_ids=ids2, aux_hidden=aux2, attention_mask=real2, loss_mask=lm2,
                       teacher=full_teacher(full2, d.t2d), steps=3)
    torch.testing.assert_close(more.step_loss, base.step_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(more.loss, base.loss, atol=1e-6, rtol=1e-6)
    assert more.step_counts.tolist() == base.step_counts.tolist()


def test_no_counted_positions_gives_zero_loss_with_graph():
    d, ids, aux, real, _ = _hand_case()
    out = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=torch.zeros_like(real),
                      teacher=full_teacher(torch.randn(1, 8, 64), d.t2d), steps=2)
    assert out.loss.item() == 0.0 and out.step_counts.sum() == 0 and out.step_acc.sum() == 0
    out.loss.backward()  # must not fail: a rank with an all-prompt batch still joins the backward


def test_teacher_topk_full_vocab_equals_last_hidden():
    d = tiny_drafter(seed=6)
    vocab = d.config.vocab_size
    g = torch.Generator().manual_seed(7)
    last = torch.randn(2, 9, 16, generator=g)
    head = torch.randn(vocab, 16, generator=g)
    logprobs = torch.log_softmax(last @ head.T, -1)
    top_lp, top_ids = logprobs.topk(vocab, dim=-1)
    a = teacher_from_topk(top_ids.to(torch.int32), top_lp, d.t2d, d.d2t)
    b = teacher_from_last_hidden(last, head, d.t2d, chunk_tokens=4)
    c = full_teacher(last @ head.T, d.t2d)
    for x in (a, b):
        torch.testing.assert_close(x.target_p, c.target_p, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(x.p_on_draft, c.p_on_draft, atol=1e-6, rtol=1e-5)
        assert torch.equal(x.target_ids, c.target_ids)
        assert x.target_ids.dtype == torch.int64


def test_teacher_last_hidden_chunked_equals_unchunked():
    d = tiny_drafter(seed=8)
    g = torch.Generator().manual_seed(9)
    last = torch.randn(3, 7, 16, generator=g)
    head = torch.randn(d.config.vocab_size, 16, generator=g)
    one = teacher_from_last_hidden(last, head, d.t2d, chunk_tokens=10_000)
    for chunk in (1, 5, 20):
        many = teacher_from_last_hidden(last, head, d.t2d, chunk_tokens=chunk)
        assert torch.equal(many.target_ids, one.target_ids)
        # fp32 matmuls over other row counts may take other BLAS kernels (another summation order):
        # equal up to a few fp32 ulps, which exp() carries into the probabilities
        torch.testing.assert_close(many.target_p, one.target_p, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(many.p_on_draft, one.p_on_draft, atol=1e-6, rtol=1e-5)


def test_teacher_topk_truncated_hand_made():
    # vocab 6, draft vocab = target ids {1, 3, 4}
    t2d = torch.tensor([False, True, False, True, True, False])
    d2t = torch.tensor([1, 2, 2])
    ids = torch.tensor([[[3, 0, 4]], [[0, 2, 5]]])  # row 1: no draft token in the top-k
    lps = torch.log(torch.tensor([[[0.5, 0.3, 0.1]], [[0.6, 0.2, 0.1]]]))
    te = teacher_from_topk(ids, lps, t2d, d2t)
    torch.testing.assert_close(te.p_on_draft[0, 0], torch.tensor([0.0, 0.5, 0.1]))
    torch.testing.assert_close(te.target_p[0, 0], torch.tensor([0.0, 0.5 / 0.6, 0.1 / 0.6]))
    assert te.target_p[1, 0].sum() == 0 and te.p_on_draft[1, 0].sum() == 0
    assert te.target_ids.tolist() == [[3], [0]]


def test_bf16_unroll_runs_and_is_close_to_fp32():
    d = tiny_drafter(seed=10)
    ids, aux, real, loss_mask, full = make_batch(d, seq=10, lengths=(10, 6))
    teacher = full_teacher(full, d.t2d)
    ref = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=loss_mask,
                      teacher=teacher, steps=3)
    d16 = d.to(torch.bfloat16)
    assert d16.d2t.dtype == torch.int64 and d16.t2d.dtype == torch.bool
    out = ttt_forward(d16, input_ids=ids, aux_hidden=aux.bfloat16(), attention_mask=real, loss_mask=loss_mask,
                      teacher=teacher, steps=3)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    torch.testing.assert_close(out.step_loss, ref.step_loss, atol=0.1, rtol=0.05)


def test_bad_shapes_are_named():
    d, ids, aux, real, loss_mask = _hand_case()
    teacher = full_teacher(torch.randn(1, 7, 64), d.t2d)
    with pytest.raises(ValueError, match="teacher.target_p"):
        ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=loss_mask, teacher=teacher)


def test_sdpa_attention_matches_eager():
    d = tiny_drafter(seed=11)
    ids, aux, real, loss_mask, full = make_batch(d, seq=16, lengths=(16, 11, 0))
    teacher = full_teacher(full, d.t2d)
    kw = dict(input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=loss_mask, teacher=teacher, steps=4,
              return_logits=True)
    eager = ttt_forward(d, **kw)
    eager.loss.backward()
    grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.requires_grad}
    d.zero_grad()
    d.attention_impl = "sdpa"
    sdpa = ttt_forward(d, **kw)
    sdpa.loss.backward()
    keep = real.bool()
    for a, b in zip(eager.logits, sdpa.logits, strict=True):
        torch.testing.assert_close(b[keep], a[keep], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(b).all()
    torch.testing.assert_close(sdpa.loss, eager.loss, atol=1e-6, rtol=1e-6)
    for n, p in d.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-4, msg=n)
