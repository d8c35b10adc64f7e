"""What every engine client is asked: prompt ids, a token budget, the sampling, the ids to stop at."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


def sglang_sampling_params(req: TokenRequest) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for a request (the server's ``/generate`` and ``Engine.generate`` alike): every
    knob explicit, and the stop id kept in ``output_ids`` (``no_stop_trim``)."""
    params: dict[str, Any] = {
        "max_new_tokens": int(req.max_tokens), "temperature": float(req.temperature),
        "top_p": float(req.top_p) if req.temperature > 0 else 1.0, "top_k": -1, "min_p": 0.0,
        "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_new_tokens": 0,
        "no_stop_trim": True,
    }
    if req.stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in req.stop_token_ids]
    if req.temperature > 0 and req.seed is not None:
        params["sampling_seed"] = int(req.seed)
    return params
