"""DFlash, the block drafter (``DrafterConfig.method`` "dflash"): vLLM 0.32's ``DFlashDraftModel``, in its names.

What the engine computes (``model_executor/models/qwen3_dflash.py`` and ``v1/spec_decode/dflash.py``), per
request, once the target has verified tokens ``0..p`` and produced the next token ``x[p+1]``:

    c_t   = hidden_norm(fc(cat(aux_t)))                  for every verified position t <= p
    layer l's keys/values at t: k_norm(k_proj_l(c_t)) roped at t, v_proj_l(c_t)  (no layer runs on c_t)
    block = [x[p+1], M, .., M] at positions p+1 .. p+1+K   (M = mask_token_id, K drafts)
    h     = embed(block);  per layer: h += o_proj(attn(input_layernorm(h)));  h += mlp(post_attention_layernorm(h))
            attn: q_norm/k_norm per head, rope, every block row attends to every c_t and to the WHOLE block
    draft j (1..K) = argmax lm_head(norm(h))[j]            the token at position p+1+j, its own position

All K drafts come from one pass; none reads another's token. So, in redraft's alignment (redraft.core.alignment), the
drafting row ``t = p`` gives step ``k = j - 1`` its state from block row ``j``, verified by teacher row
``t + 1 + k``: training (train.ttt) and simulation (eval.simulate) take :meth:`DFlashDrafter.block_states` for the
K states an EAGLE drafter would unroll, and everything after (the head's loss, the chain's scoring, the walk) is
shared. The blocks of every drafting row of a sequence are computed at once, in chunks of rows whose scores stay
within :data:`BLOCK_SCORE_BYTES`.

Parameter names are vLLM's (its loader prefixes ``model.`` to all but ``lm_head`` and ``d2t``): ``fc``,
``hidden_norm``, ``layers.{i}.{input_layernorm,post_attention_layernorm}``,
``layers.{i}.self_attn.{q,k,v,o}_proj``, ``layers.{i}.self_attn.{q,k}_norm``, ``layers.{i}.mlp.{gate,up,down}_proj``,
``norm``, ``lm_head``, ``d2t``/``t2d``. The embedding is the target's (frozen, never saved).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.modeling import DrafterBase, DrafterMLP, RMSNorm
from redraft.core.drafter.rope import Rope

# bytes of attention scores one chunk of drafting rows may hold (fp32; recomputed in the backward when a
# sequence takes several chunks)
BLOCK_SCORE_BYTES = 64 * 2**20


class DFlashAttention(nn.Module):
    """Qwen3's attention as DFlash uses it: q/k/v from the H-wide layer input, RMSNorm per head on q and k before
    rope (NeoX halves), grouped kv heads, no biases."""

    def __init__(self, cfg: DrafterConfig, rope: Rope) -> None:
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.rope = rope  # shared, not a module (its fp32 tables must not follow .to(dtype))

    def keys_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(k [.., n_kv, hd] normed and roped, v [.., n_kv, hd]) of x [.., H]; cos/sin [.., hd]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        k = self.rope.apply(k, cos.to(k.dtype)[..., None, :], sin.to(k.dtype)[..., None, :])
        return k, self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q [.., n_kv, groups, hd] of x [.., H], normed and roped, grouped by kv head (as repeat_kv does)."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        q = self.rope.apply(q, cos.to(q.dtype)[..., None, :], sin.to(q.dtype)[..., None, :])
        return q.unflatten(-2, (self.num_kv_heads, self.num_heads // self.num_kv_heads))


class DFlashLayer(nn.Module):
    """One Qwen3 pre-norm decoder layer whose attention also reads the context's keys and values."""

    def __init__(self, cfg: DrafterConfig, rope: Rope) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
        visible: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """h [B, R, S, H] (R drafting rows, S = K + 1 block slots) -> the layer's output, same shape.

        ``context`` = (k, v) [B, T, n_kv, hd], this layer's projection of every position's context state;
        ``visible`` [B, R, T] bool: the context positions row r's block sees (positions <= its row, real)."""
        x = self.input_layernorm(h)
        attn = self.self_attn
        q = attn.queries(x, cos, sin)  # [B, R, S, n_kv, g, hd]
        k_blk, v_blk = attn.keys_values(x, cos, sin)  # [B, R, S, n_kv, hd]
        k_ctx, v_ctx = context
        s_ctx = torch.einsum("brsngd,btnd->brsngt", q, k_ctx) * scale
        s_ctx = s_ctx.masked_fill(~visible[:, :, None, None, None, :], torch.finfo(s_ctx.dtype).min)
        s_blk = torch.einsum("brsngd,brund->brsngu", q, k_blk) * scale  # the whole block: no causal mask
        probs = torch.softmax(torch.cat((s_ctx, s_blk), dim=-1).float(), dim=-1).to(q.dtype)
        p_ctx, p_blk = probs.split([k_ctx.shape[1], k_blk.shape[2]], dim=-1)
        out = torch.einsum("brsngt,btnd->brsngd", p_ctx, v_ctx) + torch.einsum("brsngu,brund->brsngd", p_blk, v_blk)
        h = h + attn.o_proj(out.flatten(-3))
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(DrafterBase):
    """The block drafter: ``num_layers`` DFlash layers over the target's states injected as keys and values."""

    def __init__(self, config: DrafterConfig, attention_impl: str = "eager") -> None:
        """``attention_impl`` is accepted for the common constructor; DFlash's block attention has one form."""
        super().__init__()
        if not config.block:
            raise ValueError(f"DFlashDrafter: method {config.method!r} is not 'dflash' (redraft.core.drafter.build_drafter)")
        c = config
        self._init_embedding(c)
        self.fc = nn.Linear(c.num_aux_layers * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rope = Rope(c)
        self.layers = nn.ModuleList(DFlashLayer(c, self.rope) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self._init_head(c)

    attention_impl = "eager"

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated aux layers [.., n_aux*Ht] -> [.., H] (vLLM's ``combine_hidden_states``)."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def logit_input(self, state: torch.Tensor) -> torch.Tensor:
        """A block state is already ``norm(h)``, the tensor lm_head reads."""
        return state

    def compute_logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.lm_head(state)

    def block_states(
        self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, attention_mask: torch.Tensor | None, steps: int,
        score_bytes: int | None = None,
    ) -> list[torch.Tensor]:
        """``steps`` states [B, T, H]: state k at row t is ``norm(h)`` of block slot k + 1 for the block drafted after
        row t (context rows <= t, token t + 1 at position t + 1, masks after it). Right-padded [B, T] inputs;
        rows whose token t + 1 is padding get a block of token 0 (never counted)."""
        if steps < 1:
            raise ValueError(f"DFlashDrafter.block_states: steps must be >= 1, got {steps}")
        bsz, seq = input_ids.shape
        device = input_ids.device
        real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.to(torch.bool))
        ids = input_ids.to(torch.int64).masked_fill(~real, 0)
        pos = torch.arange(seq, device=device)
        ctx = self.hidden_norm(self.project(aux_hidden))
        cos, sin = self.rope.cos_sin(pos.expand(bsz, seq), torch.float32)
        context = [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]
        slots = steps + 1
        heads = self.config.num_attention_heads
        budget = BLOCK_SCORE_BYTES if score_bytes is None else score_bytes
        rows_per_chunk = max(1, budget // max(1, 4 * bsz * slots * heads * (seq + slots)))
        out: list[list[torch.Tensor]] = [[] for _ in range(steps)]
        # With several chunks each one's scores would be kept for the backward, together [T, T]-sized: recompute
        # them there instead (memory linear in T; one more forward of the blocks).
        recompute = torch.is_grad_enabled() and seq > rows_per_chunk
        for r0 in range(0, seq, rows_per_chunk):
            rows = pos[r0:r0 + rows_per_chunk]  # drafting rows t
            if recompute:
                states = checkpoint(self._blocks, ids, real, rows, slots, context, use_reentrant=False)
            else:
                states = self._blocks(ids, real, rows, slots, context)  # [B, R, S, H]
            for k in range(steps):
                out[k].append(states[:, :, k + 1])
        return [torch.cat(chunks, dim=1) for chunks in out]

    def _blocks(
        self, ids: torch.Tensor, real: torch.Tensor, rows: torch.Tensor, slots: int,
        context: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """norm(h) [B, R, S, H] of the blocks drafted after ``rows`` [R]."""
        bsz, seq = ids.shape
        nxt = rows + 1
        first = torch.where(nxt < seq, ids[:, nxt.clamp(max=seq - 1)], torch.zeros_like(ids[:, :1]))  # [B, R]
        block = torch.full((bsz, rows.numel(), slots), int(self.config.mask_token_id), dtype=torch.int64,
                           device=ids.device)
        block[:, :, 0] = first
        positions = (nxt[:, None] + torch.arange(slots, device=ids.device)).expand(bsz, -1, -1)  # [B, R, S]
        cos, sin = self.rope.cos_sin(positions.reshape(bsz, -1), torch.float32)
        cos, sin = cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)
        visible = (torch.arange(seq, device=ids.device)[None, :] <= rows[:, None])[None] & real[:, None, :]
        h = self.embed_tokens(block).to(self.fc.weight.dtype)
        scale = self.rope.softmax_scale
        for layer, ctx in zip(self.layers, context, strict=True):
            h = layer(h, cos, sin, ctx, visible, scale)
        return self.norm(h)
