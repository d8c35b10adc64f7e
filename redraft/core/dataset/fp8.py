"""Storage codec of hidden states: bf16 as is, or fp8 e4m3 with one scale per token and captured layer.

Why per token and layer: hidden-state magnitudes differ by orders of magnitude between layers and
between tokens, so one scale per tensor would flush most of them to zero.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
FP8 = torch.float8_e4m3fn


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, groups*H] -> (float8_e4m3fn [N, groups*H], float32 scales [N, groups]).

    One scale per token and captured layer (amax / 448), because hidden-state magnitudes
    differ by orders of magnitude between layers and between tokens. An all-zero group
    gets scale 0 and dequantises to zeros.
    """
    n, width = x.shape
    g = x.float().reshape(n, groups, width // groups)
    scale = g.abs().amax(dim=-1) / FP8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (g / safe.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(n, width), scale.contiguous()


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_fp8`, returning float32."""
    n, width = q.shape
    groups = scale.shape[1]
    return (q.float().reshape(n, groups, width // groups) * scale.float().unsqueeze(-1)).reshape(n, width)


def encode_hidden(
    x: torch.Tensor, hidden_dtype: str, groups: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if hidden_dtype == "bf16":
        return x.to(torch.bfloat16).contiguous(), None
    return quantize_fp8(x, groups)


def put_hidden(
    tensors: dict[str, torch.Tensor], prefix: str, parts: list[tuple[torch.Tensor, torch.Tensor | None]]
) -> None:
    """Store encoded pieces under `{prefix}_hidden` (and `{prefix}_scale` for fp8)."""
    tensors[f"{prefix}_hidden"] = torch.cat([h for h, _ in parts])
    scales = [sc for _, sc in parts if sc is not None]
    if scales:
        tensors[f"{prefix}_scale"] = torch.cat(scales)


def decode_hidden(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if x.dtype == FP8:
        if scale is None:
            raise ValueError("fp8 hidden states without scales")
        return dequantize_fp8(x, scale)
    return x.float()
