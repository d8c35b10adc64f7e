"""redraft's stand-in for ``sgl_kernel`` under SGLang 0.5.23 on a CPU: NOT SGLang's compiled kernels.

Only the SGLang CPU venv (``make sglang-cpu-venv``) puts this folder on the engine's path; a GPU machine
installs SGLang's own ``sgl_kernel`` and never sees it. It provides exactly the ops SGLang 0.5.23's CPU path
calls when the machine reports no AMX packing (no ``convert_weight_packed`` here, so every linear layer, norm
and MoE stays on SGLang's portable PyTorch code): the scheduler's and the EAGLE worker's bookkeeping ops, the
tree ops, and the two attention ops of the ``intel_amx`` attention backend. The ops themselves live in
:mod:`redraft.engines.sglang_cpu.ops`, each tested against SGLang's own Triton kernel of the same job.
"""

from __future__ import annotations

import torch

from redraft.engines.sglang_cpu import REDRAFT_STAND_IN
from redraft.engines.sglang_cpu.ops import attention, cache, tree

__version__ = REDRAFT_STAND_IN

# `from sgl_kernel import <name>` call sites (sglang/srt/mem_cache/allocation.py, sglang/kernels/ops/...).
assign_req_to_token_pool_cpu = cache.assign_req_to_token_pool
assign_extend_cache_locs_cpu = cache.assign_extend_cache_locs
assign_draft_cache_locs_contiguous_cpu = cache.assign_draft_cache_locs_contiguous
build_draft_decode_metadata_cpu = cache.build_draft_decode_metadata
fill_bonus_tokens_cpu = cache.fill_bonus_tokens
fill_accept_out_cache_loc_cpu = cache.fill_accept_out_cache_loc
copy_all_layer_kv_cache_cpu = cache.copy_all_layer_kv_cache
build_tree_kernel_efficient_cpu = tree.build_tree_kernel_efficient
verify_tree_greedy_cpu = tree.verify_tree_greedy

# `torch.ops.sgl_kernel.<name>` call sites (sglang/srt/layers/attention/intel_amx_backend.py).
_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
_LIB.define(
    "extend_attention_cpu(Tensor q, Tensor? k, Tensor? v, Tensor(a!) o, Tensor(b!) k_buffer, Tensor(c!) v_buffer, "
    "float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
    "Tensor extend_seq_lens, Tensor extend_start_loc, int? max_extend_len, float sm_scale, float logit_cap, "
    "bool is_cross, int sliding_window, Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"
)
_LIB.define(
    "decode_attention_cpu(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale, float v_scale, "
    "Tensor(c!) o, Tensor? k, Tensor? v, Tensor loc, Tensor(d!) attn_logits, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross, int sliding_window, "
    "Tensor? encoder_lens, Tensor? sinks) -> ()"
)
_LIB.impl("extend_attention_cpu", attention.extend_attention, "CPU")
_LIB.impl("decode_attention_cpu", attention.decode_attention, "CPU")
