"""redraft.core.alignment against the rule written out by explicit indexing (no shifts)."""

from __future__ import annotations

import pytest
import torch

from redraft.core.alignment import shift_left, step_counted, step_offset, step_rows

T = 9


def _ids() -> torch.Tensor:
    return torch.arange(100, 100 + T).view(1, T)  # token t is 100 + t


def test_step_rows_reads_token_t_plus_1_plus_k():
    ids = _ids()
    for k in range(4):
        got = step_rows(ids, k, fill=-1)
        assert got.shape == ids.shape
        for t in range(T):
            want = int(ids[0, t + 1 + k]) if t + 1 + k < T else -1
            assert int(got[0, t]) == want, (k, t)


def test_step_rows_trailing_dims_and_fill():
    x = torch.arange(2 * T * 3, dtype=torch.float32).view(2, T, 3)
    got = step_rows(x, 2, 0.5)
    for b in range(2):
        for t in range(T):
            want = x[b, t + 3] if t + 3 < T else torch.full((3,), 0.5)
            assert torch.equal(got[b, t], want)


def test_step_rows_past_the_sequence_is_all_fill():
    ids = _ids()
    assert torch.equal(step_rows(ids, T + 2, -7), torch.full_like(ids, -7))


def test_step_counted_is_the_token_teacher_row_t_plus_1_plus_k_predicts():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    for k in range(4):
        got = step_counted(mask, k)
        for t in range(T):
            want = bool(mask[0, t + 2 + k]) if t + 2 + k < T else False
            assert bool(got[0, t]) == want, (k, t)


def test_step_offset_is_the_flat_index_offset():
    ids = _ids()
    flat = ids.reshape(-1)
    for k in range(3):
        assert step_offset(k) == 1 + k
        for t in range(T - step_offset(k)):
            assert int(step_rows(ids, k)[0, t]) == int(flat[t + step_offset(k)])
    with pytest.raises(ValueError):
        step_offset(-1)


def test_checks_can_fail():
    """An off-by-one shift (step k reading token t+k) is caught by the same explicit check."""
    ids = _ids()
    wrong = shift_left(ids, 1, -1)  # what step 1 would read with the offset written as k
    assert not torch.equal(wrong, step_rows(ids, 1, -1))
    assert any(int(wrong[0, t]) != int(ids[0, t + 2]) for t in range(T - 2))
    mask = torch.tensor([[0, 1, 0, 1, 0, 1, 0, 1, 0]], dtype=torch.bool)
    assert not torch.equal(step_counted(mask, 0), step_rows(mask, 0, False))
