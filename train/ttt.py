"""Training-time test (TTT): unroll the drafter K steps on ground-truth tokens and score every step.

Inputs are RAW per-sample tensors, right-padded to [B, T]: ``input_ids[b, t]`` is token t,
``aux_hidden[b, t]`` the captured features of token t, teacher row t predicts token t+1,
``loss_mask[b, t] = 1`` when token t is an assistant token.

Alignment (identical to SpecForge 0.2.0 and to serving, see docs/design.md). At position t,
step k = 0..K-1:

- embedded token: ground-truth token t+1+k (0 past the end; padded ids are replaced by 0, as
  SpecForge zero-pads);
- hidden input: ``fc(aux[t])`` at k = 0, else the step k-1 output h2 at the same t (pre-norm);
  P-EAGLE (parallel drafting) embeds its placeholder token and reads ``fc(mask_hidden)`` at k >= 1 instead
  (``Eagle3Drafter.step_inputs``): the same cache pattern and teacher rows, so the same loss trains it;
  DFlash (``DFlashDrafter.block_states``) has no unroll: step k's state at row t is block slot k + 1 of the
  block drafted after row t, scored against the same teacher rows;
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

Efficiency: positions are batched (only the K steps loop in Python) and step k's attention is
the causal [T, T] block plus k diagonal columns, in blocks of query rows that keep no [T, T]
scores for the backward (redraft.core.drafter.ttt_attention). The draft lm_head, the soft-CE and the metrics
run in train.head_loss over all steps at once, in chunks of counted rows, with the gradients made
in the forward (the loss weights are known there): no step's [B, T, Vd] logits or softmax is kept
for the backward, and positions that predict no assistant token get no logits. Metrics stay on
the device: one host sync per unroll (counted rows per window of the head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from redraft.core.alignment import step_counted, step_rows
from redraft.core.dataset.batch import Batch
from redraft.core.drafter.modeling import DrafterBase
from redraft.core.drafter.sequence_parallel import SequenceParallel
from redraft.core.drafter.ttt_attention import TTTCache
from redraft.core.teacher_targets import TeacherTargets, teacher_from_last_hidden, teacher_from_topk
from train.head_loss import HeadTargets, head_loss, soft_ce_rows


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
    """Soft-CE rows [...] plus the drafter's softmax q and argmax from given logits, in one softmax pass
    (train.head_loss.soft_ce_rows, the math the training loss uses). Backward: grad * (q * sum(p) - p).
    q (fp32) and the argmax are returned without gradient.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_p: torch.Tensor, p_mass: torch.Tensor):  # type: ignore[override]
        ce, q, pred, lse = soft_ce_rows(logits.float(), target_p, p_mass)
        if logits.dtype == torch.float32:
            ctx.save_for_backward(q, target_p, p_mass)  # the same bytes the fp32 logits would take
        else:
            ctx.save_for_backward(logits, target_p, p_mass, lse[..., None])  # keep the small dtype; recompute q
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(q, pred)
        return ce, q, pred

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
    """Per-row loss of given logits: (soft-CE [...] fp32, drafter softmax q [..., Vd] fp32, argmax [...]).

    soft-CE = -sum_v p * log_softmax(x); ``p_mass`` [...] is sum_v p (computed here when not given),
    0 for a row without teacher mass. Only the soft-CE carries a gradient. ttt_forward computes the
    same quantity through train.head_loss; this is the form for logits one already holds (the
    SpecForge conformance check, tests).
    """
    if p_mass is None:
        p_mass = target_p.float().sum(-1)
    return _SoftCrossEntropyWithSoftmax.apply(logits, target_p, p_mass)


def _check_shapes(input_ids, aux_hidden, attention_mask, loss_mask, teacher, position_ids, rows, width) -> None:
    """[B, T] for ids, masks and positions; [B, rows] for aux_hidden and [B, width] for the teacher (T and T, or
    a sequence-parallel rank's rows and rows plus the halo)."""
    if input_ids.dim() != 2:
        raise ValueError(f"ttt_forward: input_ids must be [B, T], got {tuple(input_ids.shape)}")
    bsz, seq = input_ids.shape
    named = {"aux_hidden": (aux_hidden, rows), "loss_mask": (loss_mask, seq), "attention_mask": (attention_mask, seq),
             "position_ids": (position_ids, seq), "teacher.target_p": (teacher.target_p, width),
             "teacher.target_ids": (teacher.target_ids, width), "teacher.p_on_draft": (teacher.p_on_draft, width)}
    for name, (t, length) in named.items():
        if t is not None and tuple(t.shape[:2]) != (bsz, length):
            raise ValueError(f"ttt_forward: {name} has shape {tuple(t.shape)}, expected leading dims {(bsz, length)}")


def ttt_forward(
    drafter: DrafterBase,
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
    head_chunk_rows: int | None = None,
    recompute: bool = False,
    sequence_parallel: SequenceParallel | None = None,
) -> TTTOutput:
    """Unroll ``steps`` drafter steps over every position at once and return loss and metrics.

    ``return_logits``: also return every step's logits at every position (detached; computed apart
    from the loss, for checks). ``head_chunk_rows``: rows per chunk of the loss head (default: ~64 MB
    of fp32 logits, train.head_loss.default_chunk_rows).

    ``sequence_parallel``: this rank drafts rows [start, stop) = ``sequence_parallel.bounds(T)`` of the group's
    batch (Batch.sequence_shard): ids, masks and positions are whole [B, T], ``aux_hidden`` holds those rows and
    the teacher those rows plus the next ``steps`` (the rows they are scored against). The loss and the step
    sums are this rank's share (each step's loss over the group's counted rows), so the group's loss and
    gradients are sums over its ranks.
    """
    if steps < 1:
        raise ValueError(f"ttt_forward: steps must be >= 1, got {steps}")
    bsz, seq = input_ids.shape
    sp = sequence_parallel
    start, stop = (0, seq) if sp is None else sp.bounds(seq)
    width = seq if sp is None else stop - start + steps
    _check_shapes(input_ids, aux_hidden, attention_mask, loss_mask, teacher, position_ids, stop - start, width)
    if sp is not None and drafter.config.block:
        raise ValueError("ttt_forward: sequence parallelism trains EAGLE-kind drafters (DFlash drafts a block per "
                         "row from the rows around it)")
    device = input_ids.device
    real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
            else attention_mask.to(torch.bool))
    ids = input_ids.to(torch.int64).masked_fill(~real, 0)
    counted_tok = loss_mask.to(torch.bool) & real  # token t is a real assistant token
    if position_ids is None:
        position_ids = torch.arange(seq, device=device).expand(bsz, seq)
    t2d = drafter.t2d
    target_ids = teacher.target_ids.to(torch.int64)
    in_draft = t2d[target_ids.clamp(0, t2d.numel() - 1)] & (target_ids >= 0) & (target_ids < t2d.numel())

    normed = _step_states(drafter, ids, aux_hidden, attention_mask, position_ids, steps, recompute, (start, stop))
    all_logits: list[torch.Tensor] = []
    if return_logits:
        with torch.no_grad():
            all_logits = [drafter.lm_head(x).detach() for x in normed]
    if width > stop - start:  # the halo rows: teacher rows only, never drafted from
        normed = [F.pad(x, (0, 0, 0, width - (stop - start))) for x in normed]

    # Rows per step (redraft.core.alignment): position t counts iff token t+2+k is a real assistant token
    # (so t < T-2-k); it is in the loss iff teacher row t+1+k's argmax is a draft token as well.
    count = torch.zeros((steps, bsz, width), dtype=torch.bool, device=device)
    in_loss = torch.zeros((steps, bsz, width), dtype=torch.bool, device=device)
    for k in range(steps):
        count[k, :, : stop - start] = step_counted(counted_tok, k)[:, start:stop]
        in_loss[k] = count[k] & step_rows(in_draft, k, False)
    n_loss = in_loss.sum((1, 2))  # [K]
    n_acc = count.sum((1, 2))  # [K]
    denominators = None if sp is None else sp.all_reduce_sum(n_loss).to(torch.float32).clamp(min=1)
    vd = teacher.target_p.shape[-1]
    targets = HeadTargets(
        target_p=teacher.target_p.reshape(-1, vd),
        p_mass=teacher.target_p.float().sum(-1).reshape(-1),  # 1 (or 0) for a renormalised teacher; once
        target_ids=target_ids.reshape(-1),
        p_on_draft=None if teacher.p_on_draft is None else teacher.p_on_draft.reshape(-1, vd),
        d2t=drafter.d2t,
    )
    head = head_loss(drafter.lm_head.weight, normed, count.view(steps, -1), in_loss.view(steps, -1), targets, decay,
                     chunk_rows=head_chunk_rows, denominators=denominators)
    f32 = torch.float32
    return TTTOutput(
        loss=head.loss,
        step_loss=head.step_loss,
        step_acc=head.step_correct / n_acc.to(f32).clamp(min=1),
        step_accept=head.step_accept_sum / n_loss.to(f32).clamp(min=1),
        step_counts=n_loss.to(f32),
        step_correct=head.step_correct,
        step_accept_sum=head.step_accept_sum,
        step_acc_counts=n_acc.to(f32),
        logits=all_logits if return_logits else None,
    )


def _step_states(
    drafter: DrafterBase, ids: torch.Tensor, aux_hidden: torch.Tensor, attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor, steps: int, recompute: bool = False, rows: tuple[int, int] | None = None,
) -> list[torch.Tensor]:
    """The tensor lm_head reads, [B, T, H], for each of ``steps`` draft steps at every row: the EAGLE unroll, or
    DFlash's blocks (one pass, every row's block at once). ``recompute``: each EAGLE step's activations are
    recomputed in the backward (activation checkpointing); only its input state and keys/values are kept.
    ``rows``: the rows [start, stop) this rank drafts from (sequence parallel; ids and positions are whole)."""
    if drafter.config.block:
        return drafter.block_states(ids, aux_hidden, attention_mask, steps)
    start, stop = rows or (0, ids.shape[1])
    position_ids = position_ids[:, start:stop]
    cache = TTTCache()
    hidden = drafter.project(aux_hidden)
    normed: list[torch.Tensor] = []
    for k in range(steps):
        tokens, hidden = drafter.step_inputs(k, step_rows(ids, k)[:, start:stop], hidden)  # P-EAGLE: its placeholder
        if recompute and torch.is_grad_enabled():
            hidden, key, value = checkpoint(_checkpointed_step, drafter, tokens, hidden, position_ids + k,
                                            attention_mask, len(cache), *cache.keys, *cache.values,
                                            use_reentrant=False)
            cache.keys.append(key)
            cache.values.append(value)
        else:
            hidden = drafter(tokens, hidden, position_ids + k, cache, attention_mask)
        normed.append(drafter.logit_input(hidden))
    return normed


def _checkpointed_step(
    drafter: DrafterBase, tokens: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None, n_prev: int, *kv: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TTT step as a pure function of the earlier steps' keys/values (a fresh cache each call), so that the
    backward's recomputation sees exactly the forward's inputs; returns the state and this step's key/value."""
    cache = TTTCache(keys=list(kv[:n_prev]), values=list(kv[n_prev:]))
    hidden = drafter(tokens, hidden, position_ids, cache, attention_mask)
    return hidden, cache.keys[-1], cache.values[-1]


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
        drafter: DrafterBase,
        *,
        steps: int,
        decay: float,
        teacher: str = "topk",
        lm_head: torch.Tensor | None = None,
        teacher_chunk_tokens: int = 1024,
        recompute: bool = False,
        sequence_parallel: SequenceParallel | None = None,
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
        self.recompute = recompute
        self.sequence_parallel = sequence_parallel
        if sequence_parallel is not None:
            drafter.set_sequence_parallel(sequence_parallel)

    def shard(self, batch: Batch) -> Batch:
        """This rank's share of a sequence-parallel group's batch (the whole batch without sequence parallelism);
        on the host, before the batch moves to the device."""
        sp = self.sequence_parallel
        return batch if sp is None else batch.sequence_shard(sp.rank, sp.size, halo=self.steps)

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
        if (batch.shard is None) != (self.sequence_parallel is None):
            raise ValueError("TTTModel: a sequence-parallel model takes its rank's shard of a batch (TTTModel.shard), "
                             "and only then")
        return ttt_forward(
            self.drafter,
            input_ids=batch.input_ids,
            aux_hidden=batch.aux_hidden,
            attention_mask=batch.attention_mask,
            loss_mask=batch.loss_mask,
            teacher=self.teacher_targets(batch),
            steps=self.steps,
            decay=self.decay,
            recompute=self.recompute,
            sequence_parallel=self.sequence_parallel,
        )
