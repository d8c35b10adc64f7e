"""Draft vocab mapping: selection rules, engine offset convention, consistency checks."""

from __future__ import annotations

import pytest
import torch

from redraft.core.drafter.modeling import Eagle3Drafter
from redraft.core.drafter.vocab import (
    build_vocab_mapping,
    check_vocab_mapping,
    draft_token_ids,
    shared_draft_rows,
)

torch.set_num_threads(1)


def _used(d2t):
    return (d2t + torch.arange(len(d2t))).tolist()


def test_hand_example_with_tie():
    counts = torch.tensor([5, 0, 3, 3, 7, 1])
    d2t, t2d = build_vocab_mapping(counts, 3)
    # 4 (7), 0 (5), then ids 2 and 3 tie at 3: the lower id wins
    assert _used(d2t) == [0, 2, 4]
    assert d2t.tolist() == [0, 1, 2] and d2t.dtype == torch.int64
    assert t2d.tolist() == [True, False, True, False, True, False]
    check_vocab_mapping(d2t, t2d, 6)


def test_fewer_nonzero_than_n_fills_zero_count_ids_ascending():
    counts = torch.tensor([0, 4, 0, 0, 2, 0])
    d2t, t2d = build_vocab_mapping(counts, 4)
    assert _used(d2t) == [0, 1, 2, 4]
    assert int(t2d.sum()) == 4
    check_vocab_mapping(d2t, t2d, 6)


def test_n_larger_than_vocab_clamps_to_identity():
    d2t, t2d = build_vocab_mapping(torch.tensor([1, 0, 9]), 10)
    assert d2t.tolist() == [0, 0, 0] and t2d.all()


def test_deterministic_and_matches_python_sort():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 6, (500,), generator=g)  # many ties and zeros
    a = build_vocab_mapping(counts, 123)
    b = build_vocab_mapping(counts.clone(), 123)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = counts.tolist()
    expect = sorted(sorted(range(500), key=lambda i: (-c[i], i))[:123])
    assert _used(a[0]) == expect
    check_vocab_mapping(*a, 500)


def test_draft_to_target_uses_engine_offset_convention(tmp_path):
    from helpers_drafter import tiny_config

    cfg = tiny_config(vocab_size=10, draft_vocab_size=4)
    counts = torch.tensor([0, 9, 0, 5, 0, 0, 7, 0, 2, 0])
    d2t, t2d = build_vocab_mapping(counts, 4)
    d = Eagle3Drafter(cfg)
    d.set_vocab_mapping(d2t, t2d)
    # SGLang: hot_token_id = d2t + arange; vLLM: draft_id_to_target_id; both give target = draft + d2t[draft]
    assert d.draft_to_target(torch.tensor([0, 1, 2, 3])).tolist() == [1, 3, 6, 8]
    assert d.draft_to_target(torch.tensor([[3, 0]])).tolist() == [[8, 1]]
    assert draft_token_ids(d2t).tolist() == [1, 3, 6, 8]
    assert t2d.nonzero().squeeze(-1).tolist() == [1, 3, 6, 8]


def test_bad_inputs():
    with pytest.raises(ValueError, match="1-D"):
        build_vocab_mapping(torch.zeros(2, 3, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="negative count -1 at token id 1"):
        build_vocab_mapping(torch.tensor([3, -1, 2]), 2)
    with pytest.raises(ValueError, match="integers"):
        build_vocab_mapping(torch.tensor([3.0, 1.0]), 2)


def test_check_vocab_mapping_names_the_problem():
    d2t, t2d = build_vocab_mapping(torch.tensor([5, 0, 3, 3, 7, 1]), 3)  # used [0, 2, 4]
    with pytest.raises(ValueError, match="outside"):
        check_vocab_mapping(torch.tensor([0, 1, 4]), t2d, 6)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_vocab_mapping(torch.tensor([0, 1, 0]), t2d, 6)
    with pytest.raises(ValueError, match="t2d selects 4 tokens but d2t has 3"):
        t = t2d.clone()
        t[1] = True
        check_vocab_mapping(d2t, t, 6)
    with pytest.raises(ValueError, match="does not select"):
        check_vocab_mapping(torch.tensor([0, 0, 2]), t2d, 6)  # ids [0, 1, 4]
    with pytest.raises(ValueError, match="vocab_size is 7"):
        check_vocab_mapping(d2t, t2d, 7)
    with pytest.raises(ValueError, match="bool"):
        check_vocab_mapping(d2t, t2d.long(), 6)


def test_shared_draft_rows_pairs_each_shared_token():
    old_ids, new_ids = torch.tensor([1, 4, 5, 9]), torch.tensor([0, 4, 9, 11, 12])
    old_d2t, new_d2t = old_ids - torch.arange(4), new_ids - torch.arange(5)
    new_rows, old_rows = shared_draft_rows(old_d2t, new_d2t)
    assert new_ids[new_rows].tolist() == old_ids[old_rows].tolist()
    assert sorted(set(old_ids.tolist()) & set(new_ids.tolist())) == new_ids[new_rows].tolist()
