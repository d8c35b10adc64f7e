"""The drafter's lm_head + soft cross-entropy + metrics over all TTT steps, without [B, T, Vd] logits kept.

Why: the plain autograd path keeps each step's [B, T, Vd] softmax (or logits) for the backward, K
of them at once: at T = 4096, a 32k draft vocab and K = 7 that is 3.7 GB before anything else.
Here the head runs over the counted positions in windows of rows, and each window's gradients are
computed right away, in the forward, because the loss weights are known there: step k's loss is
``sum over its loss rows of soft-CE / n_k`` and the total is ``sum_k decay^k loss_k``, so
d total / d logits of a row is ``decay^k / n_k * (q * sum(p) - p)`` (0 for rows outside the loss).
Only d normed-hidden [B, T, H] per step and d lm_head [Vd, H] (the size of the weight's own
gradient) wait for the backward, which scales them by the incoming gradient (a scalar; the loss
is linear in it). The matmuls are the same three per row as autograd's (logits, d hidden,
d weight): nothing is recomputed.

Rows whose predicted token is not a counted assistant token have loss weight and metrics zero.
The rows are cut into windows of ``chunk_rows`` consecutive rows; a window whose rows mostly
count (see GATHER_AT) is computed as a slice of the hidden and teacher tensors (no copies), a
window with fewer counted rows gathers only those (so prompts cost no lm_head work), a window
with none is skipped. One host sync per call plans the windows.

Precision follows the plain ``lm_head(x)`` call it replaces: the matmuls run in the weight's dtype,
or in autocast's dtype when autocast is on (its weight cast made once per call); softmax, the loss
and the logit gradients are fp32; d lm_head is accumulated over chunks in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redraft.core.alignment import step_offset

# Default rows per chunk = CHUNK_ELEMENTS // Vd, at least MIN_CHUNK_ROWS: each [rows, Vd] fp32
# temporary (logits, softmax, teacher rows) is then ~64 MB whatever the draft vocab.
CHUNK_ELEMENTS = 1 << 24
MIN_CHUNK_ROWS = 64
# A window is computed whole (a slice) unless more than GATHER_AT / H of its rows do not count; then
# its counted rows are gathered. Gathering a row's teacher (two [Vd] fp32 rows, copied) costs about
# what the lm_head's 6 * H FLOPs per vocab entry of GATHER_AT / H of a row do on a CPU core (measured
# ~1.5 GB/s per copy against ~100 GFLOP/s): 11% of the rows at H = 576, 3% at H = 2048.
GATHER_AT = 64.0


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
        with torch.autocast(weight.device.type, enabled=False):
            total, stats, grads = _run(weight, normed, plan)
        ctx.grads = grads  # (d weight fp32, d normed per step) or None
        ctx.weight_dtype = weight.dtype
        ctx.shapes = [x.shape for x in normed]
        ctx.mark_non_differentiable(*stats)
        return (total, *stats)

    @staticmethod
    def backward(ctx, grad, *_unused):  # type: ignore[override]
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("head loss: no gradients were prepared (forward ran without grad, or backward "
                               "ran twice; retain_graph is not supported)")
        ctx.grads = None
        d_weight, d_normed = grads
        g = grad.to(torch.float32)
        out_h = [dh.mul_(g.to(dh.dtype)).view(shape) for dh, shape in zip(d_normed, ctx.shapes, strict=True)]
        return (d_weight.mul_(g).to(ctx.weight_dtype), None, *out_h)


def _plan(counted: torch.Tensor, chunk: int, hidden: int) -> list[list[tuple[int, int] | torch.Tensor]]:
    """Per step, its windows: (start, stop) of a slice computed whole, or the counted rows to gather."""
    steps, n = counted.shape
    dense = 1.0 - min(GATHER_AT / hidden, 1.0)  # the share of counted rows from which a window is a slice
    n_win = -(-n // chunk)
    per_win = torch.nn.functional.pad(counted, (0, n_win * chunk - n)).view(steps, n_win, chunk).sum(-1)
    flat = torch.nonzero(counted)[:, 1]  # counted rows, ascending within each step, steps in order
    plans, offset = [], 0
    for k, counts in enumerate(per_win.tolist()):  # the host sync
        wins: list[tuple[int, int] | torch.Tensor] = []
        for w, c in enumerate(counts):
            if c == 0:
                continue
            a, b = w * chunk, min((w + 1) * chunk, n - step_offset(k))  # its teacher row must exist
            wins.append((a, b) if c >= dense * (b - a) else flat[offset : offset + c])
            offset += c
        plans.append(wins)
    return plans


def _run(weight, normed, plan):
    """The forward: per step, per window of rows, logits -> soft-CE, metrics and (when needed) gradients."""
    targets: HeadTargets = plan["targets"]
    counted, in_loss = plan["counted"], plan["in_loss"]
    need_grad: bool = plan["need_grad"]
    cdt = plan["dtype"]
    vd, hid = weight.shape
    dev = weight.device
    f32 = torch.float32
    w_c = weight.to(cdt)
    d_weight = torch.zeros((vd, hid), dtype=f32, device=dev) if need_grad else None
    d_normed = []
    total = torch.zeros((), dtype=f32, device=dev)
    losses, corrects, accepts = [], [], []
    for k, (x, windows) in enumerate(zip(normed, _plan(counted, plan["chunk_rows"], hid), strict=True)):
        flat = x.reshape(-1, hid)
        shift = step_offset(k)  # teacher row of hidden row r is r + shift
        loss_sum = torch.zeros((), dtype=f32, device=dev)
        correct = torch.zeros((), dtype=f32, device=dev)
        accept = torch.zeros((), dtype=f32, device=dev)
        dh = torch.zeros_like(flat) if need_grad else None
        for win in windows:
            if isinstance(win, tuple):  # a slice: views, the uncounted rows masked
                a, b = win
                h = flat[a:b]
                t0, t1 = a + shift, b + shift
                p, pm, tid = targets.target_p[t0:t1], targets.p_mass[t0:t1], targets.target_ids[t0:t1]
                pod = None if targets.p_on_draft is None else targets.p_on_draft[t0:t1]
                counts, lw = counted[k, a:b], in_loss[k, a:b].to(f32)
            else:  # the counted rows, gathered
                rows, trows = win, win + shift
                h = flat.index_select(0, rows)
                p, pm = targets.target_p.index_select(0, trows), targets.p_mass.index_select(0, trows)
                tid = targets.target_ids.index_select(0, trows)
                pod = None if targets.p_on_draft is None else targets.p_on_draft.index_select(0, trows)
                counts, lw = None, in_loss[k].index_select(0, rows).to(f32)
            h = h.to(cdt)
            logits = torch.mm(h, w_c.t()).to(f32)
            ce, q, pred, _ = soft_ce_rows(logits, p, pm)
            del logits
            loss_sum = loss_sum + (ce * lw).sum()
            hit = (pred + targets.d2t[pred]) == tid
            correct = correct + (hit if counts is None else hit & counts).sum()
            if pod is not None:
                accept = accept + (torch.minimum(pod.to(f32), q).sum(-1) * lw).sum()
            del pod
            if need_grad:
                # d total / d logits = w * (q * sum(p) - p), w = decay^k / n_k on loss rows, else 0 (in place on q)
                w = lw * (plan["decays"][k] / plan["denominators"][k])
                q.mul_((w * pm)[:, None]).addcmul_(p.to(f32), w[:, None], value=-1.0)
                dl = q.to(cdt)
                del q, p
                dx = torch.mm(dl, w_c).to(dh.dtype)
                if isinstance(win, tuple):
                    dh[win[0] : win[1]] = dx
                else:
                    dh.index_copy_(0, win, dx)
                if cdt == f32:
                    d_weight.addmm_(dl.t(), h)
                else:
                    d_weight += torch.mm(dl.t(), h).to(f32)
                del dl, dx
        loss_k = loss_sum / plan["denominators"][k]
        total = total + plan["decays"][k] * loss_k
        losses.append(loss_k)
        corrects.append(correct)
        accepts.append(accept)
        if need_grad:
            d_normed.append(dh)
    stats = (torch.stack(losses), torch.stack(corrects), torch.stack(accepts))
    return total, stats, ((d_weight, d_normed) if need_grad else None)


def head_loss(
    weight: torch.Tensor,
    normed: list[torch.Tensor],
    counted: torch.Tensor,
    in_loss: torch.Tensor,
    targets: HeadTargets,
    decay: float,
    chunk_rows: int | None = None,
    denominators: torch.Tensor | None = None,
) -> HeadLossOutput:
    """Loss and metrics of ``logits_k = normed[k] @ weight.T`` for TTT steps k = 0..K-1.

    ``normed[k]`` [B, T, H] is step k's normed hidden state; hidden row r (flat over B*T) is scored
    against teacher row r + step_offset(k) = r + 1 + k (redraft.core.alignment). ``counted`` [K, B*T] bool:
    the rows in step k's metrics; ``in_loss`` [K, B*T] bool: those also in its loss (a subset).
    loss_k = sum of soft-CE over the loss rows / max(their number, 1); the total is sum_k decay^k
    loss_k. The gradient reaches ``weight`` and every ``normed[k]`` that requires one.
    ``chunk_rows``: rows whose logits exist at once (default: default_chunk_rows(Vd)). ``denominators`` [K]:
    each step's loss divisor when it is not this call's own count of loss rows (a sequence-parallel rank
    divides its rows' sum by the group's count).
    """
    steps = len(normed)
    if tuple(counted.shape) != (steps, targets.target_ids.numel()) or in_loss.shape != counted.shape:
        raise ValueError(f"head_loss: {steps} hidden states, counted {tuple(counted.shape)}, in_loss "
                         f"{tuple(in_loss.shape)}, {targets.target_ids.numel()} teacher rows")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"head_loss: chunk_rows must be >= 1, got {chunk_rows}")
    need_grad = torch.is_grad_enabled() and (weight.requires_grad or any(x.requires_grad for x in normed))
    plan = {"targets": targets, "counted": counted, "in_loss": in_loss, "need_grad": need_grad,
            "dtype": _compute_dtype(weight), "chunk_rows": chunk_rows or default_chunk_rows(weight.shape[0]),
            "decays": [decay**k for k in range(steps)],
            "denominators": in_loss.sum(1).to(torch.float32).clamp(min=1) if denominators is None else denominators}
    total, step_loss, correct, accept = _HeadLoss.apply(weight, plan, *normed)
    return HeadLossOutput(loss=total, step_loss=step_loss, step_correct=correct, step_accept_sum=accept)
