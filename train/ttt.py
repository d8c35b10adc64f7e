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
from torch import nn

from core.alignment import shift_left
from core.dataset.batch import Batch
from core.drafter.modeling import Eagle3Drafter
from core.drafter.ttt_attention import TTTCache
from core.teacher_targets import TeacherTargets, teacher_from_last_hidden, teacher_from_topk


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


def soft_cross_entropy(
    logits: torch.Tensor, target_p: torch.Tensor, p_mass: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training loss per row: (soft-CE [...] fp32, drafter softmax q [..., Vd] fp32, argmax [...]).

    soft-CE = -sum_v p * log_softmax(x); ``p_mass`` [...] is sum_v p (computed here when not given),
    0 for a row without teacher mass. Only the soft-CE carries a gradient.
    """
    if p_mass is None:
        p_mass = target_p.float().sum(-1)
    return _SoftCrossEntropyWithSoftmax.apply(logits, target_p, p_mass)


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
        hidden = drafter(shift_left(ids, 1 + k), hidden, position_ids + k, cache, attention_mask)
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
        ce, q, pred = soft_cross_entropy(lg, teacher.target_p[:, rows], p_mass[:, rows])
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


class TTTModel(nn.Module):
    """The drafter, its teacher and the TTT unroll as one forward, so the loop reads ``out = model(batch)``.

    One module, so DDP/DeepSpeed/autocast wrappers see the whole compute. The teacher (top-k
    log-probs, or the target's lm_head over the stored last hidden state) is turned into draft-vocab
    targets inside the forward, without gradient, against the drafter's current vocab mapping. The
    lm_head is a plain attribute, not a parameter or buffer: it is frozen, never saved, and can be
    as large as the target's vocab times its hidden size.
    """

    def __init__(
        self,
        drafter: Eagle3Drafter,
        *,
        steps: int,
        decay: float,
        teacher: str = "topk",
        lm_head: torch.Tensor | None = None,
        teacher_chunk_tokens: int = 1024,
    ) -> None:
        super().__init__()
        if teacher not in ("topk", "last_hidden"):
            raise ValueError(f"TTTModel: teacher must be topk or last_hidden, got {teacher!r}")
        if teacher == "last_hidden" and lm_head is None:
            raise ValueError("TTTModel: the last_hidden teacher needs the target's lm_head")
        self.drafter = drafter
        self.steps = steps
        self.decay = decay
        self.teacher = teacher
        self.lm_head = lm_head
        self.teacher_chunk_tokens = teacher_chunk_tokens

    @torch.no_grad()
    def teacher_targets(self, batch: Batch) -> TeacherTargets:
        """The target's distribution for this batch; outside autocast, so the lm_head runs in its own dtype."""
        t2d, d2t = self.drafter.t2d, self.drafter.d2t
        with torch.autocast(batch.input_ids.device.type, enabled=False):
            if self.teacher == "topk":
                if batch.topk_ids is None or batch.topk_logprobs is None:
                    raise ValueError("TTTModel: teacher topk, but the batch holds no top-k log-probs")
                return teacher_from_topk(batch.topk_ids, batch.topk_logprobs, t2d, d2t)
            if batch.last_hidden is None:
                raise ValueError("TTTModel: teacher last_hidden, but the batch holds no last hidden state")
            return teacher_from_last_hidden(batch.last_hidden, self.lm_head, t2d, self.teacher_chunk_tokens)

    def forward(self, batch: Batch) -> TTTOutput:
        return ttt_forward(
            self.drafter,
            input_ids=batch.input_ids,
            aux_hidden=batch.aux_hidden,
            attention_mask=batch.attention_mask,
            loss_mask=batch.loss_mask,
            teacher=self.teacher_targets(batch),
            steps=self.steps,
            decay=self.decay,
        )
