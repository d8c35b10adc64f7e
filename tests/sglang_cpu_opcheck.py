"""Every op of redraft's CPU stand-in for ``sgl_kernel`` against SGLang 0.5.23's own kernel of the same job.

Run with the SGLang CPU venv's python, ``PYTHONPATH=<repo>:<repo>/redraft/engines/sglang_cpu/site`` (what
``tests/engine/sglang/test_sglang_cpu_ops.py`` does). SGLang's Triton kernels run on CPU tensors under the Triton
interpreter. The stand-in is reached the way SGLang's CPU path reaches it: ``SGLANG_USE_CPU_ENGINE=1`` makes
SGLang's own ``*_func`` wrappers call it (and the two attention ops get the ``intel_amx`` backend's argument
lists), so names, argument order and keywords are checked too. SGLang's Triton kernels are launched with the
grid and arguments their non-CPU branch passes.

The attention ops are also held to a plain reference written here from the math (float64, no code shared with
``redraft/engines/sglang_cpu/ops/attention.py``); the greedy verification to a plain walk of the tree read from
the tree mask and positions (not from the retrieve links the kernels walk).

Prints one JSON object on stdout: per op the cases run, mismatching cases (exact ops: any element differs;
float ops: relative difference above ``TOL``), the largest differences, the first mismatch, and for the tree
ops how much was accepted / branched, so a caller can tell the random cases were not all trivial. Exits
non-zero when a check could not finish (an exception: kept in that op's ``errors``, the other ops still run)
or SGLang is not wired to the stand-in; mismatches are reported, not an exit status.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: SGLang's kernels on CPU tensors
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's wrappers take their CPU branch: the stand-in
os.environ["TORCH_COMPILE_DISABLE"] = "1"  # select_top_k_tokens is torch.compile'd; eager is the same math

import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

TOL = 1e-5  # float ops: max |ours - theirs| / max |theirs|, fp32 against fp32 or float64
SEEDS = (0, 1, 2)
I32, I64 = torch.int32, torch.int64


class Stats:
    """One op's tally: cases, mismatching cases, largest differences, first mismatch, extra counters."""

    def __init__(self) -> None:
        self.cases = 0
        self.mismatches = 0
        self.elements_differing = 0
        self.max_abs_diff = 0.0
        self.max_rel_diff = 0.0
        self.first_mismatch: str | None = None
        self.errors: list[str] = []  # exceptions that cut this op's checks short
        self.extra: dict[str, Any] = {}

    def _bad(self, label: str) -> None:
        self.mismatches += 1
        if self.first_mismatch is None:
            self.first_mismatch = label

    def exact(self, label: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """One case of an integer/bitwise op: every named output equal, element for element and in dtype."""
        self.cases += 1
        bad = []
        for name, (ours, theirs) in pairs.items():
            if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
                bad.append(f"{name}: {tuple(ours.shape)}/{ours.dtype} vs "
                           f"{tuple(theirs.shape)}/{theirs.dtype}")
                continue
            differing = int((ours != theirs).sum())
            if differing:
                self.elements_differing += differing
                bad.append(f"{name}: {differing} elements, ours {ours.flatten()[:24].tolist()} "
                           f"theirs {theirs.flatten()[:24].tolist()}")
        if bad:
            self._bad(f"{label}: " + "; ".join(bad))
        return not bad

    def close(self, label: str, ours: torch.Tensor, theirs: torch.Tensor) -> float:
        """One float comparison (counted as a case by the caller); returns the relative difference."""
        diff = (ours.double() - theirs.double()).abs().max().item() if ours.numel() else 0.0
        scale = max(theirs.double().abs().max().item() if theirs.numel() else 0.0, 1e-6)
        rel = diff / scale
        finite = bool(torch.isfinite(ours).all())
        self.max_abs_diff = max(self.max_abs_diff, diff)
        self.max_rel_diff = max(self.max_rel_diff, rel if finite else float("inf"))
        if not finite or rel > TOL:
            self._bad(f"{label}: max abs diff {diff:.3e}, relative {rel:.3e}, finite {finite}")
        return rel

    def report(self) -> dict[str, Any]:
        return {"cases": self.cases, "mismatches": self.mismatches,
                "elements_differing": self.elements_differing,
                "max_abs_diff": self.max_abs_diff, "max_rel_diff": self.max_rel_diff,
                "first_mismatch": self.first_mismatch, "errors": self.errors, **self.extra}


def npow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def pick(rng: random.Random, *options: Any) -> Any:
    return rng.choice(options)


# --------------------------------------------------------------------------------------------- wiring
def wiring() -> dict[str, bool]:
    """SGLang's modules bound the stand-in's functions (not another ``sgl_kernel``); the ops are there."""
    import sgl_kernel
    from sglang.kernels.ops.kvcache import cache_move
    from sglang.kernels.ops.speculative import cache_locs, eagle, spec_tree
    from sglang.srt.mem_cache import allocation

    from redraft.engines.sglang_cpu import REDRAFT_STAND_IN

    bound = [  # (SGLang's module, the name it bound, the stand-in's export)
        (allocation, "assign_req_to_token_pool_cpu", "assign_req_to_token_pool_cpu"),
        (cache_locs, "assign_extend_cache_locs_cpu", "assign_extend_cache_locs_cpu"),
        (cache_locs, "assign_draft_cache_locs_contiguous_cpu", "assign_draft_cache_locs_contiguous_cpu"),
        (eagle, "fill_bonus_tokens_cpu", "fill_bonus_tokens_cpu"),
        (eagle, "fill_accept_out_cache_loc_cpu", "fill_accept_out_cache_loc_cpu"),
        (cache_move, "copy_all_layer_kv_cache_cpu", "copy_all_layer_kv_cache_cpu"),
        (spec_tree, "sgl_build_tree_kernel_efficient_cpu", "build_tree_kernel_efficient_cpu"),
        (spec_tree, "sgl_verify_tree_greedy_cpu", "verify_tree_greedy_cpu"),
    ]
    out = {f"{module.__name__.rsplit('.', 1)[1]}.{name}": getattr(module, name) is getattr(sgl_kernel, export)
           for module, name, export in bound if hasattr(sgl_kernel, export)}
    out.update({f"sgl_kernel.{export}": False for _, _, export in bound if not hasattr(sgl_kernel, export)})
    out["sgl_kernel is the stand-in"] = getattr(sgl_kernel, "__version__", None) == REDRAFT_STAND_IN
    out["sglang takes its CPU branch"] = bool(spec_tree._is_cpu and cache_locs._is_cpu and eagle._is_cpu)
    out["torch.ops.sgl_kernel.extend_attention_cpu"] = hasattr(torch.ops.sgl_kernel, "extend_attention_cpu")
    out["torch.ops.sgl_kernel.decode_attention_cpu"] = hasattr(torch.ops.sgl_kernel, "decode_attention_cpu")
    return out


# --------------------------------------------------------------------------------------------- cache ops
def check_assign_req_to_token_pool(rng: random.Random, g: torch.Generator, st: Stats, cases: int) -> None:
    """Scheduler's scatter of fresh slots into req_to_token (allocation.assign_req_to_token_pool_func)."""
    from sglang.srt.mem_cache import allocation

    for case in range(cases):
        bs, rows, width = rng.randint(1, 4), 6, pick(rng, 16, 40, 75)
        r2t_dtype, idx_dtype, off_dtype = pick(rng, I32, I64), pick(rng, I32, I64), pick(rng, I32, I64)
        req_to_token = torch.randint(0, 1000, (rows, width), generator=g).to(r2t_dtype)
        rpi = torch.tensor(rng.sample(range(rows), bs), dtype=idx_dtype)
        spans = [sorted((rng.randint(0, width), rng.randint(0, width))) for _ in range(bs)]
        spans[rng.randrange(bs)] = [rng.randint(0, width // 3), width]  # one long span (several 32-blocks)
        start = torch.tensor([s for s, _ in spans], dtype=off_dtype)
        end = torch.tensor([e for _, e in spans], dtype=off_dtype)
        out_cache_loc = torch.randint(1, 5000, (int((end - start).sum()),), generator=g)
        ours, theirs = req_to_token.clone(), req_to_token.clone()
        allocation.assign_req_to_token_pool_func(rpi, ours, start, end, out_cache_loc, bs)
        allocation.assign_req_to_token_pool[(bs,)](rpi, theirs, start, end, out_cache_loc, theirs.shape[1],
                                                   npow2(bs))
        st.exact(f"case {case} bs={bs} spans={spans} dtypes={r2t_dtype},{idx_dtype},{off_dtype}",
                 {"req_to_token": (ours, theirs)})


def check_assign_extend_cache_locs(rng: random.Random, g: torch.Generator, st: Stats, cases: int) -> None:
    """Verify's gather of each request's window (assign_extend_cache_locs_func, uniform) and the commit's
    ragged front gather (fill_front_out_cache_loc_func), both SGLang CPU call sites of the op."""
    from sglang.kernels.ops.speculative import cache_locs

    for case in range(cases):
        bs, rows, width, d = rng.randint(1, 4), 6, pick(rng, 24, 48, 80), rng.randint(2, 8)
        r2t_dtype, idx_dtype, off_dtype = pick(rng, I32, I64), pick(rng, I32, I64), pick(rng, I32, I64)
        req_to_token = torch.randint(0, 3000, (rows, width), generator=g).to(r2t_dtype)
        rpi = torch.tensor(rng.sample(range(rows), bs), dtype=idx_dtype)
        start = torch.tensor([rng.randint(0, width - d) for _ in range(bs)], dtype=off_dtype)
        end = start + d
        ours = cache_locs.assign_extend_cache_locs_func(rpi, req_to_token, start, end, bs, d, "cpu")
        theirs = torch.empty((bs * d,), dtype=I64)
        cache_locs.assign_extend_cache_locs[(bs,)](rpi, req_to_token, start, end, theirs,
                                                   req_to_token.shape[1], npow2(bs))
        st.exact(f"uniform case {case} bs={bs} d={d} start={start.tolist()}",
                 {"out_cache_loc": (ours, theirs)})

        # the commit's front gather: the first num_front[i] slots of request i's verify window
        window = torch.randint(1, 3000, (bs * d,), generator=g)
        num_front = torch.tensor([rng.randint(1, d) for _ in range(bs)], dtype=I32)
        size = bs * d
        ours, theirs = torch.zeros(size, dtype=I64), torch.zeros(size, dtype=I64)
        cache_locs.fill_front_out_cache_loc_func(num_front, window, ours)
        view = window.view(bs, -1)
        cache_locs.assign_extend_cache_locs[(bs,)](torch.arange(bs), view, torch.zeros_like(num_front),
                                                   num_front, theirs, view.shape[1], npow2(bs))
        st.exact(f"front case {case} num_front={num_front.tolist()}", {"front_out_cache_loc": (ours, theirs)})


def check_assign_draft_cache_locs(rng: random.Random, g: torch.Generator, st: Stats, cases: int) -> None:
    """The draft's slots per request (assign_draft_cache_locs_contiguous_func, eagle_worker_common)."""
    from sglang.kernels.ops.speculative import cache_locs

    for case in range(cases):
        bs, rows, width = rng.randint(1, 4), 6, 64
        topk, steps = rng.randint(1, 3), rng.randint(2, 4)
        r2t_dtype, idx_dtype, len_dtype = pick(rng, I32, I64), pick(rng, I32, I64), pick(rng, I32, I64)
        req_to_token = torch.randint(0, 3000, (rows, width), generator=g).to(r2t_dtype)
        rpi = torch.tensor(rng.sample(range(rows), bs), dtype=idx_dtype)
        seq_lens = torch.tensor([rng.randint(1, width - topk * steps) for _ in range(bs)], dtype=len_dtype)
        ours = torch.full((bs * topk * steps,), -5, dtype=I64)
        theirs = ours.clone()
        cache_locs.assign_draft_cache_locs_contiguous_func(rpi, req_to_token, seq_lens, ours, topk, steps)
        cache_locs.assign_draft_cache_locs_contiguous[(bs,)](
            rpi, req_to_token, seq_lens, theirs, req_to_token.shape[1], topk, steps, positions=None,
            mrope=None, BS=bs, WRITE_POSITIONS=False, WRITE_MROPE=False)
        st.exact(f"case {case} bs={bs} topk={topk} steps={steps} seq_lens={seq_lens.tolist()}",
                 {"out_cache_loc": (ours, theirs)})


def check_build_draft_decode_metadata(rng: random.Random, g: torch.Generator, st: Stats, cases: int) -> None:
    """The draft decode steps' KV rows: the stand-in's expanded req_to_token (intel_amx multi-step backend),
    read as that backend reads it, against SGLang's Triton ``generate_draft_decode_kv_indices`` (triton
    backend)."""
    import sgl_kernel
    from sglang.kernels.ops.speculative import cache_locs

    for case in range(cases):
        bs, rows, width = rng.randint(1, 4), 6, 64
        topk, steps = rng.randint(1, 3), rng.randint(2, 4)
        r2t_dtype = pick(rng, I32, I64)
        req_to_token = torch.randint(0, 3000, (rows, width), generator=g).to(r2t_dtype)
        rpi = torch.tensor(rng.sample(range(rows), bs), dtype=I64)
        seq_lens = torch.tensor([rng.randint(1, width - topk * steps) for _ in range(bs)], dtype=I64)
        table = sgl_kernel.build_draft_decode_metadata_cpu(req_to_token, rpi, seq_lens, topk, steps, width)
        n = bs * topk
        kv_indices = torch.full((steps, int(seq_lens.sum()) * topk + n * steps + 8), -5, dtype=I64)
        kv_indptr = torch.zeros((steps, n + 1), dtype=I32)
        positions = seq_lens.repeat_interleave(topk)
        cache_locs.generate_draft_decode_kv_indices[(steps, bs, topk)](
            rpi, req_to_token, seq_lens, kv_indices, kv_indptr, positions, req_to_token.shape[1],
            kv_indices.shape[1], kv_indptr.shape[1], npow2(bs), npow2(steps), npow2(n), 1, 0, 0,
            ENTRY_PAGE_SIZE=1, v2p=None, TRANSLATE=False)
        pairs = {}
        for step in range(steps):  # step s reads row b * topk + k up to seq_len + s + 1, in request order
            lens = (seq_lens.repeat_interleave(topk) + step + 1).tolist()
            ours = torch.cat([table[r, :length].to(I64) for r, length in enumerate(lens)])
            pairs[f"step {step}"] = (ours, kv_indices[step, :sum(lens)])
        st.exact(f"case {case} bs={bs} topk={topk} steps={steps} seq_lens={seq_lens.tolist()}", pairs)


def check_copy_all_layer_kv_cache(rng: random.Random, g: torch.Generator, st: Stats, cases: int) -> None:
    """KV rows moved across every layer's buffers (copy_all_layer_kv_cache_func, memory_pool.move_kv_cache),
    with sources and targets overlapping as the commit's move makes them."""
    for case in range(cases):
        layers, slots = rng.randint(1, 3), 48
        dtype = pick(rng, torch.float32, torch.bfloat16, torch.float16)
        heads, dim = pick(rng, (1, 8), (2, 24), (1, 576), (4, 64))
        pool = [torch.randn((slots, heads, dim), generator=g).to(dtype) for _ in range(2 * layers)]
        n = rng.randint(1, 12)
        window = rng.sample(range(1, slots), min(slots - 1, n + rng.randint(0, 6)))
        tgt = torch.tensor(window[:n], dtype=I64)
        src = torch.tensor(rng.sample(window, n), dtype=I64)  # overlapping sets, in another order
        _copy_both(st, f"case {case} {layers} layers {dtype} {heads}x{dim} tgt={tgt.tolist()} "
                       f"src={src.tolist()}", pool, tgt, src)


def _kv_copy_config(stride_bytes: int) -> dict[str, int]:
    """memory_pool's _kv_copy_config, from the first buffer's row size."""
    per_tile = 512 if stride_bytes >= 8192 else 256 if stride_bytes >= 4096 else 128
    return {"bytes_per_tile": per_tile, "byte_tiles": (stride_bytes + per_tile - 1) // per_tile,
            "num_warps": 4 if per_tile <= 256 else 8, "num_locs_upper": 128 if per_tile >= 512 else 256}


def _copy_both(st: Stats, label: str, pool: list[torch.Tensor], tgt: torch.Tensor, src: torch.Tensor) -> None:
    from sglang.kernels.ops.kvcache import cache_move

    ours, theirs = [b.clone() for b in pool], [b.clone() for b in pool]

    def pointers(bufs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
                torch.tensor([b.stride(0) * b.dtype.itemsize for b in bufs]))

    ptrs, strides = pointers(ours)
    cfg = _kv_copy_config(int(strides[0]))
    n = tgt.numel()
    cache_move.copy_all_layer_kv_cache_func(ptrs, strides, tgt, src, n, npow2(n), cfg)
    ptrs, strides = pointers(theirs)
    cache_move.copy_all_layer_kv_cache_tiled[(ptrs.numel(), cfg["byte_tiles"])](
        ptrs, strides, tgt, src, n, npow2(n), BYTES_PER_TILE=cfg["bytes_per_tile"],
        num_warps=cfg["num_warps"], num_stages=2)
    st.exact(label, {f"buffer {i}": (a.view(torch.uint8), b.view(torch.uint8))
                     for i, (a, b) in enumerate(zip(ours, theirs, strict=True))})


# --------------------------------------------------------------------------------------------- trees
def draft_tree(rng: random.Random, g: torch.Generator, bs: int, topk: int, steps: int, num_draft: int,
               vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parent_list, top_scores_index, draft_tokens) as SGLang's EAGLE worker (eagle_worker_v2.draft_forward)
    makes them, with random draft distributions: topk 1 takes the worker's preallocated chain, topk > 1 its
    select_top_k_tokens / organize_draft_results."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens
    from sglang.srt.utils.common import fast_topk

    def proposal(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.randn((rows, vocab), generator=g) * pick(rng, 0.5, 2.0, 4.0)
        return fast_topk(torch.softmax(logits, dim=-1), topk, dim=-1)

    if topk == 1:  # base_spec_worker's _topk1_parents_prealloc / _topk1_score_indices_prealloc
        parent_width = steps if steps > 1 else 0
        parent_list = torch.arange(-1, parent_width - 1, dtype=I64).repeat(bs, 1)
        top_scores_index = torch.arange(steps, dtype=I64).repeat(bs, 1)
        tokens = [proposal(bs)[1] for _ in range(steps)]
        return parent_list, top_scores_index, torch.cat(tokens, dim=1)
    score_list, token_list, parents_list = [], [], []
    scores = None
    topk_p, topk_index = proposal(bs)
    for i in range(steps):
        _, _, scores, tree_info = select_top_k_tokens(i, topk_p, topk_index, None, scores, topk)
        score_list.append(tree_info[0])
        token_list.append(tree_info[1])
        parents_list.append(tree_info[2])
        if i < steps - 1:
            topk_p, topk_index = proposal(bs * topk)
    return organize_draft_results(score_list, token_list, parents_list, num_draft)


def build_tree_triton(parent_list: torch.Tensor, top_scores_index: torch.Tensor, seq_lens: torch.Tensor,
                      topk: int, steps: int, d: int, mode: int) -> tuple[torch.Tensor, ...]:
    """SGLang's Triton tree build, its outputs allocated as eagle_utils.build_tree_kernel_efficient does."""
    from sglang.kernels.ops.speculative import spec_tree

    bs = seq_lens.numel()
    size = d * d * bs if mode == 1 else int(seq_lens.sum()) * d + d * d * bs
    tree_mask = torch.full((size,), True, dtype=torch.bool)
    retrieve = torch.full((3, bs, d), -1, dtype=I64)
    positions = torch.full((bs * d,), -7, dtype=I64)
    spec_tree.sgl_build_tree_kernel_triton(parent_list, top_scores_index, seq_lens, tree_mask, positions,
                                           retrieve[0], retrieve[1], retrieve[2], topk, steps, d,
                                           spec_tree.TreeMaskMode(mode))
    return tree_mask, positions, retrieve[0], retrieve[1], retrieve[2]


def build_tree_ours(bonus: torch.Tensor, parent_list: torch.Tensor, top_scores_index: torch.Tensor,
                    draft_tokens: torch.Tensor, seq_lens: torch.Tensor, topk: int, steps: int, d: int,
                    mode: int) -> tuple[torch.Tensor, ...]:
    """The stand-in's tree build, through SGLang's eagle_utils.build_tree_kernel_efficient (CPU branch)."""
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.srt.speculative.eagle_utils import build_tree_kernel_efficient

    return build_tree_kernel_efficient(bonus, parent_list, top_scores_index, draft_tokens, seq_lens,
                                       int(seq_lens.sum()), topk, steps, d, spec_tree.TreeMaskMode(mode))


def tree_parents(qlen_mask: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                 d: int) -> list[list[int]]:
    """Each node's parent (-1 for the root), read from SGLang's QLEN_ONLY mask and positions alone: the node
    it sees whose depth is one less than its own."""
    blocks = qlen_mask.view(-1, d, d)
    out = []
    for b, seq_len in enumerate(seq_lens.tolist()):
        depth = [int(p) - int(seq_len) for p in positions[b * d:(b + 1) * d].tolist()]
        parents = [-1]
        for i in range(1, d):
            seen = [j for j in range(d) if j != i and bool(blocks[b, i, j]) and depth[j] == depth[i] - 1]
            parents.append(seen[0] if len(seen) == 1 else -2)  # -2: not a tree (reported as a mismatch)
        out.append(parents)
    return out


def greedy_reference(parents: list[list[int]], candidates: torch.Tensor, target: torch.Tensor,
                     width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance as SGLang defines it, walked plainly: from the root, go to the first child (lowest
    node index) whose draft token is the target's token at the current node; at most width - 1 steps. The
    target's token is written to predicts at every node of the path, the last one being the bonus."""
    bs, d = candidates.shape
    predicts = torch.zeros(bs * d, dtype=I32)
    accept_index = torch.full((bs, width), -1, dtype=I32)
    accept_num = torch.zeros(bs, dtype=I32)
    for b in range(bs):
        node, path = 0, [0]
        while len(path) < width:
            want = int(target[b, node])
            children = [c for c in range(1, d) if parents[b][c] == node and int(candidates[b, c]) == want]
            if not children:
                break
            node = children[0]
            path.append(node)
        for k, n in enumerate(path):
            accept_index[b, k] = b * d + n
            predicts[b * d + n] = int(target[b, n])
        accept_num[b] = len(path) - 1
    return predicts, accept_index, accept_num


def verify_both(candidates: torch.Tensor, retrieve: tuple[torch.Tensor, ...], target: torch.Tensor,
                width: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Stand-in (spec_tree.verify_tree_greedy_func, SGLang's CPU call with its keyword names) and SGLang's
    Triton kernel, on outputs allocated as eagle_utils.verify_tree_greedy allocates them."""
    from sglang.kernels.ops.speculative import spec_tree

    bs, d = candidates.shape

    def fresh() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.zeros(bs * d, dtype=I32), torch.full((bs, width), -1, dtype=I32),
                torch.full((bs,), -9, dtype=I32))

    ours, theirs = fresh(), fresh()
    spec_tree.verify_tree_greedy_func(predicts=ours[0], accept_index=ours[1], accept_token_num=ours[2],
                                      candidates=candidates, retrieve_index=retrieve[0],
                                      retrieve_next_token=retrieve[1], retrieve_next_sibling=retrieve[2],
                                      target_predict=target, topk=-1)
    spec_tree.verify_tree_greedy_triton(predicts=theirs[0], accept_index=theirs[1],
                                        accept_token_num=theirs[2], candidates=candidates,
                                        retrieve_index=retrieve[0], retrieve_next_token=retrieve[1],
                                        retrieve_next_sibling=retrieve[2], target_predict=target)
    return ours, theirs


def biased_target(rng: random.Random, parents: list[list[int]], candidates: torch.Tensor, vocab: int,
                  agree: float) -> torch.Tensor:
    """Target argmaxes that, with probability ``agree``, equal the draft token of one of the node's children
    (any child, so later siblings get accepted too), else a random token."""
    bs, d = candidates.shape
    target = torch.empty((bs, d), dtype=I64)
    for b in range(bs):
        for i in range(d):
            children = [c for c in range(1, d) if parents[b][c] == i]
            if children and rng.random() < agree:
                target[b, i] = candidates[b, rng.choice(children)]
            else:
                target[b, i] = rng.randrange(vocab)
    return target


def commit_chain(rng: random.Random, g: torch.Generator, stats: dict[str, Stats], label: str,
                 candidates: torch.Tensor, predicts: torch.Tensor, accept_index: torch.Tensor,
                 accept_num: torch.Tensor) -> None:
    """What the worker does with a verify result (spec_utils.move_accept_tokens_to_target_kvcache and
    eagle_worker_common's bonus tokens), stand-in against Triton on the real outputs."""
    from sglang.kernels.ops.speculative import cache_locs, eagle

    bs, d = candidates.shape
    size = bs * accept_index.shape[1]
    out_cache_loc = torch.tensor(rng.sample(range(1, 200), bs * d), dtype=I64)  # the verify windows
    # target slots: the first accepted + 1 slots of each window
    ours, theirs = torch.zeros(size, dtype=I64), torch.zeros(size, dtype=I64)
    accept_lens = accept_num + 1
    cache_locs.fill_front_out_cache_loc_func(accept_lens, out_cache_loc, ours)
    view = out_cache_loc.view(bs, -1)
    cache_locs.assign_extend_cache_locs[(bs,)](torch.arange(bs), view, torch.zeros_like(accept_lens),
                                               accept_lens, theirs, view.shape[1], npow2(bs))
    stats["assign_extend_cache_locs"].exact(f"{label} commit front", {"tgt_cache_loc": (ours, theirs)})
    tgt_cache_loc = theirs
    # source slots: those of the accepted nodes
    ours, theirs = torch.zeros(size, dtype=I64), torch.zeros(size, dtype=I64)
    eagle.fill_accept_out_cache_loc_func(accept_index, out_cache_loc, ours, size)
    eagle.fill_accept_out_cache_loc[(size,)](accept_index, out_cache_loc, theirs, npow2(size))
    stats["fill_accept_out_cache_loc"].exact(f"{label} accept_index={accept_index.tolist()}",
                                             {"accept_out_cache_loc": (ours, theirs)})
    # the move itself, over a small two-layer pool
    pool = [torch.randn((200, 2, 8), generator=g) for _ in range(4)]
    _copy_both(stats["copy_all_layer_kv_cache"], f"{label} commit move", pool, tgt_cache_loc, theirs)
    # the bonus tokens
    accept_tokens = predicts[accept_index]
    ours, theirs = torch.empty_like(accept_lens, dtype=I32), torch.empty_like(accept_lens, dtype=I32)
    eagle.fill_bonus_tokens_func(accept_tokens, accept_lens, ours, accept_index.shape[1], bs)
    eagle.fill_bonus_tokens[(bs,)](accept_tokens, accept_lens, theirs, accept_index.shape[1])
    stats["fill_bonus_tokens"].exact(f"{label} accept_lens={accept_lens.tolist()}",
                                     {"bonus_tokens": (ours, theirs)})


def check_trees(stats: dict[str, Stats], draws: int) -> None:
    """Random EAGLE trees: build (both mask layouts) and greedy verification, then the commit ops."""
    build, verify = stats["build_tree_kernel_efficient"], stats["verify_tree_greedy"]
    accepted: Counter[int] = Counter()
    sibling_accepts = branching_trees = full_accepts = 0
    shapes: set[tuple[int, int, int]] = set()
    for seed in SEEDS:
        rng, g = random.Random(1000 + seed), torch.Generator().manual_seed(1000 + seed)
        for topk in (1, 2, 3):
            for steps in (2, 3, 4):
                bs, vocab = rng.randint(1, 4), pick(rng, 5, 12, 50)
                most = min(8, 1 + topk + (steps - 1) * topk * topk)  # organize_draft_results' top-(d - 1)
                d = steps + 1 if topk == 1 else (2, most, rng.randint(2, most))[seed % 3]
                shapes.add((topk, steps, d))
                label = f"seed {seed} topk={topk} steps={steps} d={d} bs={bs}"
                parent_list, top_idx, draft_tokens = draft_tree(rng, g, bs, topk, steps, d, vocab)
                seq_lens = torch.tensor([rng.randint(1, 30) for _ in range(bs)], dtype=I64)
                bonus = torch.randint(0, vocab, (bs,), generator=g)
                trees = {}
                for mode in (1, 0):  # QLEN_ONLY (the CPU path's), FULL_MASK
                    ours = build_tree_ours(bonus, parent_list, top_idx, draft_tokens, seq_lens, topk, steps,
                                           d, mode)
                    theirs = build_tree_triton(parent_list, top_idx, seq_lens, topk, steps, d, mode)
                    names = ("tree_mask", "positions", "retrieve_index", "retrieve_next_token",
                             "retrieve_next_sibling")
                    build.exact(f"{label} mode={mode} parent_list={parent_list.tolist()} "
                                f"top={top_idx.tolist()}",
                                dict(zip(names, zip(ours[:5], theirs, strict=True), strict=True)))
                    trees[mode] = theirs
                    candidates = ours[5].reshape(bs, d)
                qlen_mask, positions, *retrieve = trees[1]
                branching_trees += int((retrieve[2] != -1).any())
                parents = tree_parents(qlen_mask, positions, seq_lens, d)
                for draw in range(draws):
                    agree = (0.3, 0.7, 0.9, 1.0)[draw % 4]
                    target = biased_target(rng, parents, candidates, vocab, agree)
                    ours, theirs = verify_both(candidates, tuple(retrieve), target, steps + 1)
                    expected = greedy_reference(parents, candidates, target, steps + 1)
                    names = ("predicts", "accept_index", "accept_token_num")
                    what = f"{label} draw {draw} target={target.tolist()} candidates={candidates.tolist()}"
                    verify.exact(what, dict(zip(names, zip(ours, theirs, strict=True), strict=True)))
                    verify.exact(f"{what} (against the plain walk)",
                                 dict(zip(names, zip(ours, expected, strict=True), strict=True)))
                    verify.cases -= 1  # one case, two comparisons
                    for b, n in enumerate(theirs[2].tolist()):
                        accepted[n] += 1
                        full_accepts += int(n == steps)
                        path = [i - b * d for i in theirs[1][b, 1:n + 1].tolist()]
                        first_children = set(retrieve[1][b].tolist())
                        sibling_accepts += int(any(node not in first_children for node in path))
                    commit_chain(rng, g, stats, f"{label} draw {draw}", candidates, *theirs)
    build.extra.update({"trees_with_siblings": branching_trees,
                        "shapes_topk_steps_draft_tokens": sorted(shapes)})
    verify.extra.update({"accepted_histogram": {str(k): v for k, v in sorted(accepted.items())},
                         "requests": sum(accepted.values()), "full_depth_accepts": full_accepts,
                         "paths_through_later_siblings": sibling_accepts})


def check_tree_hand_cases(stats: dict[str, Stats]) -> None:
    """Trees and verdicts small enough to write down: a chain with 2 of 3 drafts right, all right, none right;
    a topk-2 tree accepted through the second sibling; two siblings with the same token (the first wins)."""
    build, verify = stats["build_tree_kernel_efficient"], stats["verify_tree_greedy"]
    hand: Counter[str] = Counter()

    def run(label: str, parent_list: list[list[int]], top_idx: list[list[int]], tokens: list[list[int]],
            seq_lens: list[int], topk: int, steps: int, target: list[list[int]],
            expect_tree: dict[str, list], expect: tuple[list, list, list]) -> None:
        d = len(top_idx[0]) + 1
        pl, ti = torch.tensor(parent_list, dtype=I64), torch.tensor(top_idx, dtype=I64)
        st = torch.tensor(seq_lens)
        toks = torch.tensor(tokens, dtype=I64)
        for impl in ("ours", "triton"):
            if impl == "ours":
                out = build_tree_ours(toks[:, 0], pl, ti, toks[:, 1:], st, topk, steps, d, 1)[:5]
            else:
                out = build_tree_triton(pl, ti, st, topk, steps, d, 1)
            got = {"mask": out[0].view(-1, d, d).int().tolist(), "positions": out[1].tolist(),
                   "next_token": out[3].tolist(), "next_sibling": out[4].tolist()}
            build.exact(f"hand {label} tree ({impl})",
                        {k: (torch.tensor(got[k]), torch.tensor(expect_tree[k])) for k in expect_tree})
            hand["build"] += 1
            ours, theirs = verify_both(toks, (out[2], out[3], out[4]), torch.tensor(target, dtype=I64),
                                       steps + 1)
            result = ours if impl == "ours" else theirs
            verify.exact(f"hand {label} verdict ({impl})",
                         {"predicts": (result[0], torch.tensor(expect[0], dtype=I32)),
                          "accept_index": (result[1], torch.tensor(expect[1], dtype=I32)),
                          "accept_token_num": (result[2], torch.tensor(expect[2], dtype=I32))})
            hand["verify"] += 1

    chain = {"parent_list": [[-1, 0, 1]], "top_idx": [[0, 1, 2]], "tokens": [[7, 11, 12, 13]],
             "seq_lens": [5], "topk": 1, "steps": 3}
    chain_tree = {"mask": [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]],
                  "positions": [5, 6, 7, 8], "next_token": [[1, 2, 3, -1]],
                  "next_sibling": [[-1, -1, -1, -1]]}
    # the target agrees with drafts 1 and 2 (11, 12), then says 99 where the draft said 13
    run("chain 2 of 3", **chain, target=[[11, 12, 99, 40]], expect_tree=chain_tree,
        expect=([11, 12, 99, 0], [[0, 1, 2, -1]], [2]))
    run("chain 3 of 3", **chain, target=[[11, 12, 13, 40]], expect_tree=chain_tree,
        expect=([11, 12, 13, 40], [[0, 1, 2, 3]], [3]))
    run("chain 0 of 3", **chain, target=[[5, 12, 13, 40]], expect_tree=chain_tree,
        expect=([5, 0, 0, 0], [[0, -1, -1, -1]], [0]))
    # topk 2, 2 steps: candidates 0, 1 (root's children), 2..5 (children of 0: 2, 3; of 1: 4, 5); nodes are
    # candidates 0, 1, 3: root -> {1, 2}, node 1 -> {3}. Request 2: the same tree, after request 1's nodes.
    tree = {"parent_list": [[-1, 0, 1]] * 2, "top_idx": [[0, 1, 3]] * 2, "tokens": [[9, 21, 22, 23]] * 2,
            "seq_lens": [4, 10], "topk": 2, "steps": 2}
    tree_shape = {"mask": [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]] * 2,
                  "positions": [4, 5, 5, 6, 10, 11, 11, 12], "next_token": [[1, 3, -1, -1]] * 2,
                  "next_sibling": [[-1, 2, -1, -1]] * 2}
    # request 0 takes the second sibling (22) and stops there (bonus 30); request 1 goes 21 then 23 (bonus 31)
    run("tree second sibling", **tree, target=[[22, 23, 30, 1], [21, 23, 2, 31]], expect_tree=tree_shape,
        expect=([22, 0, 30, 0, 21, 23, 0, 31], [[0, 2, -1], [4, 5, 7]], [1, 2]))
    same = dict(tree, tokens=[[9, 21, 21, 23]] * 2)  # siblings 1 and 2 both draft 21: node 1 is taken
    run("tree equal siblings", **same, target=[[21, 23, 3, 32], [21, 5, 6, 7]], expect_tree=tree_shape,
        expect=([21, 23, 0, 32, 21, 5, 0, 0], [[0, 1, 3], [4, 5, -1]], [2, 1]))
    verify.extra["hand_cases"] = hand["verify"]
    build.extra["hand_cases"] = hand["build"]


# --------------------------------------------------------------------------------------------- attention
def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                        sm_scale: float, logit_cap: float) -> torch.Tensor:
    """softmax(q k^T * scale [capped], masked) v in float64, head by head; query head h reads kv head
    h // (H / Hkv). q [M, H, D], keys [N, Hkv, D], values [N, Hkv, Dv], visible [M, N]."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    out = torch.empty((q.shape[0], heads, values.shape[-1]), dtype=torch.float64)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        s = q[:, h].double() @ keys[:, kv].double().T * sm_scale
        if logit_cap > 0:
            s = logit_cap * torch.tanh(s / logit_cap)
        s = s.masked_fill(~visible, float("-inf"))
        out[:, h] = torch.softmax(s, dim=-1) @ values[:, kv].double()
    return out


SHAPES = {  # heads, kv heads, qk width, v width
    "mha": (2, 2, 24, 24),
    "gqa": (4, 2, 32, 32),
    "mla": (4, 1, 576, 512),  # absorbed MLA: one kv head, v = the first 512 columns of k
}


def _pool(g: torch.Generator, kind: str, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, kv_heads, dk, dv = SHAPES[kind]
    k_buffer = torch.randn((slots, kv_heads, dk), generator=g)
    v_buffer = k_buffer[..., :dv] if kind == "mla" else torch.randn((slots, kv_heads, dv), generator=g)
    return k_buffer, v_buffer


def _requests(rng: random.Random, bs: int, totals: list[int], rows: int, width: int, slots: int,
              r2t_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """req_to_token with each request's tokens on distinct random slots (not slot 0: SGLang's padding)."""
    req_to_token = torch.zeros((rows, width), dtype=r2t_dtype)
    rpi = rng.sample(range(rows), bs)
    free = rng.sample(range(1, slots), sum(totals))
    at = 0
    for row, total in zip(rpi, totals, strict=True):
        req_to_token[row, :total] = torch.tensor(free[at:at + total], dtype=r2t_dtype)
        at += total
    return req_to_token, torch.tensor(rpi, dtype=I64)


EXTEND_CASES = (  # (label, shape, variant)
    ("mha causal", "mha", "causal"), ("gqa causal", "gqa", "causal"), ("mla causal", "mla", "causal"),
    ("gqa logit cap", "gqa", "cap"), ("mha k/v scales", "mha", "scaled"),
    ("gqa non-causal", "gqa", "noncausal"), ("gqa k=v=None", "gqa", "kv_none"),
    ("gqa tree QLEN_ONLY", "gqa", "tree"), ("mla tree QLEN_ONLY", "mla", "tree"),
    ("mha tree FULL_MASK", "mha", "tree_full"), ("mla prefill", "mla", "prefill"),
)


def check_extend_attention(stats: Stats, seeds: tuple[int, ...]) -> None:
    """torch.ops.sgl_kernel.extend_attention_cpu, called as intel_amx_backend.forward_extend calls it, against
    the float64 reference and SGLang's Triton extend_attention_fwd (as the triton backend calls it)."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    kinds: Counter[str] = Counter()
    ref_rel = triton_rel = 0.0
    for seed in seeds:
        for index, (label, kind, variant) in enumerate(EXTEND_CASES):
            case_seed = 2000 + 100 * seed + index
            rng, g = random.Random(case_seed), torch.Generator().manual_seed(case_seed)
            heads, kv_heads, dk, dv = SHAPES[kind]
            slots, rows, width = 160, 6, 64
            bs = rng.randint(1, 4)
            tree = variant in ("tree", "tree_full")
            if tree:  # a draft tree under verification: every request extends by d, after a prefix
                topk, steps = rng.randint(2, 3), rng.randint(2, 4)
                d = rng.randint(3, min(8, 1 + topk + (steps - 1) * topk * topk))
                prefix = [rng.randint(1, 24) for _ in range(bs)]
                new = [d] * bs
            else:
                prefix = [0] * bs if variant == "prefill" else [rng.randint(0, 24) for _ in range(bs)]
                new = [rng.randint(1, 7) for _ in range(bs)]
            totals = [p + n for p, n in zip(prefix, new, strict=True)]
            req_to_token, rpi = _requests(rng, bs, totals, rows, width, slots, pick(rng, I32, I64))
            k_buffer, v_buffer = _pool(g, kind, slots)
            m = sum(new)
            if variant == "prefill":  # MLA's prefill: per-head k/v of their own widths, nothing cached
                dk, dv, kv_heads = 192, 128, heads
                q = torch.randn((m, heads, dk), generator=g)
                k_new = torch.randn((m, heads, dk), generator=g)
                v_new = torch.randn((m, heads, dv), generator=g)
            else:
                q = torch.randn((m, heads, dk), generator=g) * (4.0 if variant == "cap" else 1.0)
                k_new = torch.randn((m, kv_heads, dk), generator=g)
                v_new = k_new[..., :dv] if kind == "mla" else torch.randn((m, kv_heads, dv), generator=g)
                if variant == "kv_none":  # their k/v are in the pool already (Gemma4's KV-shared layers)
                    new_slots = torch.cat([req_to_token[int(r), p:t].long()
                                           for r, p, t in zip(rpi.tolist(), prefix, totals, strict=True)])
                    k_buffer[new_slots] = k_new
                    if kind != "mla":
                        v_buffer[new_slots] = v_new
                # otherwise their slots hold other values: the op must take the new k/v from k and v
            sm_scale = 1.0 / (192 ** 0.5) if kind == "mla" else pick(rng, 1.0 / dk ** 0.5, 0.3)
            logit_cap = 5.0 if variant == "cap" else 0.0
            k_scale, v_scale = (0.5, 1.5) if variant == "scaled" else (1.0, 1.0)
            is_causal = variant != "noncausal"
            extend_lens = torch.tensor(new, dtype=I32)
            start_loc = torch.cumsum(extend_lens, 0, dtype=I32) - extend_lens
            seq_lens = torch.tensor(totals, dtype=I64)

            qlen_mask = full_mask = None
            if tree:
                parent_list, top_idx, _ = draft_tree(rng, g, bs, topk, steps, d, 40)
                verified = torch.tensor(prefix, dtype=I64)
                qlen_mask = build_tree_triton(parent_list, top_idx, verified, topk, steps, d, 1)[0]
                full_mask = build_tree_triton(parent_list, top_idx, verified, topk, steps, d, 0)[0]

            # the reference's visibility, per request [new, total]
            visible = []
            for b in range(bs):
                p, n = prefix[b], new[b]
                if tree:
                    block = qlen_mask.view(bs, d, d)[b]
                    vis = torch.cat([torch.ones((n, p), dtype=torch.bool), block], dim=1)
                elif is_causal:
                    vis = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
                else:
                    vis = torch.ones((n, p + n), dtype=torch.bool)
                visible.append(vis)

            o = torch.full((m, heads, dv), float("nan"))
            k_arg, v_arg = (None, None) if variant == "kv_none" else (k_new, v_new)
            tree_arg = full_mask if variant == "tree_full" else qlen_mask
            torch.ops.sgl_kernel.extend_attention_cpu(
                q, k_arg, v_arg, o, k_buffer, v_buffer, k_scale, v_scale, req_to_token, rpi, seq_lens,
                extend_lens, start_loc, max(new), sm_scale, logit_cap, False, 0, None, None, tree_arg,
                is_causal)

            ref = torch.empty((m, heads, dv), dtype=torch.float64)
            for b, row in enumerate(rpi.tolist()):
                p, n, s = prefix[b], new[b], int(start_loc[b])
                slots_b = req_to_token[row, :p + n].long()
                if variant == "kv_none":  # everything from the pool, scales on every row
                    keys, vals = k_buffer[slots_b].double() * k_scale, v_buffer[slots_b].double() * v_scale
                elif p == 0:  # nothing cached (MLA's prefill: k/v of their own widths)
                    keys, vals = k_new[s:s + n].double(), v_new[s:s + n].double()
                else:  # the cached prefix (scaled) and the new keys as given
                    keys = torch.cat([k_buffer[slots_b[:p]].double() * k_scale, k_new[s:s + n].double()])
                    vals = torch.cat([v_buffer[slots_b[:p]].double() * v_scale, v_new[s:s + n].double()])
                ref[s:s + n] = reference_attention(q[s:s + n], keys, vals, visible[b], sm_scale, logit_cap)
            case = f"seed {seed} {label} bs={bs} prefix={prefix} new={new}"
            stats.cases += 1
            kinds[label] += 1
            ref_rel = max(ref_rel, stats.close(f"{case} (reference)", o, ref))

            if variant == "kv_none":
                continue  # Triton's extend always takes the new k/v as tensors
            o_t = torch.full((m, heads, dv), float("nan"))
            qo_indptr = torch.tensor([0] + torch.cumsum(extend_lens, 0).tolist(), dtype=I32)
            kv_indptr = torch.tensor([0] + torch.cumsum(torch.tensor(prefix), 0).tolist(), dtype=I32)
            kv_indices = torch.cat([req_to_token[r, :p].long()
                                    for r, p in zip(rpi.tolist(), prefix, strict=True)]
                                   + [torch.zeros(1, dtype=I64)])
            mask_indptr = None
            if tree:
                seq_mask_len = torch.tensor(new) * torch.tensor(totals)
                mask_indptr = torch.tensor([0] + torch.cumsum(seq_mask_len, 0).tolist(), dtype=I64)
            extend_attention_fwd(q, k_new.contiguous(), v_new.contiguous(), o_t, k_buffer, v_buffer,
                                 qo_indptr, kv_indptr, kv_indices, full_mask, is_causal, mask_indptr,
                                 max(new), k_scale, v_scale, sm_scale=sm_scale, logit_cap=logit_cap)
            triton_rel = max(triton_rel, stats.close(f"{case} (triton)", o, o_t))
            stats.extra["triton_cases"] = stats.extra.get("triton_cases", 0) + 1
    stats.extra.update({"kinds": dict(kinds), "max_rel_diff_reference": ref_rel,
                        "max_rel_diff_triton": triton_rel})


DECODE_CASES = (
    ("mha", "mha", ""), ("gqa", "gqa", ""), ("mla", "mla", ""), ("gqa logit cap", "gqa", "cap"),
    ("mha k/v scales", "mha", "scaled"), ("gqa k=v=None", "gqa", "kv_none"),
    ("mla k=v=None", "mla", "kv_none"),
)


def check_decode_attention(stats: Stats, seeds: tuple[int, ...]) -> None:
    """torch.ops.sgl_kernel.decode_attention_cpu, called as intel_amx_backend.forward_decode calls it, against
    the float64 reference and SGLang's Triton decode_attention_fwd (several KV splits); the new k/v must be in
    the pool at ``loc`` afterwards (and nothing else changed there)."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    kinds: Counter[str] = Counter()
    ref_rel = triton_rel = 0.0
    pool_bad = 0
    for seed in seeds:
        for index, (label, kind, variant) in enumerate(DECODE_CASES):
            case_seed = 3000 + 100 * seed + index
            rng, g = random.Random(case_seed), torch.Generator().manual_seed(case_seed)
            heads, kv_heads, dk, dv = SHAPES[kind]
            slots, rows, width = 400, 6, 96
            bs = rng.randint(1, 4)
            totals = [rng.randint(1, 80) for _ in range(bs)]  # past 32 tokens Triton splits the KV
            req_to_token, rpi = _requests(rng, bs, totals, rows, width, slots, pick(rng, I32, I64))
            k_buffer, v_buffer = _pool(g, kind, slots)
            loc = torch.stack([req_to_token[int(r), t - 1].long()
                               for r, t in zip(rpi.tolist(), totals, strict=True)])
            q = torch.randn((bs, heads, dk), generator=g) * (4.0 if variant == "cap" else 1.0)
            k_new = torch.randn((bs, kv_heads, dk), generator=g)
            v_new = k_new[..., :dv] if kind == "mla" else torch.randn((bs, kv_heads, dv), generator=g)
            if variant == "kv_none":  # the fp8 path: set_kv_buffer wrote them before the call
                k_buffer[loc] = k_new
                if kind != "mla":
                    v_buffer[loc] = v_new
            # the pool as it must be after the call
            k_after = k_buffer.clone()
            v_after = k_after[..., :dv] if kind == "mla" else v_buffer.clone()
            k_after[loc] = k_new
            if kind != "mla":
                v_after[loc] = v_new
            sm_scale = 1.0 / (192 ** 0.5) if kind == "mla" else pick(rng, 1.0 / dk ** 0.5, 0.3)
            logit_cap = 5.0 if variant == "cap" else 0.0
            k_scale, v_scale = (0.5, 1.5) if variant == "scaled" else (1.0, 1.0)
            seq_lens = torch.tensor(totals, dtype=I64)

            o = torch.full((bs, heads, dv), float("nan"))
            attn_logits = torch.zeros((bs, heads, 8, dv + 1))
            k_arg, v_arg = (None, None) if variant == "kv_none" else (k_new, v_new)
            torch.ops.sgl_kernel.decode_attention_cpu(
                q, k_buffer, v_buffer, k_scale, v_scale, o, k_arg, v_arg, loc, attn_logits, req_to_token, rpi,
                seq_lens, sm_scale, logit_cap, False, 0, None, None)
            case = f"seed {seed} {label} bs={bs} seq_lens={totals}"
            stats.cases += 1
            kinds[label] += 1
            pool_ok = torch.equal(k_buffer, k_after) and torch.equal(v_buffer, v_after)
            pool_bad += int(not pool_ok)
            if not pool_ok:
                stats._bad(f"{case}: the pool after the call is not the pool with k/v written at loc")

            ref = torch.empty((bs, heads, dv), dtype=torch.float64)
            for b, row in enumerate(rpi.tolist()):
                slots_b = req_to_token[row, :totals[b]].long()
                keys, vals = k_after[slots_b].double() * k_scale, v_after[slots_b].double() * v_scale
                everything = torch.ones((1, totals[b]), dtype=torch.bool)
                ref[b:b + 1] = reference_attention(q[b:b + 1], keys, vals, everything, sm_scale, logit_cap)
            ref_rel = max(ref_rel, stats.close(f"{case} (reference)", o, ref))

            max_splits = 4
            o_t = torch.full((bs, heads, dv), float("nan"))
            kv_indptr = torch.tensor([0] + torch.cumsum(seq_lens, 0).tolist(), dtype=I32)
            kv_indices = torch.cat([req_to_token[r, :t].long()
                                    for r, t in zip(rpi.tolist(), totals, strict=True)])
            splits = torch.tensor([rng.randint(1, max_splits) for _ in range(bs)], dtype=I32)
            logits, lse = torch.empty((bs, heads, max_splits, dv)), torch.empty((bs, heads, max_splits))
            decode_attention_fwd(q, k_after, v_after, o_t, kv_indptr, kv_indices, logits, lse,
                                 splits, max_splits, sm_scale, k_scale, v_scale, logit_cap=logit_cap,
                                 has_mla=kind == "mla")
            triton_rel = max(triton_rel, stats.close(f"{case} (triton)", o, o_t))
    stats.extra.update({"kinds": dict(kinds), "max_rel_diff_reference": ref_rel,
                        "max_rel_diff_triton": triton_rel, "triton_cases": stats.cases,
                        "pool_write_mismatches": pool_bad})


# --------------------------------------------------------------------------------------------- main
def guarded(st: Stats, check: Any, *args: Any) -> float:
    """Run one op's checks; an exception (the op raised, or the comparison could not be made) is kept on the
    op's tally and the run goes on, so the JSON still reports every other op. Returns the seconds taken."""
    started = time.monotonic()
    try:
        check(*args)
    except Exception as exc:
        traceback.print_exc()
        st.errors.append(f"{type(exc).__name__}: {exc}")
    return time.monotonic() - started


def main() -> int:
    started = time.monotonic()
    names = ("assign_req_to_token_pool", "assign_extend_cache_locs", "assign_draft_cache_locs_contiguous",
             "build_draft_decode_metadata", "fill_bonus_tokens", "fill_accept_out_cache_loc",
             "copy_all_layer_kv_cache", "build_tree_kernel_efficient", "verify_tree_greedy",
             "extend_attention_cpu", "decode_attention_cpu")
    stats = {name: Stats() for name in names}
    wired = wiring()
    if not all(wired.values()):
        print(json.dumps({"wiring": wired}), flush=True)
        print(f"SGLang is not wired to redraft's stand-in: {wired}", file=sys.stderr)
        return 2
    cache_checks = (("assign_req_to_token_pool", check_assign_req_to_token_pool),
                    ("assign_extend_cache_locs", check_assign_extend_cache_locs),
                    ("assign_draft_cache_locs_contiguous", check_assign_draft_cache_locs),
                    ("build_draft_decode_metadata", check_build_draft_decode_metadata),
                    ("copy_all_layer_kv_cache", check_copy_all_layer_kv_cache))
    timings = {"cache_ops": 0.0}
    for seed in SEEDS:
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        for name, check in cache_checks:
            timings["cache_ops"] += guarded(stats[name], check, rng, g, stats[name], 6)
    timings["trees"] = (guarded(stats["build_tree_kernel_efficient"], check_tree_hand_cases, stats)
                        + guarded(stats["verify_tree_greedy"], check_trees, stats, 4))
    timings["extend_attention"] = guarded(stats["extend_attention_cpu"], check_extend_attention,
                                          stats["extend_attention_cpu"], SEEDS[:2])
    timings["decode_attention"] = guarded(stats["decode_attention_cpu"], check_decode_attention,
                                          stats["decode_attention_cpu"], SEEDS[:2])
    timings["total"] = time.monotonic() - started
    print(json.dumps({"tolerance": TOL, "wiring": wired, "ops": {n: s.report() for n, s in stats.items()},
                      "seconds": {k: round(v, 1) for k, v in timings.items()}}), flush=True)
    return 1 if any(s.errors for s in stats.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
