"""Engine speculative counters per request summed into tau and per-position rates (vLLM's definitions:
``v1/spec_decode/metrics.py``), for every stage that reads an engine's counters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def aggregate(rows: Sequence[dict[str, Any]], steps: int) -> dict[str, Any]:
    """tau = 1 + accepted / drafts and the per-position rates over ``rows`` (vLLM's definitions)."""
    drafts = sum(r["num_drafts"] for r in rows)
    accepted = sum(r["num_accepted_tokens"] for r in rows)
    per_pos = [sum(r["num_accepted_tokens_per_pos"][k] for r in rows) for k in range(steps)]
    return {"requests": len(rows), "tau": 1.0 + accepted / drafts if drafts else 1.0,
            "accept_rate": [p / drafts if drafts else 0.0 for p in per_pos], "num_drafts": drafts,
            "num_draft_tokens": sum(r["num_draft_tokens"] for r in rows), "num_accepted_tokens": accepted,
            "num_accepted_tokens_per_pos": per_pos,
            "output_tokens": sum(len(r["output_token_ids"]) for r in rows)}
