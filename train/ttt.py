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
step runs; the soft-CE saves only the logits (no fp32 [B, T, Vd] copy per step) for backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.drafter import Eagle3Drafter, TTTCache
from train.vocab import draft_token_ids


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
    stats = torch.zeros(5, steps, dtype=torch.float32, device=device)  # loss, n, correct, n_acc, accept
    all_logits: list[torch.Tensor] = []
    for k in range(steps):
        hidden = drafter.step(_shift_left(ids, 1 + k), hidden, position_ids + k, cache, attention_mask)
        logits = drafter.compute_logits(hidden)
        if return_logits:
            all_logits.append(logits.detach())
        span = max(seq - 2 - k, 0)  # positions t whose predicted token t+2+k exists
        lg = logits[:, :span]
        count = counted_tok[:, 2 + k : 2 + k + span]
        rows = slice(1 + k, 1 + k + span)
        loss_pos = count & in_draft[:, rows]
        ce = soft_cross_entropy(lg, teacher.target_p[:, rows])
        n_loss = loss_pos.sum()
        loss_k = torch.where(loss_pos, ce, torch.zeros_like(ce)).sum() / n_loss.clamp(min=1)
        total = total + (decay**k) * loss_k
        with torch.no_grad():
            pred = lg.argmax(-1)
            correct = ((pred + d2t[pred]) == target_ids[:, rows]) & count
            stats[0, k] = loss_k.detach()
            stats[1, k] = n_loss
            stats[2, k] = correct.sum()
            stats[3, k] = count.sum()
            if teacher.p_on_draft is not None and span > 0:
                q = torch.softmax(lg.float(), dim=-1)
                overlap = torch.minimum(teacher.p_on_draft[:, rows].float(), q).sum(-1)
                stats[4, k] = torch.where(loss_pos, overlap, torch.zeros_like(overlap)).sum()
        del logits, lg, ce
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
    p_on_draft = torch.zeros((*ids.shape[:-1], n_draft), dtype=torch.float32, device=ids.device)
    p_on_draft.scatter_add_(-1, didx.clamp(min=0), probs)
    mass = p_on_draft.sum(-1, keepdim=True)
    target_p = torch.where(mass > 0, p_on_draft / mass.clamp(min=torch.finfo(torch.float32).tiny),
                           torch.zeros_like(p_on_draft))
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
    cols = torch.nonzero(t2d.to(device)).squeeze(-1)
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
