"""Offline simulation of EAGLE-3 chain and tree drafting against stored target features (maths only, no I/O).

Alignment (docs/design.md): a *drafting position* ``p`` is a position whose next two tokens
``p+1`` and ``p+2`` are real assistant tokens: the target has just produced ``x[p+1]`` and there
is something to draft. Step 0 reads ``fc(aux[p])`` and token ``x[p+1]`` at RoPE position ``p``;
step ``k >= 1`` reads the step ``k-1`` output (pre-norm h2) and the drafter's OWN previous draft
token at RoPE position ``p + k``. Attention is the prefix (step-0 keys at positions ``<= p``) plus
the keys of the drafts made so far at this position: exactly :class:`redraft.core.drafter.ttt_attention.TTTCache`'s
pattern, so the chain runs on :meth:`Eagle3Drafter.step` unchanged, batched over every position.

Verification (greedy): draft ``k`` (a draft id mapped through ``d2t``) is accepted iff every
earlier draft was accepted and it equals the teacher's full-vocab argmax of row ``p+1+k``. That
row is the target's prediction after the *data* tokens ``x[..p+1+k]``; it is the right row only
while the data follows the argmax path (``x[p+2+j] == argmax[p+1+j]`` for ``j < k``) and while the
answer lasts (``x[p+2+j]`` a real assistant token for ``j <= k``). Where either fails the chain is
cut: the count is then a lower bound ("off_path") or the natural end of the answer ("end").
Accepted drafts for a shorter chain ``K' <= K`` are ``min(n, K')``: one K-run gives every length.

DFlash (``DrafterConfig.method`` "dflash") drafts the whole chain in one block pass after position ``p``
(:meth:`redraft.core.drafter.dflash.DFlashDrafter.block_states`): its drafts never read each other, so the chain is the
block's K argmaxes, verified by the same rows.

Temperature > 0 (:func:`simulate_chain_sampled`): the expected number of accepted drafts,
``sum_k prod_{j<=k} alpha_j``. Rule ``target_only`` (both engines' default; see eval.acceptance):
the drafts are the drafter's argmax and ``alpha_j = p_j(d_j)``, the teacher's probability of the
draft. Rule ``rejection`` (opt-in speculative sampling): ``alpha_j = sum_v min(p_j(v), q_j(v))``,
``q`` the drafter softmax. ``p`` and ``q`` at temperature T. Approximations: the chain
follows the DATA tokens (the drafter reads ``x[p+1+j]`` at step ``j``, as in training) instead of a
sampled path, and a top-k teacher is truncated to its stored k entries (see eval.acceptance).

Trees (:func:`simulate_tree`) follow SGLang's EAGLE rules (sgl-project/sglang
``python/sglang/srt/speculative/build_eagle_tree.py`` ``build_tree_kernel_efficient_preprocess``, and
``select_top_k_tokens`` in ``speculative/eagle_utils.py``, ``spec_utils.py`` in newer versions): depth 1 is the top-k of the step-0 distribution
(score = probability); each later depth expands every node of the current top-k frontier into its
top-k children (score = parent score x child probability) and keeps the top-k of those k*k as the
next frontier; ``steps`` depths in all (``steps`` drafter forwards). All candidates
(``k + (steps-1)*k*k``) compete and the best ``num_draft_tokens - 1`` are verified. Greedy
verification walks down from the root, following the child whose token equals the teacher argmax.

Draft attention follows SGLang's KV layout, not the EAGLE ancestor mask: the frontier lives in
``topk`` slots, slot j writes its key at ``seq_len + j * num_steps + depth`` and attends to the
prefix plus the keys written at slot j at earlier depths (``generate_draft_decode_kv_indices`` in
``sglang/kernels/ops/speculative/cache_locs.py``, SGLang 0.5.23). After the frontier is re-ranked
the node in slot j inherits its *parent's* hidden state (``select_top_k_tokens``) but slot j's key
history, which need not be its ancestors'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redraft.core.alignment import step_counted, step_rows
from redraft.core.drafter.modeling import Eagle3Drafter
from redraft.core.drafter.ttt_attention import TTTCache

# reasons a chain stopped, per position
FULL, MISS, END, OFF_PATH = 0, 1, 2, 3
REASONS = {FULL: "full", MISS: "miss", END: "end", OFF_PATH: "off_path"}


@dataclass
class ChainResult:
    """Per drafting position (flattened over the batch, row-major over [B, T])."""

    sample: torch.Tensor  # [n] int64 batch row
    position: torch.Tensor  # [n] int64 p
    accept_prob: torch.Tensor  # [n, K] float: P(draft k accepted); 0/1 at temperature 0
    reason: torch.Tensor  # [n] int64, one of FULL/MISS/END/OFF_PATH (at T>0: END or FULL only)
    drafts: torch.Tensor | None = None  # [n, K] target ids of the greedy drafts (temperature 0)

    @property
    def accepted(self) -> torch.Tensor:
        """[n] accepted drafts with chain length K (expected value at T > 0)."""
        return self.accept_prob.sum(-1)


@dataclass
class TreeResult:
    sample: torch.Tensor  # [n]
    position: torch.Tensor  # [n]
    accepted: torch.Tensor  # [n] int64 accepted drafts along the tree
    reason: torch.Tensor  # [n] int64 (FULL/MISS/END/OFF_PATH)


@dataclass
class Step0:
    """The first drafter step over whole sequences: prefix keys for every later step and the depth-1 logits."""

    cache: TTTCache
    hidden: torch.Tensor  # [B, T, H] step-0 output (pre-norm)
    logits: torch.Tensor  # [B, T, Vd]
    attention_mask: torch.Tensor  # [B, T] bool


def drafting_positions(loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: p such that tokens p+1 and p+2 exist and are assistant tokens."""
    ok = loss_mask.to(torch.bool) & attention_mask.to(torch.bool)
    return step_rows(ok, 0, False) & step_counted(ok, 0)  # token p+1 (step 0 embeds it) and p+2


def evaluable(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor, target_ids: torch.Tensor,
    steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(end_ok, path_ok), bool [B, T, K]: whether draft k at p can be verified against row p+1+k.

    end_ok[k]: tokens p+2..p+2+k are real assistant tokens (the answer has not ended);
    path_ok[k]: the data followed the teacher argmax for the k earlier drafts.
    """
    ok = loss_mask.to(torch.bool) & attention_mask.to(torch.bool)
    ids = input_ids.to(torch.int64)
    tgt = target_ids.to(torch.int64)
    end_k, path_k = [], []
    for k in range(steps):
        end_k.append(step_counted(ok, k))
        if k == 0:
            path_k.append(torch.ones_like(ok))
        else:  # data token p+1+k (step k embeds it) equals argmax row p+k (that verified step k-1)
            path_k.append(step_rows(ids, k, -1) == step_rows(tgt, k - 1, -2))
    end_ok = torch.stack(end_k, -1).cummin(-1).values
    path_ok = torch.stack(path_k, -1).cummin(-1).values
    return end_ok, path_ok


def score_chain(
    drafts: torch.Tensor, target_ids: torch.Tensor, end_ok: torch.Tensor, path_ok: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [..] int64, reason [..] int64) of greedy chains.

    ``drafts`` [.., K] target ids of the drafts; ``target_ids`` [.., K] the argmax each is compared
    with (row p+1+k); ``end_ok``/``path_ok`` [.., K] from :func:`evaluable`.
    """
    steps = drafts.shape[-1]
    ev = end_ok & path_ok
    hit = ev & (drafts == target_ids)
    n = hit.to(torch.int64).cummin(-1).values.sum(-1)
    at = n.clamp(max=steps - 1)[..., None]
    end_stop = ~end_ok.gather(-1, at).squeeze(-1)
    path_stop = ~path_ok.gather(-1, at).squeeze(-1)
    reason = torch.full_like(n, MISS)
    reason = torch.where(path_stop, torch.full_like(n, OFF_PATH), reason)
    reason = torch.where(end_stop, torch.full_like(n, END), reason)
    reason = torch.where(n == steps, torch.full_like(n, FULL), reason)
    return n, reason


def rows_for_steps(x: torch.Tensor, steps: int, fill: int | float = -1) -> torch.Tensor:
    """[B, T, K] with [..., k] = x row t+1+k (``fill`` past the end)."""
    return torch.stack([step_rows(x, k, fill) for k in range(steps)], -1)


def run_step0(
    drafter: Eagle3Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor, attention_mask: torch.Tensor
) -> Step0:
    """Step 0 over [B, T]: reads aux[t] and token t+1 at RoPE position t (the serving prefix)."""
    bsz, seq = input_ids.shape
    mask = attention_mask.to(torch.bool)
    ids = input_ids.to(torch.int64).masked_fill(~mask, 0)
    pos = torch.arange(seq, device=ids.device).expand(bsz, seq)
    cache = TTTCache()
    hidden = drafter.project(aux_hidden)
    hidden = drafter(step_rows(ids, 0), hidden, pos, cache, mask)
    return Step0(cache=cache, hidden=hidden, logits=drafter.compute_logits(hidden), attention_mask=mask)


@torch.no_grad()
def simulate_chain_greedy(
    drafter: Eagle3Drafter,
    *,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    target_ids: torch.Tensor,
    steps: int,
    step0: Step0 | None = None,
) -> tuple[ChainResult, Step0 | None]:
    """Greedy chain drafting (SGLang topk=1) at every drafting position of a right-padded batch.

    ``target_ids`` [B, T] is the teacher's full-vocab argmax of each row. Returns the per-position
    result and the step-0 state (reusable by :func:`simulate_tree`; None for DFlash, which drafts no tree).
    """
    if steps < 1:
        raise ValueError(f"simulate_chain_greedy: steps must be >= 1, got {steps}")
    if drafter.config.block:  # DFlash: every draft from one block pass; no step-0 state to share with trees
        s0 = None
        drafts = [drafter.draft_to_target(drafter.compute_logits(state).argmax(-1))
                  for state in drafter.block_states(input_ids, aux_hidden, attention_mask, steps)]
    else:
        s0 = step0 if step0 is not None else run_step0(drafter, input_ids, aux_hidden, attention_mask)
        drafts = _chain_drafts(drafter, s0, steps)
    drafts_t = torch.stack(drafts, -1)  # [B, T, K]
    end_ok, path_ok = evaluable(input_ids, loss_mask, attention_mask, target_ids, steps)
    where = drafting_positions(loss_mask, attention_mask)
    rows = rows_for_steps(target_ids.to(torch.int64), steps, -1)
    n, reason = score_chain(drafts_t[where], rows[where], end_ok[where], path_ok[where])
    b, t = torch.nonzero(where, as_tuple=True)
    accept = (torch.arange(steps, device=n.device) < n[:, None]).to(torch.float32)
    return ChainResult(sample=b, position=t, accept_prob=accept, reason=reason, drafts=drafts_t[where]), s0


def _chain_drafts(drafter: Eagle3Drafter, s0: Step0, steps: int) -> list[torch.Tensor]:
    """The greedy chain's drafts (target ids [B, T]) per step, each step reading the previous draft."""
    bsz, seq = s0.attention_mask.shape
    pos = torch.arange(seq, device=s0.hidden.device).expand(bsz, seq)
    # private cache: the prefix keys are shared, the diagonal keys are this chain's own
    cache = TTTCache(keys=[s0.cache.keys[0]], values=[s0.cache.values[0]])
    tok = drafter.draft_to_target(s0.logits.argmax(-1))
    hidden = s0.hidden
    drafts = [tok]
    for k in range(1, steps):
        tok_in, hidden = drafter.step_inputs(k, tok, hidden)  # P-EAGLE: the placeholder slot at p + k
        hidden = drafter(tok_in, hidden, pos + k, cache, s0.attention_mask)
        tok = drafter.draft_to_target(drafter.compute_logits(hidden).argmax(-1))
        drafts.append(tok)
    return drafts


@torch.no_grad()
def simulate_chain_sampled(
    drafter: Eagle3Drafter,
    *,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    teacher_p: torch.Tensor,
    temperature: float,
    steps: int,
    rule: str = "target_only",
) -> ChainResult:
    """Expected accepted drafts at temperature T > 0 along the data path (``rule``: target_only or rejection).

    ``teacher_p`` [B, T, Vd]: the teacher's probability at temperature T of each draft-vocab token
    (target-vocab normalisation, NOT renormalised over the draft vocab: mass outside it can never
    be accepted). The drafter reads data tokens at every step (teacher-forced tokens, own hidden).
    """
    if temperature <= 0:
        raise ValueError(f"simulate_chain_sampled: temperature must be > 0, got {temperature}")
    if rule not in ("target_only", "rejection"):
        raise ValueError(f"simulate_chain_sampled: rule must be 'target_only' or 'rejection', got {rule!r}")
    end_ok, _ = evaluable(input_ids, loss_mask, attention_mask, torch.zeros_like(input_ids, dtype=torch.int64), steps)
    alphas = []
    for k, logits in enumerate(_teacher_forced_logits(drafter, input_ids, aux_hidden, attention_mask, steps)):
        p = step_rows(teacher_p.float(), k, 0.0)
        if rule == "target_only":  # greedy draft d accepted with probability p(d)
            alphas.append(p.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1))
        else:
            alphas.append(torch.minimum(p, torch.softmax(logits / temperature, dim=-1)).sum(-1))
    alpha = torch.stack(alphas, -1) * end_ok.to(torch.float32)  # [B, T, K]
    where = drafting_positions(loss_mask, attention_mask)
    a = alpha[where].clamp(0.0, 1.0)
    accept = a.cumprod(-1)
    end = end_ok[where]
    reason = torch.where(end.all(-1), torch.full((a.shape[0],), FULL, device=a.device),
                         torch.full((a.shape[0],), END, device=a.device))
    b, t = torch.nonzero(where, as_tuple=True)
    return ChainResult(sample=b, position=t, accept_prob=accept, reason=reason)


def _teacher_forced_logits(
    drafter: Eagle3Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor, attention_mask: torch.Tensor,
    steps: int,
):
    """Each step's draft logits [B, T, Vd] (fp32) along the data path: step k embeds data token t+1+k (DFlash: its
    block, which reads no draft)."""
    if drafter.config.block:
        for state in drafter.block_states(input_ids, aux_hidden, attention_mask, steps):
            yield drafter.compute_logits(state).float()
        return
    s0 = run_step0(drafter, input_ids, aux_hidden, attention_mask)
    bsz, seq = input_ids.shape
    ids = input_ids.to(torch.int64).masked_fill(~s0.attention_mask, 0)
    pos = torch.arange(seq, device=ids.device).expand(bsz, seq)
    hidden = s0.hidden
    yield s0.logits.float()
    for k in range(1, steps):  # s0's cache is this chain's own
        tokens, hidden = drafter.step_inputs(k, step_rows(ids, k), hidden)
        hidden = drafter(tokens, hidden, pos + k, s0.cache, s0.attention_mask)
        yield drafter.compute_logits(hidden).float()


# ----------------------------------------------------------------------------- trees


def tree_positions(where: torch.Tensor, per_sample: int) -> torch.Tensor:
    """bool [B, T]: at most ``per_sample`` drafting positions per row, evenly spaced (0 = all). Deterministic."""
    if per_sample <= 0:
        return where
    out = torch.zeros_like(where)
    for b in range(where.shape[0]):
        idx = torch.nonzero(where[b]).squeeze(-1)
        if idx.numel() > per_sample:
            pick = torch.linspace(0, idx.numel() - 1, per_sample, device=idx.device).round().long()
            idx = idx[pick]
        out[b, idx] = True
    return out


def _node_step(
    drafter: Eagle3Drafter,
    ids: torch.Tensor,
    hidden: torch.Tensor,
    pos: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    anc_k: torch.Tensor,
    anc_v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One midlayer application for tree nodes: Eagle3Drafter's projection and output, the tree's attention.

    ids/pos [B, M], hidden [B, M, H]. ``prefix`` = (k0, v0 [B, n_kv, T, hd], visible [B, M, T] bool):
    the step-0 keys each node sees. ``anc_k``/``anc_v`` [B, M, A, n_kv, hd / hd_v]: the keys written
    at the node's slot at earlier depths (all visible; SGLang's draft KV, module docstring). Returns (h2 [B, M, H],
    own key [B, M, n_kv, hd], own value [B, M, n_kv, hd_v]).
    """
    bsz, m = ids.shape
    q, k, v = drafter.attention_inputs(ids, hidden, pos)  # q [B, M, n_kv, g, hd], k [B, M, n_kv, hd], v .. hd_v
    k0, v0, visible = prefix
    scale = drafter.midlayer.self_attn.softmax_scale
    s_pre = torch.einsum("bmkgd,bktd->bmkgt", q, k0) * scale  # [B, M, n_kv, g, T]
    s_pre = s_pre.masked_fill(~visible[:, :, None, None, :], torch.finfo(s_pre.dtype).min)
    keys = torch.cat((anc_k, k[:, :, None]), dim=2)  # [B, M, A+1, n_kv, hd]
    values = torch.cat((anc_v, v[:, :, None]), dim=2)
    s_anc = torch.einsum("bmkgd,bmakd->bmkga", q, keys) * scale
    probs = torch.softmax(torch.cat((s_pre, s_anc), -1), dim=-1, dtype=torch.float32).to(q.dtype)
    seq = k0.shape[2]
    out = torch.einsum("bmkgt,bktd->bmkgd", probs[..., :seq], v0)
    out = out + torch.einsum("bmkga,bmakd->bmkgd", probs[..., seq:], values)
    return drafter.layer_output(hidden, out.reshape(bsz, m, -1)), k, v


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, P, k, ...] gathered along dim 2 with idx [B, P, j] -> [B, P, j, ...]."""
    shape = (*idx.shape, *x.shape[3:])
    full = idx.reshape(*idx.shape, *([1] * (x.dim() - 3))).expand(shape)
    return x.gather(2, full)


# Bytes of tree scores per chunk of positions: a node scores every prefix key ([nodes, heads, T] fp32, a few
# copies), so all positions at once grow as T^2 x heads (~4 GB per sample and depth at T = 4096, 64 heads, topk 2).
TREE_SCORE_BYTES = 256 << 20
_SCORE_COPIES = 4  # scores, their masked copy, the softmax and its concatenation with the ancestors'


def tree_chunk_positions(bsz: int, seq: int, heads: int, topk: int, max_bytes: int = TREE_SCORE_BYTES) -> int:
    """Positions per row simulated at once so that the nodes' prefix scores stay within ``max_bytes``."""
    per_position = bsz * topk * heads * seq * 4 * _SCORE_COPIES
    return max(1, max_bytes // max(per_position, 1))


@torch.no_grad()
def simulate_tree(
    drafter: Eagle3Drafter,
    step0: Step0,
    *,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    target_ids: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    num_draft_tokens: int,
    steps: int,
    max_score_bytes: int = TREE_SCORE_BYTES,
) -> TreeResult:
    """Greedy acceptance of SGLang-style EAGLE trees at the positions marked in ``positions`` [B, T].

    A position's tree depends only on step 0's state, so the positions run in chunks
    (``tree_chunk_positions``) and memory stays bounded whatever T; results come in (sample, position) order."""
    if drafter.config.block:
        raise ValueError("simulate_tree: a dflash drafter drafts one block, no tree (vLLM's DFlash proposer)")
    if drafter.config.parallel:
        raise ValueError("simulate_tree: a p-eagle drafter drafts one chain in one pass (vLLM's parallel drafting "
                         "has no tree); evaluate it as a chain")
    bsz, seq = input_ids.shape
    heads = drafter.midlayer.self_attn.num_heads
    chunk = tree_chunk_positions(bsz, seq, heads, max(topk, 1), max_score_bytes)
    rank = positions.to(torch.int64).cumsum(1) - 1  # each marked position's place in its row
    width = int(positions.sum(1).max()) if bsz else 0
    if width <= chunk:
        return _simulate_tree(drafter, step0, input_ids=input_ids, loss_mask=loss_mask, target_ids=target_ids,
                              positions=positions, topk=topk, num_draft_tokens=num_draft_tokens, steps=steps)
    parts = [_simulate_tree(drafter, step0, input_ids=input_ids, loss_mask=loss_mask, target_ids=target_ids,
                            positions=positions & (rank >= a) & (rank < a + chunk), topk=topk,
                            num_draft_tokens=num_draft_tokens, steps=steps) for a in range(0, width, chunk)]
    sample = torch.cat([p.sample for p in parts])
    position = torch.cat([p.position for p in parts])
    order = torch.argsort(sample * seq + position)
    return TreeResult(sample=sample[order], position=position[order],
                      accepted=torch.cat([p.accepted for p in parts])[order],
                      reason=torch.cat([p.reason for p in parts])[order])


def _simulate_tree(
    drafter: Eagle3Drafter,
    step0: Step0,
    *,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    target_ids: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    num_draft_tokens: int,
    steps: int,
) -> TreeResult:
    """simulate_tree over the positions given, all at once."""
    if topk < 1 or steps < 1:
        raise ValueError(f"simulate_tree: topk and steps must be >= 1, got topk={topk}, steps={steps}")
    n_cand = topk + (steps - 1) * topk * topk
    if not 2 <= num_draft_tokens <= n_cand + 1:
        raise ValueError(
            f"simulate_tree: num_draft_tokens={num_draft_tokens} must be in [2, {n_cand + 1}] "
            f"(topk {topk}, steps {steps} give {n_cand} candidate nodes + the root)"
        )
    mask = step0.attention_mask
    device = input_ids.device
    bsz, seq = input_ids.shape
    vd = step0.logits.shape[-1]
    if topk > vd:
        raise ValueError(f"simulate_tree: topk={topk} exceeds the draft vocab size {vd}")
    counts = positions.sum(1)
    width = int(counts.max()) if bsz else 0
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    if width == 0:
        return TreeResult(sample=empty, position=empty, accepted=empty, reason=empty)
    # [B, P] padded list of positions per row
    order = torch.sort(positions.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :width]
    valid = torch.arange(width, device=device)[None] < counts[:, None]
    pos = torch.where(valid, order, torch.zeros_like(order))  # [B, P]
    bidx = torch.arange(bsz, device=device)[:, None].expand_as(pos)

    k0, v0 = step0.cache.keys[0], step0.cache.values[0]
    visible = (torch.arange(seq, device=device)[None, None] <= pos[..., None]) & mask[:, None, :]  # [B, P, T]
    attn = drafter.midlayer.self_attn
    nkv, hd, hv = attn.num_kv_heads, attn.qk_head_dim, attn.v_head_dim

    probs = torch.softmax(step0.logits[bidx, pos].float(), -1)  # [B, P, Vd]
    score, did = probs.topk(topk, dim=-1)  # [B, P, k]
    tok = drafter.draft_to_target(did)
    cand_score, cand_tok = [score], [tok]
    cand_parent = [torch.full_like(did, -1)]
    front_score, front_tok = score, tok
    front_idx = torch.arange(topk, device=device).expand_as(did)
    front_hidden = step0.hidden[bidx, pos][:, :, None].expand(-1, -1, topk, -1)  # [B, P, k, H]
    anc_k = k0.new_zeros((bsz, width, topk, 0, nkv, hd))
    anc_v = v0.new_zeros((bsz, width, topk, 0, nkv, hv))
    m = width * topk

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, P, k, ...] -> [B, P*k, ...]
        return x.reshape(bsz, m, *x.shape[3:])

    for depth in range(2, steps + 1):
        vis = visible[:, :, None].expand(-1, -1, topk, -1).reshape(bsz, m, seq)
        h, key, val = _node_step(
            drafter,
            flat(front_tok),
            flat(front_hidden),
            flat((pos + depth - 1)[:, :, None].expand(-1, -1, topk)),
            (k0, v0, vis),
            flat(anc_k),
            flat(anc_v),
        )
        h = h.view(bsz, width, topk, -1)
        key = key.view(bsz, width, topk, 1, nkv, hd)
        val = val.view(bsz, width, topk, 1, nkv, hv)
        cp, ci = torch.softmax(drafter.compute_logits(h).float(), -1).topk(topk, dim=-1)  # [B, P, k, k]
        exp_score = (front_score[..., None] * cp).reshape(bsz, width, topk * topk)
        exp_tok = drafter.draft_to_target(ci).reshape(bsz, width, topk * topk)
        offset = topk + (depth - 2) * topk * topk
        cand_score.append(exp_score)
        cand_tok.append(exp_tok)
        cand_parent.append(front_idx[..., None].expand(-1, -1, -1, topk).reshape(bsz, width, topk * topk))
        front_score, pick = exp_score.topk(topk, dim=-1)  # the next frontier
        slot = torch.div(pick, topk, rounding_mode="floor")  # parent's place in the old frontier
        front_tok = exp_tok.gather(-1, pick)
        front_idx = offset + pick
        front_hidden = _gather(h, slot)
        anc_k = torch.cat((anc_k, key), dim=3)  # slot j keeps slot j's keys, whoever its parent is
        anc_v = torch.cat((anc_v, val), dim=3)

    scores = torch.cat(cand_score, -1)  # [B, P, C]
    toks = torch.cat(cand_tok, -1)
    parents = torch.cat(cand_parent, -1)
    chosen = scores.topk(num_draft_tokens - 1, dim=-1).indices
    selected = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)

    end_ok, path_ok = evaluable(input_ids, loss_mask, mask, target_ids, steps)
    rows = rows_for_steps(target_ids.to(torch.int64), steps, -1)
    end_ok, path_ok, rows = end_ok[bidx, pos], path_ok[bidx, pos], rows[bidx, pos]  # [B, P, K]
    cur = torch.full((bsz, width), -1, dtype=torch.int64, device=device)
    alive = torch.ones_like(cur, dtype=torch.bool)
    n = torch.zeros_like(cur)
    reason = torch.full_like(cur, FULL)
    for depth in range(1, steps + 1):
        lo = 0 if depth == 1 else topk + (depth - 2) * topk * topk
        hi = topk if depth == 1 else lo + topk * topk
        k = depth - 1
        match = (parents[..., lo:hi] == cur[..., None]) & selected[..., lo:hi] & (toks[..., lo:hi] == rows[..., k, None])
        ev = end_ok[..., k] & path_ok[..., k]
        hit = alive & ev & match.any(-1)
        stop = alive & ~hit
        r = torch.where(~end_ok[..., k], torch.full_like(cur, END),
                        torch.where(~path_ok[..., k], torch.full_like(cur, OFF_PATH), torch.full_like(cur, MISS)))
        reason = torch.where(stop, r, reason)
        cur = torch.where(hit, lo + match.to(torch.float32).argmax(-1), cur)
        n = n + hit.to(torch.int64)
        alive = hit
    return TreeResult(sample=bidx[valid], position=pos[valid], accepted=n[valid], reason=reason[valid])
