"""Shifting [B, T, ...] tensors along the sequence, for redraft's alignment (docs/design.md).

Tensors are stored RAW (row t is token t; teacher row t predicts token t+1). The training-time-test
unroll and the acceptance simulation look ``s`` rows ahead at step k (the token embedded at step k
is token t+1+k), which is :func:`shift_left`.
"""

from __future__ import annotations

import torch


def shift_left(x: torch.Tensor, s: int, fill: int | float | bool = 0) -> torch.Tensor:
    """x[:, s:] followed by s ``fill`` columns (dim 1): row t of the result is row t+s of x."""
    if s == 0:
        return x
    pad = torch.full((x.shape[0], min(s, x.shape[1]), *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat((x[:, s:], pad), dim=1)
