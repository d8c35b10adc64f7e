"""The EAGLE draft tree and its greedy verification, as SGLang 0.5.23 defines them.

Semantics from SGLang's Triton kernels ``sgl_build_tree_kernel_efficient_triton`` and
``verify_tree_greedy_kernel_triton`` (``sglang/kernels/ops/speculative/spec_tree.py``), which SGLang runs on
devices without its compiled kernels; the tests hold these functions equal to them. :func:`verify_tree_greedy`
*is* the acceptance rule whose counts SGLang reports (``spec_accept_length``), so it is written here as a
plain walk, node by node.

Tree layout: request ``b`` drafts ``D`` tokens; node 0 is the last verified token, node ``i >= 1`` is
``selected_index[b, i-1]`` among the draft's candidates, whose parent is found through ``parent_list``.
``retrieve_next_token[b, i]`` is node ``i``'s first child and ``retrieve_next_sibling[b, i]`` its next sibling
(-1: none); ``retrieve_index[b, i] = b * D + i`` is the node's flat index.
"""

from __future__ import annotations

import torch

FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


def _parent_node(selected: list[int], parents: list[int], node: int, topk: int) -> int | None:
    """The tree node (0 = root) whose candidate drafted node ``node``'s token; None when it is not in the tree."""
    parent_block = selected[node - 1] // topk
    if parent_block == 0:
        return 0
    parent_candidate = parents[parent_block]
    for position, candidate in enumerate(selected):
        if candidate == parent_candidate:
            return position + 1
    return None


def build_tree_kernel_efficient(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                verified_seq_len: torch.Tensor, tree_mask: torch.Tensor, positions: torch.Tensor,
                                retrieve_index: torch.Tensor, retrieve_next_token: torch.Tensor,
                                retrieve_next_sibling: torch.Tensor, topk: int, depth: int, draft_token_num: int,
                                tree_mask_mode: int) -> None:
    """Fill the tree's attention mask, positions and retrieval links (the outputs are written in place;
    ``retrieve_next_token``/``retrieve_next_sibling`` arrive filled with -1).

    Mask rows: FULL_MASK gives request ``b`` a ``[D, seq_len_b + D]`` block (after all earlier requests'
    blocks) whose last ``D`` columns are set here; QLEN_ONLY gives it a ``[D, D]`` block. A node sees the root
    and its own ancestors; its position is the verified length plus its depth.
    """
    if int(tree_mask_mode) == QLEN_ONLY_BITPACKING:
        raise NotImplementedError("build_tree_kernel_efficient: QLEN_ONLY_BITPACKING is not supported on CPU")
    d, topk = int(draft_token_num), int(topk)
    mask = tree_mask.view(-1)
    seq_lens = [int(s) for s in verified_seq_len.tolist()]
    block_start = 0
    for b, seq_len in enumerate(seq_lens):
        selected = [int(s) for s in selected_index[b].tolist()]
        parents = [int(p) for p in parent_list[b].reshape(-1).tolist()]
        base = b * d
        positions[base] = seq_len
        retrieve_index[b, 0] = base
        for node in range(d - 1, 0, -1):  # last node first: earlier siblings end up in front of the list
            retrieve_index[b, node] = base + node
            parent = _parent_node(selected, parents, node, topk)
            if parent is None:
                continue
            first_child = int(retrieve_next_token[b, parent])
            retrieve_next_token[b, parent] = node
            if first_child != -1:
                retrieve_next_sibling[b, node] = first_child
        if int(tree_mask_mode) == FULL_MASK:
            width, col0 = seq_len + d, block_start + seq_len
            block_start += d * width
        else:
            width, col0 = d, b * d * d
        for node in range(d):
            row = col0 + node * width
            mask[row:row + d] = False
            mask[row] = True
            if node == 0:
                continue
            level, cur = 0, node
            for _ in range(int(depth)):
                level += 1
                mask[row + cur] = True
                parent = _parent_node(selected, parents, cur, topk)
                if parent is None or parent == 0:
                    break
                cur = parent
            positions[base + node] = seq_len + level


def verify_tree_greedy(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                       candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                       retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Greedy acceptance: from the root, step to the child whose draft token equals the target's argmax at the
    current node, as long as one does (at most ``accept_index.shape[1] - 1`` steps).

    Writes ``accept_index[b]`` (flat indices of the accepted path, root first; the rest untouched),
    ``accept_token_num[b]`` (accepted drafts, the bonus token not counted) and ``predicts`` at each accepted
    node and at the last one (the target's token there: the bonus).
    """
    bs, d = candidates.shape
    steps = accept_index.shape[1]
    target = target_predict.reshape(-1)
    flat_predicts = predicts.view(-1)
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, steps):
            child = int(retrive_next_token[b, node])
            want = int(target[last])
            while child != -1 and int(candidates[b, child]) != want:
                child = int(retrive_next_sibling[b, child])
            if child == -1:
                break
            flat_predicts[last] = want
            accepted += 1
            last = int(retrive_index[b, child])
            accept_index[b, accepted] = last
            node = child
        accept_token_num[b] = accepted
        flat_predicts[last] = int(target[last])
