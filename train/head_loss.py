"""The drafter's lm_head + soft cross-entropy + metrics over all TTT steps, without [B, T, Vd] logits kept.

Why: the plain autograd path keeps each step's [B, T, Vd] softmax (or logits) for the backward, K
of them at once: at T = 4096, a 32k draft vocab and K = 7 that is 3.7 GB before anything else.
Here the head runs over the counted positions in chunks of rows, and each chunk's gradients are
computed right away, in the forward, because the loss weights are known there: step k's loss is
``sum over its loss rows of soft-CE / n_k`` and the total is ``sum_k decay^k loss_k``, so
d total / d logits of a row is ``decay^k / n_k * (q * sum(p) - p)`` (0 for rows outside the loss).
Only d normed-hidden [N_k, H] per step and d lm_head [Vd, H] (the size of the weight's own
gradient) wait for the backward, which scales them by the incoming gradient (a scalar; the loss
is linear in it). The matmuls are the same three per row as autograd's (logits, d hidden,
d weight): nothing is recomputed.

Rows whose predicted token is not a counted assistant token get no logits at all (their loss
weight and metrics are zero), so prompt tokens cost no lm_head work.

Precision follows the plain ``lm_head(x)`` call it replaces: the matmuls run in the weight's dtype,
or in autocast's dtype when autocast is on (its weight cast made once per call); softmax, the loss
and the logit gradients are fp32; d lm_head is accumulated over chunks in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Default rows per chunk = CHUNK_ELEMENTS // Vd, at least MIN_CHUNK_ROWS: each [rows, Vd] fp32
# temporary (logits, softmax, teacher rows) is then ~64 MB whatever the draft vocab.
CHUNK_ELEMENTS = 1 << 24
MIN_CHUNK_ROWS = 64


def default_chunk_rows(draft_vocab: int) -> int:
    return max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // max(draft_vocab, 1))


def soft_ce_rows(x: torch.Tensor, p: torch.Tensor, p_mass: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One softmax pass over fp32 logits rows x [..., Vd]: (soft-CE [...], softmax q, argmax [...], lse [...]).

    soft-CE = -sum_v p * log_softmax(x) = lse * sum(p) - p . x, with lse = x[argmax] - log q[argmax]
    (exact: q[argmax] = exp(x_max - lse)), so no separate logsumexp pass; ``p_mass`` is sum_v p.
    """
    q = torch.softmax(x, dim=-1)
    pred = x.argmax(-1, keepdim=True)
    lse = (x.gather(-1, pred) - q.gather(-1, pred).log()).squeeze(-1)
    ce = lse * p_mass - torch.linalg.vecdot(x, p.float())
    return ce, q, pred.squeeze(-1), lse


@dataclass
class HeadTargets:
    """What the head is scored against, flat over the B*T teacher rows (raw alignment)."""

    target_p: torch.Tensor  # [B*T, Vd] teacher renormalised over the draft vocab
    p_mass: torch.Tensor  # [B*T] fp32, sum of target_p per row
    target_ids: torch.Tensor  # [B*T] int64 teacher full-vocab argmax
    p_on_draft: torch.Tensor | None  # [B*T, Vd] unrenormalised teacher probability, for the accept estimate
    d2t: torch.Tensor  # [Vd] draft -> target offsets


@dataclass
class HeadRows:
    """One TTT step's rows: flat indices into B*T of the hidden rows that count, their teacher rows,
    which of them are in the loss (teacher argmax in the draft vocab), and how loss_k is weighted."""

    hidden_rows: torch.Tensor  # [N] int64
    teacher_rows: torch.Tensor  # [N] int64
    in_loss: torch.Tensor  # [N] bool
    count: torch.Tensor  # [] fp32: max(loss rows, 1), loss_k's denominator
    decay: float  # decay^k, loss_k's weight in the total


@dataclass
class HeadLossOutput:
    loss: torch.Tensor  # [] fp32, sum_k decay^k * loss_k (carries the gradient)
    step_loss: torch.Tensor  # [K] fp32 detached: loss_k
    step_correct: torch.Tensor  # [K] fp32: rows whose mapped draft argmax equals the teacher argmax
    step_accept_sum: torch.Tensor  # [K] fp32: sum over loss rows of sum_v min(p_on_draft, q)


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    dev = weight.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


class _HeadLoss(torch.autograd.Function):
    """forward(weight, plan, *normed) -> (total, step_loss, correct, accept); gradients made in the forward."""

    @staticmethod
    def forward(ctx, weight, plan, *normed):  # type: ignore[override]
        cdt = plan["dtype"]
        with torch.autocast(weight.device.type, enabled=False):
            total, stats, grads = _run(weight, normed, plan, cdt)
        ctx.grads = grads  # (d weight fp32, [(rows, d rows)] per step) or None
        ctx.weight_dtype = weight.dtype
        ctx.normed_meta = [(x.shape, x.dtype) for x in normed]
        ctx.mark_non_differentiable(*stats)
        return (total, *stats)

    @staticmethod
    def backward(ctx, grad, *_unused):  # type: ignore[override]
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("head loss: no gradients were prepared (forward ran without grad, or backward "
                               "ran twice; retain_graph is not supported)")
        ctx.grads = None
        d_weight, d_rows = grads
        g = grad.to(torch.float32)
        out_w = d_weight.mul_(g).to(ctx.weight_dtype)
        out_h = []
        for (shape, dtype), (rows, dr) in zip(ctx.normed_meta, d_rows, strict=True):
            flat = torch.zeros((shape[:-1].numel(), shape[-1]), dtype=dtype, device=dr.device)
            if rows.numel():
                flat.index_copy_(0, rows, dr.mul_(g.to(dr.dtype)))
            out_h.append(flat.view(shape))
        return (out_w, None, *out_h)


def _run(weight, normed, plan, cdt):
    """The forward: per step, per chunk of rows, logits -> soft-CE, metrics and (when needed) gradients."""
    targets: HeadTargets = plan["targets"]
    steps: list[HeadRows] = plan["steps"]
    need_grad: bool = plan["need_grad"]
    vd, hid = weight.shape
    dev = weight.device
    w_c = weight.to(cdt)
    chunk = plan["chunk_rows"]
    d_weight = torch.zeros((vd, hid), dtype=torch.float32, device=dev) if need_grad else None
    d_rows = []
    f32 = torch.float32
    total = torch.zeros((), dtype=f32, device=dev)
    losses, corrects, accepts = [], [], []
    for x, st in zip(normed, steps, strict=True):
        flat = x.reshape(-1, x.shape[-1])
        n = st.hidden_rows.numel()
        loss_sum = torch.zeros((), dtype=f32, device=dev)
        correct = torch.zeros((), dtype=f32, device=dev)
        accept = torch.zeros((), dtype=f32, device=dev)
        dr = torch.empty((n, hid), dtype=x.dtype, device=dev) if need_grad else None
        for a in range(0, n, chunk):
            hr = st.hidden_rows[a : a + chunk]
            tr = st.teacher_rows[a : a + chunk]
            in_loss = st.in_loss[a : a + chunk]
            h = flat.index_select(0, hr).to(cdt)
            logits = torch.mm(h, w_c.t()).to(f32)
            p = targets.target_p.index_select(0, tr)
            pm = targets.p_mass.index_select(0, tr)
            ce, q, pred, _ = soft_ce_rows(logits, p, pm)
            del logits
            lw = in_loss.to(f32)
            loss_sum = loss_sum + (ce * lw).sum()
            hit = (pred + targets.d2t[pred]) == targets.target_ids.index_select(0, tr)
            correct = correct + hit.sum()
            if targets.p_on_draft is not None:
                pod = targets.p_on_draft.index_select(0, tr).to(f32)
                accept = accept + (torch.minimum(pod, q).sum(-1) * lw).sum()
                del pod
            if need_grad:
                # d total / d logits = w * (q * sum(p) - p), w = decay^k / n_k on loss rows, else 0 (in place on q)
                w = lw * (st.decay / st.count)
                q.mul_((w * pm)[:, None]).addcmul_(p.to(f32), w[:, None], value=-1.0)
                dl = q.to(cdt)
                del q, p
                dr[a : a + hr.numel()] = torch.mm(dl, w_c).to(x.dtype)
                if cdt == f32:
                    d_weight.addmm_(dl.t(), h)
                else:
                    d_weight += torch.mm(dl.t(), h).to(f32)
                del dl
        loss_k = loss_sum / st.count
        total = total + st.decay * loss_k
        losses.append(loss_k)
        corrects.append(correct)
        accepts.append(accept)
        if need_grad:
            d_rows.append((st.hidden_rows, dr))
    stats = (torch.stack(losses), torch.stack(corrects), torch.stack(accepts))
    return total, stats, ((d_weight, d_rows) if need_grad else None)


def head_loss(
    weight: torch.Tensor,
    normed: list[torch.Tensor],
    steps: list[HeadRows],
    targets: HeadTargets,
    chunk_rows: int | None = None,
) -> HeadLossOutput:
    """Loss and metrics of ``logits_k = normed[k] @ weight.T`` over each step's rows.

    ``normed[k]`` [B, T, H] is step k's normed hidden state (``steps[k].hidden_rows`` index its
    flattened rows); the gradient reaches ``weight`` and every ``normed[k]`` that requires one.
    ``chunk_rows``: rows whose logits exist at once (default: default_chunk_rows(Vd)).
    """
    if len(normed) != len(steps):
        raise ValueError(f"head_loss: {len(normed)} hidden states but {len(steps)} row sets")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"head_loss: chunk_rows must be >= 1, got {chunk_rows}")
    need_grad = torch.is_grad_enabled() and (weight.requires_grad or any(x.requires_grad for x in normed))
    plan = {"targets": targets, "steps": steps, "need_grad": need_grad, "dtype": _compute_dtype(weight),
            "chunk_rows": chunk_rows or default_chunk_rows(weight.shape[0])}
    total, step_loss, correct, accept = _HeadLoss.apply(weight, plan, *normed)
    return HeadLossOutput(loss=total, step_loss=step_loss, step_correct=correct, step_accept_sum=accept)
