"""The training-time-test / drafting alignment, stated once (docs/design.md), and sequence shifts.

Tensors are stored RAW: row t is token t; teacher row t predicts token t+1; a loss mask is per
token (token t counted). The rule, for drafting row t at draft step k (0-based):

- step k embeds token ``t + step_offset(k)`` = t+1+k (step 0: the token after t);
- step k is verified by / scored against teacher row ``t + step_offset(k)``, which predicts token
  t+2+k;
- row t counts at step k iff that predicted token t+2+k is counted (:func:`step_counted`).

:func:`step_rows` is the shift for "the row step k reads / verifies for drafting row t"; code that
indexes by hand (flat rows, Python loops) adds :func:`step_offset`. :func:`shift_left` is the plain
shift underneath.
"""

from __future__ import annotations

import torch


def shift_left(x: torch.Tensor, s: int, fill: int | float | bool = 0) -> torch.Tensor:
    """x[:, s:] followed by s ``fill`` columns (dim 1): row t of the result is row t+s of x."""
    if s == 0:
        return x
    pad = torch.full((x.shape[0], min(s, x.shape[1]), *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat((x[:, s:], pad), dim=1)


def step_offset(k: int) -> int:
    """Rows from drafting row t to what draft step k (0-based) reads and is verified by: 1 + k.

    Step k at row t embeds token ``t + step_offset(k)`` and is scored against teacher row
    ``t + step_offset(k)`` (which predicts token ``t + step_offset(k) + 1``).
    """
    if k < 0:
        raise ValueError(f"step_offset: draft step must be >= 0, got {k}")
    return 1 + k


def step_rows(x: torch.Tensor, k: int, fill: int | float | bool = 0) -> torch.Tensor:
    """Row t of the result is the row of x that step k reads / verifies for drafting row t (row t+1+k).

    ``fill`` past the end. On token ids: the token step k embeds; on teacher rows: its target.
    """
    return shift_left(x, step_offset(k), fill)


def step_counted(mask: torch.Tensor, k: int) -> torch.Tensor:
    """Row t of the result: whether drafting row t counts at step k, from a per-token bool ``mask``.

    True iff token t+2+k, the one predicted by step k's teacher row t+1+k, is counted in ``mask``;
    False past the end.
    """
    return shift_left(mask, step_offset(k) + 1, False)
