"""Packing samples into padded batches: longest first, as many as fit a padded-token budget.

Extraction, training and evaluation all batch variable-length samples this way; the order is a
pure function of the lengths (ties broken by index), which keeps reruns byte-identical.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_sorted(order: Sequence[int], lengths: Sequence[int], batch_tokens: int, max_samples: int = 0) -> list[list[int]]:
    """Cut ``order`` (sample indices, longest first) into batches of at most ``batch_tokens`` padded tokens
    (longest x count; 0: no token cap) and at most ``max_samples`` samples (0: no cap).

    A sample longer than the budget gets a batch of its own.
    """
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current:
            fits_tokens = batch_tokens <= 0 or int(lengths[current[0]]) * (len(current) + 1) <= batch_tokens
            fits_count = max_samples <= 0 or len(current) < max_samples
            if not (fits_tokens and fits_count):
                batches.append(current)
                current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pack_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices 0..N-1, longest first, so each batch's padded size stays under batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return pack_sorted(order, lengths, batch_tokens)
