"""The chunked lm_head + loss of train.head_loss against plain autograd over full logits.

The reference below is written from the documented rules (train/ttt.py): logits = lm_head(norm(h))
at every position through autograd, soft-CE against the renormalised teacher, position t counted
at step k iff token t+2+k is a real assistant token and in the loss iff teacher row t+1+k's
argmax is a draft token, loss_k divided by its loss positions, total = sum_k decay^k loss_k.
"""

from __future__ import annotations

import pytest
import torch
from helpers_drafter import tiny_drafter

from redraft.core.alignment import shift_left
from redraft.core.drafter.ttt_attention import TTTCache
from redraft.core.teacher_targets import TeacherTargets
from train.ttt import ttt_forward

torch.set_num_threads(1)

STEPS = 4
DECAY = 0.8
HIDDEN = 128  # train.head_loss gathers a window's counted rows when more than 64 / H = half of them do not count


def make_case(seed: int = 0, vocab: int = 96, draft: int = 40, lengths=(20, 13), turns: bool = False):
    """A batch; ``turns``: the loss mask in runs (a 2-token prompt, answer, one more prompt token at 9, answer)
    instead of scattered."""
    d = tiny_drafter(seed=seed, vocab_size=vocab, draft_vocab_size=draft, hidden_size=HIDDEN)
    g = torch.Generator().manual_seed(seed + 100)
    bsz, seq = len(lengths), max(lengths)
    ids = torch.randint(0, vocab, (bsz, seq), generator=g)
    aux = torch.randn(bsz, seq, 3 * d.config.target_hidden_size, generator=g)
    real = torch.zeros(bsz, seq, dtype=torch.long)
    for b, n in enumerate(lengths):
        real[b, :n] = 1
    loss_mask = (torch.rand(bsz, seq, generator=g) < 0.6).long() * real
    if turns:
        loss_mask = real.clone()
        loss_mask[:, :2] = 0
        loss_mask[:, 9] = 0
    full = torch.randn(bsz, seq, vocab, generator=g) * 3
    # the teacher's argmax is the drafter's own step-0 prediction (so every row, counted or not, is a hit
    # at step 0: a metric that counts a row it should not shows), except some outside the draft vocab
    # (counted, not in the loss)
    uniform = TeacherTargets(torch.full((bsz, seq, draft), 1.0 / draft), torch.zeros(bsz, seq, dtype=torch.long))
    with torch.no_grad():
        probe = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=real, teacher=uniform,
                            steps=1, return_logits=True)
    pred = probe.logits[0].argmax(-1)
    full[:, 1:].scatter_(-1, d.draft_to_target(pred[:, :-1])[..., None], 30.0)
    outside = torch.nonzero(~d.t2d).squeeze(-1)
    full[:, 2::4, outside[0]] = 40.0
    teacher = TeacherTargets(target_p=torch.softmax(full[..., d.t2d], -1), target_ids=full.argmax(-1),
                             p_on_draft=torch.softmax(full, -1)[..., d.t2d])
    return d, dict(input_ids=ids, aux_hidden=aux, attention_mask=real, loss_mask=loss_mask, teacher=teacher)


def plain_autograd_loss(d, input_ids, aux_hidden, attention_mask, loss_mask, teacher, steps, decay):
    """(total, step losses, step correct, step accept sums): full [B, T, Vd] logits through autograd."""
    real = attention_mask.bool()
    ids = input_ids.masked_fill(~real, 0)
    bsz, seq = ids.shape
    pos = torch.arange(seq).expand(bsz, seq)
    cache = TTTCache()
    h = d.project(aux_hidden)
    total = torch.zeros(())
    losses, corrects, accepts = [], [], []
    for k in range(steps):
        h = d(shift_left(ids, 1 + k), h, pos + k, cache, attention_mask)
        x = d.compute_logits(h).float()
        logp = torch.log_softmax(x, -1)
        counted = torch.zeros(bsz, seq, dtype=torch.bool)
        rows = torch.zeros(bsz, seq, dtype=torch.long)
        for t in range(seq - 2 - k):
            counted[:, t] = loss_mask[:, t + 2 + k].bool() & real[:, t + 2 + k]
            rows[:, t] = t + 1 + k
        tp = teacher.target_p.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))
        tid = teacher.target_ids.gather(1, rows)
        in_loss = counted & d.t2d[tid]
        ce = -(tp * logp).sum(-1)
        loss_k = (ce * in_loss).sum() / in_loss.sum().clamp(min=1)
        total = total + decay**k * loss_k
        pred = x.argmax(-1)
        corrects.append((((pred + d.d2t[pred]) == tid) & counted).sum().float())
        pod = teacher.p_on_draft.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))
        accepts.append((torch.minimum(pod, torch.softmax(x, -1)).sum(-1) * in_loss).sum())
        losses.append(loss_k.detach())
    return total, torch.stack(losses), torch.stack(corrects), torch.stack(accepts)


def grads(d) -> dict[str, torch.Tensor]:
    out = {n: p.grad.float().clone() for n, p in d.named_parameters() if p.requires_grad}
    d.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(("chunk_rows", "turns"), [(1, False), (7, False), (None, False), (7, True), (16, True),
                                                   (None, True)])
def test_fp32_loss_metrics_and_gradients_equal_plain_autograd(chunk_rows, turns):
    """Windows of 1 row (each a slice), of 7 (gathered rows), of 16 with runs of counted rows (slices that
    hold uncounted rows, and gathered rows), the default (one window)."""
    d, case = make_case(seed=1, turns=turns)
    ref, ref_loss, ref_correct, ref_accept = plain_autograd_loss(d, **case, steps=STEPS, decay=DECAY)
    ref.backward()
    want = grads(d)
    out = ttt_forward(d, **case, steps=STEPS, decay=DECAY, head_chunk_rows=chunk_rows)
    out.loss.backward()
    got = grads(d)
    torch.testing.assert_close(out.loss, ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.step_loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert torch.equal(out.step_correct, ref_correct) and ref_correct.sum() > 0
    torch.testing.assert_close(out.step_accept_sum, ref_accept, atol=1e-5, rtol=1e-6)
    assert want.keys() == got.keys() and "lm_head.weight" in got and "norm.weight" in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


def _max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in b}


@pytest.mark.parametrize("mode", ["bf16-weights", "bf16-autocast"])
def test_bf16_gradients_as_close_to_fp64_as_plain_autograd(mode):
    """In bf16 (weights cast, as DeepSpeed bf16 runs; or fp32 weights under autocast) the gradients
    equal plain autograd's to bf16 rounding, and are no further from an fp64 computation than it is."""
    d, case = make_case(seed=2)
    d64 = tiny_drafter(seed=2, vocab_size=96, draft_vocab_size=40, hidden_size=HIDDEN).double()
    case64 = {**case, "aux_hidden": case["aux_hidden"].double()}
    truth, *_ = plain_autograd_loss(d64, **case64, steps=STEPS, decay=DECAY)
    truth.backward()
    exact = grads(d64)
    if mode == "bf16-weights":
        d = d.to(torch.bfloat16)
        case = {**case, "aux_hidden": case["aux_hidden"].bfloat16()}
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "bf16-autocast" else torch.autocast("cpu", enabled=False)
    with ctx:
        ref, ref_loss, ref_correct, _ = plain_autograd_loss(d, **case, steps=STEPS, decay=DECAY)
    ref.backward()
    want = grads(d)
    with ctx:
        out = ttt_forward(d, **case, steps=STEPS, decay=DECAY, head_chunk_rows=5)
    out.loss.backward()
    got = grads(d)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.step_loss, ref_loss, atol=2e-2, rtol=2e-2)
    err_ours, err_ref = _max_err(got, exact), _max_err(want, exact)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-2 * float(want[name].abs().max()), rtol=0, msg=name)
        assert err_ours[name] <= 1.2 * err_ref[name] + 1e-3, (name, err_ours[name], err_ref[name])


def test_no_step_logits_are_kept_for_the_backward():
    """Nothing saved for the backward is as large as one step's [B, T, Vd] logits (the plain path keeps K)."""
    d, case = make_case(seed=3, vocab=2400, draft=2048, lengths=(24, 24))
    bt_vd = 2 * 24 * 2048
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ttt_forward(d, **case, steps=STEPS, decay=DECAY)
    assert max(sizes) < bt_vd // 4, max(sizes)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plain, *_ = plain_autograd_loss(d, **case, steps=STEPS, decay=DECAY)
    assert max(sizes) >= bt_vd  # the check can see a step's logits when they are kept
    out.loss.backward()


def test_backward_twice_is_refused_and_no_grad_makes_none():
    d, case = make_case(seed=4)
    out = ttt_forward(d, **case, steps=2)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.loss.backward()
    with torch.no_grad():
        val = ttt_forward(d, **case, steps=2)
    assert not val.loss.requires_grad
    torch.testing.assert_close(val.loss, out.loss.detach())


def test_gradient_scales_with_the_incoming_gradient():
    """accelerate divides the loss by grad_accum before backward: the head's gradients must follow."""
    d, case = make_case(seed=5)
    ttt_forward(d, **case, steps=3).loss.backward()
    one = grads(d)
    (ttt_forward(d, **case, steps=3).loss * 0.25).backward()
    quarter = grads(d)
    for name in one:
        torch.testing.assert_close(quarter[name], one[name] * 0.25, atol=1e-7, rtol=1e-6, msg=name)
