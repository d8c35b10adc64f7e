"""The one EAGLE-3 drafter definition; training, evaluation and export all build it from here.

Parameter and buffer names are the serving names (SGLang/vLLM ``LlamaForCausalLMEagle3`` and
``Eagle3DeepseekV2ForCausalLM``, and SpecForge's checkpoint layout), so a state dict goes to a checkpoint
without renaming: ``fc``, ``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}``, the
attention's own weights under ``midlayer.self_attn`` (``{q,k,v,o}_proj`` for attention "gqa";
``q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj`` for "mla"),
``midlayer.mlp.{gate,up,down}_proj``, ``norm``, ``lm_head`` and the buffers ``d2t`` (offsets, target id =
draft id + d2t[draft id]) and ``t2d`` (bool mask over the target vocab). ``embed_tokens`` is the target's
frozen input embedding; serving replaces it with the target's own, so it is never saved. The attention
kind is chosen by ``DrafterConfig.attention`` (one class per kind, as transformers' modeling files do);
everything around it is the same module.

One step, :meth:`Eagle3Drafter.forward` (the math matches SpecForge 0.2.0 to fp32 rounding: the conformance
lane's SpecForge half, conformance/specforge_ref.py):

    x  = cat(input_layernorm(embed(ids)), hidden_norm(h))          # embedding first, width 2H
    h1 = h + o_proj(attention(x))                                   # residual over the un-normed h
    h2 = h1 + down(act(gate(y)) * up(y)),  y = post_attention_layernorm(h1)
    logits = lm_head(norm(h2))                                      # h2 (pre-norm) is fed back

EAGLE-3.1 (``DrafterConfig.method``) changes two lines, as SGLang and vLLM read ``fc_norm`` and ``norm_output``:

    h  = fc(cat(fc_norm[i](aux_i) for each aux layer i))           # not fc(cat(aux_i))
    norm(h2) is fed back                                            # the tensor lm_head reads

P-EAGLE (``method`` "p-eagle", vLLM's ``parallel_drafting``) changes what steps 1..K-1 read, not how they
attend (:meth:`Eagle3Drafter.step_inputs`): the placeholder ``mask_token_id`` and ``fc(mask_hidden)``, the same
for every slot, instead of the previous draft and state. vLLM puts those K-1 slots at positions p+1..p+K-1 after
the bonus slot at p, in one causal pass: slot k sees the prefix up to p and slots 1..k, the TTT cache's pattern.
``mask_hidden`` is pre-``fc`` (width n_aux * target hidden), as vLLM's loader and ``combine_hidden_states`` take it.

Attention runs over a :class:`~redraft.core.drafter.ttt_attention.TTTCache` (causal over the first
step's keys, plus each later step's same-position key): the training-time-test unroll and an
engine's chain drafting see the same pattern, so training (train.ttt) and offline evaluation
(eval.simulate) call the same forward.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers.activations import ACT2FN

from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.names import EMBED_KEY, canonical_key
from redraft.core.drafter.rope import Rope
from redraft.core.drafter.sequence_parallel import SequenceParallel, heads_to_rows, rows_to_heads
from redraft.core.drafter.ttt_attention import ATTENTION_IMPLS, TTTCache, ttt_attention
from redraft.core.drafter.vocab import check_vocab_mapping
from redraft.core.target_weights import read_target_tensor

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the input dtype (as SpecForge and HF Llama do)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class _TTTAttentionLayer(nn.Module):
    """What both attention kinds share: rotated q/k and v from :meth:`project`, then the TTT attention and o_proj.

    ``project`` returns q [B, T, n_kv, groups, qk_head_dim] (grouped by kv head, as repeat_kv does), k
    [B, T, n_kv, qk_head_dim] and v [B, T, n_kv, v_head_dim], so every attention pattern (the TTT cache
    here, the tree mask in eval.simulate) shares one projection per kind.
    """

    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    o_proj: nn.Linear

    def __init__(self, rope: Rope, impl: str) -> None:
        super().__init__()
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
        self.impl = impl
        self.rope = rope  # shared with the drafter; not a module (its fp32 tables must not follow .to(dtype))
        # set for a sequence-parallel training run (Eagle3Drafter.set_sequence_parallel): this rank holds T / size
        # rows, and attention runs on every row of 1 / size of the kv heads between two all-to-alls
        self.sequence_parallel: SequenceParallel | None = None

    @property
    def softmax_scale(self) -> float:
        return self.rope.softmax_scale

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: TTTCache,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """o_proj(attention) [B, T, H]; this step's keys and values are appended to ``cache``.

        Sequence parallel: x holds this rank's rows, ``attention_mask`` every row; the cache holds every row of
        this rank's kv heads."""
        q, k, v = self.project(x, cos, sin)
        sp = self.sequence_parallel
        if sp is None:
            return self.o_proj(ttt_attention(q, k, v, cache, attention_mask, self.impl, self.softmax_scale))
        q, k, v = (rows_to_heads(t, sp) for t in (q, k, v))
        out = ttt_attention(q, k, v, cache, attention_mask, self.impl, self.softmax_scale)  # [B, T, heads/P * hv]
        out = heads_to_rows(out.view(*out.shape[:2], k.shape[2], -1), sp)  # [B, T/P, n_kv, groups * hv]
        return self.o_proj(out.flatten(2))


class LlamaAttention(_TTTAttentionLayer):
    """attention "gqa": q/k/v read the 2H-wide [embedding, hidden] concatenation; GQA; NeoX RoPE; no biases."""

    def __init__(self, cfg: DrafterConfig, rope: Rope, impl: str = "eager") -> None:
        super().__init__(rope, impl)
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads = nh, nkv
        self.qk_head_dim = self.v_head_dim = hd
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q, k and v from x [B, T, 2H]; ``cos``/``sin`` [B, T, hd] come in fp32 and are cast to the
        projections' dtype (autocast may make it lower than the input's)."""
        bsz, seq = x.shape[:2]
        nkv, hd = self.num_kv_heads, self.qk_head_dim
        q = self.q_proj(x).view(bsz, seq, nkv, self.num_heads // nkv, hd)
        k = self.k_proj(x).view(bsz, seq, nkv, hd)
        v = self.v_proj(x).view(bsz, seq, nkv, hd)
        cos_k, sin_k = cos.to(q.dtype)[:, :, None], sin.to(q.dtype)[:, :, None]
        k = self.rope.apply(k, cos_k, sin_k)
        q = self.rope.apply(q, cos_k[:, :, None], sin_k[:, :, None])
        return q, k, v


class MLAAttention(_TTTAttentionLayer):
    """attention "mla": DeepSeek's multi-head latent attention over the 2H-wide [embedding, hidden] input.

    As vLLM's ``DeepseekV2MLAAttention`` and SGLang's ``DeepseekV2AttentionMLA`` compute it (weights under
    their names): ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` split per head into a nope and a rope part;
    ``[c_kv | k_pe] = kv_a_proj_with_mqa(x)``; ``[k_nope | v] = kv_b_proj(kv_a_layernorm(c_kv))`` per head;
    one rope key ``k_pe`` shared by every head. Rope runs on the rope parts in interleaved pairs. Training
    uses this expanded form; the engines absorb kv_b_proj into q and o for decoding, the same function.
    """

    def __init__(self, cfg: DrafterConfig, rope: Rope, impl: str = "eager") -> None:
        super().__init__(rope, impl)
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = self.num_kv_heads = nh
        self.nope_dim, self.rope_dim = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim)
        self.kv_lora_rank = int(cfg.kv_lora_rank)
        self.qk_head_dim, self.v_head_dim = self.nope_dim + self.rope_dim, int(cfg.v_head_dim)
        self.q_a_proj = nn.Linear(2 * h, int(cfg.q_lora_rank), bias=False)
        self.q_a_layernorm = RMSNorm(int(cfg.q_lora_rank), cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(int(cfg.q_lora_rank), nh * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, nh * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_head_dim, h, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, heads, 1, nope + rope], k [B, T, heads, nope + rope], v [B, T, heads, v_head_dim] from x;
        ``cos``/``sin`` [B, T, qk_rope_head_dim] in fp32."""
        bsz, seq = x.shape[:2]
        nh = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(bsz, seq, nh, self.qk_head_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(bsz, seq, nh, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        cos_k, sin_k = cos.to(q.dtype)[:, :, None], sin.to(q.dtype)[:, :, None]
        q_pe = self.rope.apply(q_pe, cos_k, sin_k)
        k_pe = self.rope.apply(k_pe[:, :, None], cos_k, sin_k).expand(-1, -1, nh, -1)
        q = torch.cat((q_nope, q_pe), dim=-1)[:, :, :, None]
        k = torch.cat((k_nope, k_pe), dim=-1)
        return q, k, v.contiguous()


ATTENTION_CLASSES: dict[str, type[_TTTAttentionLayer]] = {"gqa": LlamaAttention, "mla": MLAAttention}


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(y)) * self.up_proj(y))


class DrafterLayer(nn.Module):
    """The one decoder layer ("midlayer"): attention over [norm(embedding), norm(hidden)], then the MLP."""

    def __init__(self, cfg: DrafterConfig, rope: Rope, attention_impl: str = "eager") -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = ATTENTION_CLASSES[cfg.attention](cfg, rope, attention_impl)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def attention_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """x = cat(input_layernorm(embedding), hidden_norm(hidden)) [B, T, 2H]: the embedding comes first."""
        return torch.cat((self.input_layernorm(emb.to(hidden.dtype)), self.hidden_norm(hidden)), dim=-1)

    def feed_forward(self, h1: torch.Tensor) -> torch.Tensor:
        """h2 = h1 + mlp(post_attention_layernorm(h1))."""
        return h1 + self.mlp(self.post_attention_layernorm(h1))

    def forward(
        self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: TTTCache,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """h2 [B, T, H]: residual over the un-normed ``hidden``."""
        h1 = hidden + self.self_attn(self.attention_input(emb, hidden), cos, sin, cache, attention_mask)
        return self.feed_forward(h1)


class DrafterBase(nn.Module):
    """What every drafter kind shares around its layers: the target's frozen embedding, ``fc`` over the aux layers,
    the draft-vocab ``lm_head`` with its ``d2t``/``t2d`` mapping, and the serving state dict under the engines'
    names. A kind (:class:`Eagle3Drafter`, :class:`redraft.core.drafter.dflash.DFlashDrafter`) builds its layers between."""

    config: DrafterConfig

    def _init_embedding(self, c: DrafterConfig) -> None:
        """embed_tokens (frozen). Modules are made in a fixed order (embedding, the kind's layers, head): a seed's
        draws go to them in that order."""
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)

    def _init_head(self, c: DrafterConfig) -> None:
        """lm_head over the draft vocab and the d2t/t2d buffers; last."""
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # identity mapping until set_vocab_mapping: valid only when Vd == V, which is the point
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def canonical_key(self, key: str) -> str:
        """Our name for a foreign spelling of a weight's name (SGLang's ``model.`` prefix, ``layers.0.``)."""
        return canonical_key(key, self.config.block)

    # ------------------------------------------------------------------ state
    def serving_state_dict(self) -> dict[str, torch.Tensor]:
        """Exactly the keys a serving checkpoint holds (no embed_tokens), contiguous and detached."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if k != EMBED_KEY}

    def load_serving_state_dict(self, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load serving weights; ``embed_tokens.weight`` may be present or absent.

        Also accepts SGLang-style names (``model.`` prefix, ``layers.0.`` for ``midlayer.``).
        Shape mismatches are always errors; missing/unexpected keys are errors when strict.
        """
        own = self.state_dict()
        normalised: dict[str, torch.Tensor] = {}
        for key, tensor in sd.items():
            name = self.canonical_key(key)
            if name in normalised:
                raise ValueError(f"load_serving_state_dict: keys {key!r} and another both map to {name!r}")
            normalised[name] = tensor
        expected = set(own) - {EMBED_KEY}
        missing = sorted(expected - set(normalised))
        unexpected = sorted(set(normalised) - set(own))
        bad_shapes = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                      for k, v in normalised.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
        problems = []
        if bad_shapes:
            problems.append("shape mismatches: " + "; ".join(bad_shapes))
        if strict and missing:
            problems.append(f"missing keys: {missing}")
        if strict and unexpected:
            problems.append(f"unexpected keys: {unexpected}")
        if problems:
            raise ValueError("load_serving_state_dict: " + " | ".join(problems))
        if missing:
            log.warning("load_serving_state_dict: missing keys left as initialised: %s", missing)
        if unexpected:
            log.warning("load_serving_state_dict: ignoring unexpected keys: %s", unexpected)
        with torch.no_grad():
            for k, v in normalised.items():
                if k in own:
                    own[k].copy_(v.to(device=own[k].device))
        if "d2t" in normalised or "t2d" in normalised:
            check_vocab_mapping(self.d2t, self.t2d, self.config.vocab_size)

    def load_target_embedding(self, target_path: str | Path, key_candidates: Sequence[str]) -> str:
        """Copy the target's input embedding into embed_tokens, reading only that tensor.

        Looks in ``*.safetensors.index.json`` weight maps first, then in every ``*.safetensors``
        file of the folder (or the file itself). Returns the key used.
        """
        weight, key = read_target_tensor(target_path, key_candidates)
        want = tuple(self.embed_tokens.weight.shape)
        if tuple(weight.shape) != want:
            raise ValueError(f"load_target_embedding: {target_path}:{key} has shape {tuple(weight.shape)}, "
                             f"drafter wants {want}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.device))
        log.info("loaded target embedding %s from %s", key, target_path)
        return key

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        c = self.config
        if tuple(d2t.shape) != (c.draft_vocab_size,) or tuple(t2d.shape) != (c.vocab_size,):
            raise ValueError(
                f"set_vocab_mapping: got d2t {tuple(d2t.shape)} and t2d {tuple(t2d.shape)}, "
                f"drafter wants ({c.draft_vocab_size},) and ({c.vocab_size},)"
            )
        check_vocab_mapping(d2t, t2d, c.vocab_size)
        with torch.no_grad():
            self.d2t.copy_(d2t.to(torch.int64))
            self.t2d.copy_(t2d.to(torch.bool))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Engines' convention: target_id = draft_id + d2t[draft_id]."""
        return draft_ids + self.d2t[draft_ids]


class Eagle3Drafter(DrafterBase):
    """One-layer EAGLE-3 drafter (Llama-style layer whose attention reads [embedding, hidden])."""

    def __init__(self, config: DrafterConfig, attention_impl: str = "eager") -> None:
        """attention_impl: "eager" (explicit scores in blocks of query rows, SpecForge's sdpa-path math;
        the reference), "sdpa" (one causal torch SDPA call per step, no mask tensor, the diagonal keys
        joined through one extra key: the fused kernels; same math, other rounding) or "flex"
        (FlexAttention with the TTT block mask; fused on CUDA, forward only on a CPU). Each is linear
        in memory in the sequence length (redraft.core.drafter.ttt_attention)."""
        super().__init__()
        c = config
        self._init_embedding(c)
        if c.fc_norm:  # EAGLE-3.1: fc_norm.{i}.weight, one per aux layer (the engines' names)
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(c.num_aux_layers))
        self.fc = nn.Linear(c.num_aux_layers * c.target_hidden_size, c.hidden_size, bias=False)
        if c.parallel:  # P-EAGLE: the aux-width state every parallel slot reads (vLLM's name, pre-fc)
            self.mask_hidden = nn.Parameter(torch.randn(c.num_aux_layers * c.target_hidden_size) * 0.02)
        self.rope = Rope(c)
        self.midlayer = DrafterLayer(c, self.rope, attention_impl)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self._init_head(c)

    @property
    def attention_impl(self) -> str:
        return self.midlayer.self_attn.impl

    @attention_impl.setter
    def attention_impl(self, impl: str) -> None:
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
        self.midlayer.self_attn.impl = impl

    # ------------------------------------------------------------------ math
    def set_sequence_parallel(self, sp: SequenceParallel | None) -> None:
        """Train on T / sp.size rows per rank (redraft.core.drafter.sequence_parallel); None: every row here."""
        if sp is not None:
            sp.check_heads(self.midlayer.self_attn.num_kv_heads)
        self.midlayer.self_attn.sequence_parallel = sp

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated aux layers [.., n_aux*Ht] -> [.., H]; EAGLE-3.1 first norms each layer's
        chunk on its own (``fc_norm``, in the order the layers are concatenated: ascending ids)."""
        x = aux_hidden.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            chunks = x.chunk(self.config.num_aux_layers, dim=-1)
            x = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(x)

    def step_inputs(
        self, step: int, tokens: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, hidden) that step ``step`` >= 1 reads, given the chain's ``tokens`` [B, T] and the previous
        step's ``state`` [B, T, H]: those as they are (EAGLE-3, 3.1), or P-EAGLE's placeholder slot, the same
        for every position and step: ``mask_token_id`` and ``fc(mask_hidden)`` (through ``fc_norm`` if the method
        had it, as vLLM's ``combine_hidden_states``)."""
        if step < 1 or not self.config.parallel:
            return tokens, state
        ids = torch.full_like(tokens, int(self.config.mask_token_id))
        return ids, self.project(self.mask_hidden).to(state.dtype).expand_as(state)

    def output_state(self, h2: torch.Tensor) -> torch.Tensor:
        """What a step passes on, to the next step and to the logits: the layer's output h2 (EAGLE-3), or
        norm(h2) (EAGLE-3.1's ``norm_output``: the next step reads what lm_head reads)."""
        return self.norm(h2) if self.config.norm_output else h2

    def logit_input(self, state: torch.Tensor) -> torch.Tensor:
        """The tensor lm_head reads from a step's state: always norm(h2), so EAGLE-3.1's state as is."""
        return state if self.config.norm_output else self.norm(state)

    def compute_logits(self, state: torch.Tensor) -> torch.Tensor:
        """lm_head(norm(h2)) over the draft vocab, from a step's state (:meth:`output_state`)."""
        return self.lm_head(self.logit_input(state))

    def rope_cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, T, rotated dims] for integer positions, computed in fp32 then cast (redraft.core.drafter.rope)."""
        return self.rope.cos_sin(position_ids, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: TTTCache,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One midlayer application over [B, T] positions; returns its state (:meth:`output_state`: h2, or
        norm(h2) for EAGLE-3.1) and appends K/V to cache.

        With an empty cache the step attends causally over its own keys (masked by
        ``attention_mask`` [B, T], 1 = real token). Otherwise it attends causally over the
        cached first-step keys plus the same-position keys of every later step, this one included.
        """
        cos, sin = self.rope_cos_sin(position_ids, torch.float32)
        return self.output_state(self.midlayer(self.embed_tokens(input_ids), hidden, cos, sin, cache, attention_mask))

    def attention_inputs(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The midlayer up to attention, for attention patterns other than the TTT cache (eval.simulate's
        tree): rotated q [B, T, n_kv, groups, qk_head_dim], k [B, T, n_kv, qk_head_dim], v [B, T, n_kv, v_head_dim];
        the softmax scale is ``midlayer.self_attn.softmax_scale``."""
        mid = self.midlayer
        cos, sin = self.rope_cos_sin(position_ids, torch.float32)
        return mid.self_attn.project(mid.attention_input(self.embed_tokens(input_ids), hidden), cos, sin)

    def layer_output(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The midlayer after attention: o_proj, residual, MLP; ``attn_out`` [B, T, heads*v_head_dim] -> the step's
        state [B, T, H] (:meth:`output_state`)."""
        mid = self.midlayer
        return self.output_state(mid.feed_forward(hidden + mid.self_attn.o_proj(attn_out)))
