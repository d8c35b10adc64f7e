"""Training-time test (TTT): unroll the drafter K steps on ground-truth tokens and score every step.

Inputs are RAW per-sample tensors, right-padded to [B, T]: ``input_ids[b, t]`` is token t,
``aux_hidden[b, t]`` the captured features of token t, teacher row t predicts token t+1,
``loss_mask[b, t] = 1`` when token t is an assistant token.

Alignment (identical to SpecForge 0.2.0 and to serving, see docs/design.md). At position t,
step k = 0..K-1:

- embedded token: ground-truth token t+1+k (0 past the end; padded ids are replaced by 0, as
  SpecForge zero-pads);
- hidden input: ``fc(aux[t])`` at k = 0, else the step k-1 output h2 at the same t (pre-norm);
- RoPE position: ``position_ids[t] + k`` for the query and this step's key; cached keys keep theirs;
- attention: one softmax over the step-0 keys at positions <= t (causal + key padding) and the
  keys of steps 1..k at position t (the "diagonal");
- teacher: row t+1+k (the distribution of token t+2+k).

Masking and normalisation (a DELIBERATE difference from SpecForge, which weights step k by
``loss_mask[t+k]`` with the last real token zeroed and divides every step by B*T):

- a position counts at step k iff the token it predicts is an assistant token:
  ``loss_mask[t+2+k] == 1`` (and it is a real token);
- loss_k = sum over counted positions whose teacher argmax (row t+1+k, full vocab) is in the
  draft vocab of soft-CE, divided by max(that number, 1). Soft-CE = -sum_v target_p * log_softmax(logits);
  target_p is the teacher renormalised over the draft vocab;
- total loss = sum_k decay^k * loss_k;
- accuracy_k: (draft argmax mapped through d2t) == teacher argmax, over all counted positions,
  so a teacher argmax outside the draft vocab is a miss;
- accept_k: mean over the loss positions of sum_v min(p_teacher_on_draft, q_drafter), with the
  teacher probability NOT renormalised (an estimate of the per-token acceptance rate).

Efficiency: positions are batched (only the K steps loop in Python), step k's attention is the
causal [T, T] block plus k diagonal columns, and each step's loss is reduced before the next
step runs. Per step, one softmax over the [B, T, Vd] logits serves the soft-CE (its logsumexp is
read off the softmax at the argmax), the backward (q is saved instead of the fp32 logits, the same
memory; low-precision logits are saved as they are and q recomputed) and the metrics (argmax,
sum min(p, q)); the teacher's row mass is summed once, not per step. Metrics stay on the device
(no host sync): they are stacked into [K] tensors at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from train.drafter import Eagle3Drafter, TTTCache
from train.vocab import draft_token_ids

# t2d tensor -> (its version, device, nonzero(t2d) there): nonzero is a host sync on GPUs, and the
# training loop calls teacher_from_last_hidden with the same t2d buffer every step.
_DRAFT_COLUMNS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass
class TeacherTargets:
    """Teacher rows in raw alignment (row t predicts token t+1), restricted to the draft vocab."""

    target_p: torch.Tensor  # [B, T, Vd] teacher distribution renormalised over the draft vocab (0 rows: no mass)
    target_ids: torch.Tensor  # [B, T] int64 teacher full-vocab argmax of row t
    p_on_draft: torch.Tensor | None = None  # [B, T, Vd] unrenormalised teacher prob on draft tokens


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, sum_k decay^k * loss_k
    step_loss: torch.Tensor  # [K] detached
    step_acc: torch.Tensor  # [K] detached: correct / step_acc_counts
    step_accept: torch.Tensor  # [K] detached: step_accept_sum / step_counts
    step_counts: torch.Tensor  # [K] positions counted in loss_k
    step_correct: torch.Tensor  # [K] accuracy numerators
    step_accept_sum: torch.Tensor  # [K]
    step_acc_counts: torch.Tensor  # [K] accuracy denominators (loss-masked positions, any teacher argmax)
    logits: list[torch.Tensor] | None = None  # K x [B, T, Vd] detached, with return_logits=True


class _SoftCrossEntropy(torch.autograd.Function):
    """-sum_v p * log_softmax(x) in fp32, saving only x, p (a view of the teacher) and logsumexp."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = logits.float()
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        loss = -(target_p.float() * (x - lse)).sum(-1)
        ctx.save_for_backward(logits, target_p, lse)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        logits, target_p, lse = ctx.saved_tensors
        p = target_p.float()
        q = torch.exp(logits.float() - lse)
        g = grad[..., None] * (q * p.sum(-1, keepdim=True) - p)
        return g.to(logits.dtype), None


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:
    """Per-row soft cross-entropy [...] (fp32) of logits [..., Vd] against target_p [..., Vd]."""
    return _SoftCrossEntropy.apply(logits, target_p)


class _SoftCrossEntropyWithSoftmax(torch.autograd.Function):
    """Soft-CE rows [...] plus the drafter's softmax q and argmax, all from one softmax pass.

    ce = lse * sum(p) - p . x, with lse = x[argmax] - log q[argmax] (exact: q[argmax] = exp(x_max - lse)),
    so no separate logsumexp pass and no [..., Vd] temporaries. Backward: grad * (q * sum(p) - p).
    q (fp32) and the argmax are returned without gradient for the metrics.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_p: torch.Tensor, p_mass: torch.Tensor):  # type: ignore[override]
        x = logits.float()
        q = torch.softmax(x, dim=-1)
        pred = x.argmax(-1, keepdim=True)
        lse = x.gather(-1, pred) - q.gather(-1, pred).log()
        p32 = target_p.float()
        ce = lse.squeeze(-1) * p_mass - torch.linalg.vecdot(x, p32)
        if logits.dtype == torch.float32:
            ctx.save_for_backward(q, target_p, p_mass)  # the same bytes the fp32 logits would take
        else:
            ctx.save_for_backward(logits, target_p, p_mass, lse)  # keep the small dtype; recompute q
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(q, pred)
        return ce, q, pred.squeeze(-1)

    @staticmethod
    def backward(ctx, grad, _grad_q, _grad_pred):  # type: ignore[override]
        saved = ctx.saved_tensors
        if ctx.logits_dtype == torch.float32:
            q, target_p, p_mass = saved
        else:
            logits, target_p, p_mass, lse = saved
            q = torch.exp(logits.float() - lse)
        g = grad[..., None]
        dx = q * (g * p_mass[..., None])
        dx.addcmul_(target_p.float(), g, value=-1.0)
        return dx.to(ctx.logits_dtype), None, None


def _shift_left(x: torch.Tensor, s: int) -> torch.Tensor:
    """x[:, s:] followed by s zero columns (dim 1)."""
    if s == 0:
        return x
    pad = torch.zeros((x.shape[0], min(s, x.shape[1]), *x.shape[2:]), dtype=x.dtype, device=x.device)
    return torch.cat((x[:, s:], pad), dim=1)


def _check_shapes(input_ids, aux_hidden, attention_mask, loss_mask, teacher, position_ids) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"ttt_forward: input_ids must be [B, T], got {tuple(input_ids.shape)}")
    bt = tuple(input_ids.shape)
    named = {"aux_hidden": aux_hidden, "loss_mask": loss_mask, "attention_mask": attention_mask,
             "position_ids": position_ids, "teacher.target_p": teacher.target_p,
             "teacher.target_ids": teacher.target_ids, "teacher.p_on_draft": teacher.p_on_draft}
    for name, t in named.items():
        if t is not None and tuple(t.shape[:2]) != bt:
            raise ValueError(f"ttt_forward: {name} has shape {tuple(t.shape)}, expected leading dims {bt}")


def ttt_forward(
    drafter: Eagle3Drafter,
    *,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    loss_mask: torch.Tensor,
    teacher: TeacherTargets,
    steps: int = 7,
    decay: float = 0.8,
    position_ids: torch.Tensor | None = None,
    return_logits: bool = False,
) -> TTTOutput:
    """Unroll ``steps`` drafter steps over every position at once and return loss and metrics."""
    if steps < 1:
        raise ValueError(f"ttt_forward: steps must be >= 1, got {steps}")
    _check_shapes(input_ids, aux_hidden, attention_mask, loss_mask, teacher, position_ids)
    bsz, seq = input_ids.shape
    device = input_ids.device
    real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
            else attention_mask.to(torch.bool))
    ids = input_ids.to(torch.int64).masked_fill(~real, 0)
    counted_tok = loss_mask.to(torch.bool) & real  # token t is a real assistant token
    if position_ids is None:
        position_ids = torch.arange(seq, device=device).expand(bsz, seq)
    t2d = drafter.t2d
    d2t = drafter.d2t
    target_ids = teacher.target_ids.to(torch.int64)
    in_draft = t2d[target_ids.clamp(0, t2d.numel() - 1)] & (target_ids >= 0) & (target_ids < t2d.numel())

    cache = TTTCache()
    hidden = drafter.project(aux_hidden)
    total = hidden.new_zeros((), dtype=torch.float32)
    p_mass = teacher.target_p.float().sum(-1)  # [B, T]: 1 (or 0) for a renormalised teacher; summed once
    zero = torch.zeros((), dtype=torch.float32, device=device)
    rows_k: list[list[torch.Tensor]] = [[] for _ in range(5)]  # loss, n, correct, n_acc, accept
    all_logits: list[torch.Tensor] = []
    for k in range(steps):
        hidden = drafter.step(_shift_left(ids, 1 + k), hidden, position_ids + k, cache, attention_mask)
        span = max(seq - 2 - k, 0)  # positions t whose predicted token t+2+k exists
        if return_logits:
            logits = drafter.compute_logits(hidden)
            all_logits.append(logits.detach())
            lg = logits[:, :span]
        else:  # slice the [B, T, H] input, not the logits: the slice's backward then zero-fills H, not Vd
            logits = lg = drafter.compute_logits(hidden[:, :span])
        count = counted_tok[:, 2 + k : 2 + k + span]
        rows = slice(1 + k, 1 + k + span)
        loss_pos = count & in_draft[:, rows]
        ce, q, pred = _SoftCrossEntropyWithSoftmax.apply(lg, teacher.target_p[:, rows], p_mass[:, rows])
        n_loss = loss_pos.sum()
        loss_k = torch.where(loss_pos, ce, zero).sum() / n_loss.clamp(min=1)
        total = total + (decay**k) * loss_k
        with torch.no_grad():
            correct = ((pred + d2t[pred]) == target_ids[:, rows]) & count
            rows_k[0].append(loss_k.detach())
            rows_k[1].append(n_loss)
            rows_k[2].append(correct.sum())
            rows_k[3].append(count.sum())
            if teacher.p_on_draft is not None and span > 0:
                overlap = torch.minimum(teacher.p_on_draft[:, rows].float(), q).sum(-1)
                rows_k[4].append(torch.where(loss_pos, overlap, zero).sum())
            else:
                rows_k[4].append(zero)
        del logits, lg, ce, q
    with torch.no_grad():
        stats = torch.stack([torch.stack(r).to(torch.float32) for r in rows_k])  # [5, K], still on device
    return TTTOutput(
        loss=total,
        step_loss=stats[0].clone(),
        step_acc=stats[2] / stats[3].clamp(min=1),
        step_accept=stats[4] / stats[1].clamp(min=1),
        step_counts=stats[1].clone(),
        step_correct=stats[2].clone(),
        step_accept_sum=stats[4].clone(),
        step_acc_counts=stats[3].clone(),
        logits=all_logits if return_logits else None,
    )


def teacher_from_topk(
    topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, t2d: torch.Tensor, d2t: torch.Tensor
) -> TeacherTargets:
    """Dense draft-vocab teacher from top-k log-probs [B, T, K] (exp scattered onto draft ids).

    The argmax is taken over the top-k entries (it is the full-vocab argmax when k >= 1); ids
    outside the draft vocab (or negative padding ids) only lose their mass.
    """
    if topk_ids.shape != topk_logprobs.shape:
        raise ValueError(f"teacher_from_topk: ids {tuple(topk_ids.shape)} vs logprobs {tuple(topk_logprobs.shape)}")
    vocab = t2d.numel()
    n_draft = d2t.numel()
    ids = topk_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < vocab)
    t_to_d = torch.full((vocab,), -1, dtype=torch.int64, device=ids.device)
    t_to_d[draft_token_ids(d2t).to(ids.device)] = torch.arange(n_draft, device=ids.device)
    didx = torch.where(valid, t_to_d[ids.clamp(0, vocab - 1)], torch.full_like(ids, -1))
    keep = didx >= 0
    probs = torch.where(keep, topk_logprobs.float().exp(), torch.zeros((), device=ids.device))
    # renormalise the K kept entries, then scatter: no pass over [B, T, Vd] besides the two fills + scatters
    mass = probs.sum(-1, keepdim=True)
    renorm = torch.where(mass > 0, probs / mass.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(probs))
    index = didx.clamp(min=0)
    dense = (*ids.shape[:-1], n_draft)
    p_on_draft = torch.zeros(dense, dtype=torch.float32, device=ids.device).scatter_add_(-1, index, probs)
    target_p = torch.zeros(dense, dtype=torch.float32, device=ids.device).scatter_add_(-1, index, renorm)
    best = topk_logprobs.float().masked_fill(~valid, float("-inf")).argmax(-1, keepdim=True)
    target_ids = ids.gather(-1, best).squeeze(-1)
    return TeacherTargets(target_p=target_p, target_ids=target_ids, p_on_draft=p_on_draft)


@torch.no_grad()
def teacher_from_last_hidden(
    last_hidden: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor, chunk_tokens: int = 512
) -> TeacherTargets:
    """Teacher from the target's post-final-norm hidden [B, T, H] and its lm_head [V, H].

    Logits exist for at most ``chunk_tokens`` tokens at a time (the matmul runs in the
    head's dtype, like the target); only the draft columns, the logsumexp and the argmax
    are kept.
    """
    if chunk_tokens < 1:
        raise ValueError(f"teacher_from_last_hidden: chunk_tokens must be >= 1, got {chunk_tokens}")
    if last_hidden.shape[-1] != lm_head_weight.shape[1] or lm_head_weight.shape[0] != t2d.numel():
        raise ValueError(
            f"teacher_from_last_hidden: last_hidden {tuple(last_hidden.shape)}, lm_head {tuple(lm_head_weight.shape)} "
            f"and t2d [{t2d.numel()}] do not fit together"
        )
    lead = last_hidden.shape[:-1]
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])
    device = lm_head_weight.device
    cols = _draft_columns(t2d, device)
    n_tok, n_draft = flat.shape[0], cols.numel()
    target_p = torch.empty((n_tok, n_draft), dtype=torch.float32, device=device)
    p_on_draft = torch.empty((n_tok, n_draft), dtype=torch.float32, device=device)
    target_ids = torch.empty((n_tok,), dtype=torch.int64, device=device)
    for start in range(0, n_tok, chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        logits = (flat[sl].to(device=device, dtype=lm_head_weight.dtype) @ lm_head_weight.T).float()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        target_ids[sl] = logits.argmax(-1)
        draft_logits = logits[:, cols]
        del logits
        p_on_draft[sl] = torch.exp(draft_logits - lse)
        target_p[sl] = torch.softmax(draft_logits, dim=-1)
    return TeacherTargets(
        target_p=target_p.view(*lead, n_draft),
        target_ids=target_ids.view(*lead),
        p_on_draft=p_on_draft.view(*lead, n_draft),
    )


def _draft_columns(t2d: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Target ids of the draft vocab (ascending) on ``device``, cached while t2d is unchanged in place."""
    try:
        version = t2d._version
    except RuntimeError:  # inference tensors carry no version counter: do not cache
        return torch.nonzero(t2d.to(device)).squeeze(-1)
    hit = _DRAFT_COLUMNS.get(t2d)
    if hit is not None and hit[0] == version and hit[1] == device:
        return hit[2]
    cols = torch.nonzero(t2d.to(device)).squeeze(-1)
    _DRAFT_COLUMNS[t2d] = (version, device, cols)
    return cols
