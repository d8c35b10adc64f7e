"""What every engine client is asked: prompt ids, a token budget, the sampling, the ids to stop at."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenRequest:
    """Token ids in, token ids out.

    stop_token_ids: stop at exactly these ids, the stop id kept in the output (empty: the model's eos).
    seed: per-request seed for sampled runs (temperature > 0), so that reruns reproduce.
    """

    id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
