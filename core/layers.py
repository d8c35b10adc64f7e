"""The one place that owns redraft's layer-id convention (what "aux layer i" means, here and in each engine).

Convention: id ``i`` is the residual stream leaving decoder layer ``i`` (0-based), i.e. HF
``output_hidden_states[i + 1]``, i.e. what SGLang/vLLM capture at the *input* of layer ``i + 1``.
Serving engines disagree on how they read configured ids, so every conversion to or from an
engine's ``eagle_aux_hidden_state_layer_ids`` goes through :func:`to_engine_layer_ids` /
:func:`from_engine_layer_ids` and nowhere else.

One HF quirk: for the last layer (i = L-1) HF's ``hidden_states[L]`` is already post-final-norm, while
redraft (like vLLM's end_layer capture) keeps the pre-norm output of layer L-1.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

AUX_LAYER_CONVENTION = (
    "aux layer id i = output of decoder layer i (0-based) = HF output_hidden_states[i+1] "
    "= the residual stream SGLang/vLLM capture at the input of layer i+1"
)

ENGINES = ("sglang", "vllm")

# Architectures served by SGLang's deepseek_v2.py, which adds 1 to configured ids only when ids[0] == 1.
_DEEPSEEK_FAMILY = re.compile(r"^(DeepseekV2|DeepseekV3|KimiK2|KimiK25)", re.IGNORECASE)

def default_aux_layer_ids(num_layers: int, architecture: str | None = None) -> list[int]:
    """Low/middle/high layers: ``[1, L//2 - 1, L - 4]`` (SpecForge's default, same tensors as the engines').

    Tiny test models (3 <= L < 8) get three distinct ascending ids that avoid the last layer when possible (and
    layer 0 from 5 layers on: SGLang's DeepSeek family cannot be told to capture it, see :func:`check_servable`).
    """
    n = int(num_layers)
    if n < 3:
        raise ValueError(f"need at least 3 decoder layers to pick 3 aux layers, got num_layers={n}")
    if n >= 8:
        return [1, n // 2 - 1, n - 4]
    low = 1 if n >= 5 else 0
    high = n - 2 if n >= 4 else n - 1
    if n == 4 and serving_family(architecture or "") == "deepseek":
        return [1, 2, 3]  # layer 0 cannot be asked of SGLang's deepseek_v2.py; the last layer can
    return [low, (low + high) // 2, high]


def validate_aux_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Return ids sorted ascending (the concatenation order of aux features); reject bad ones loudly."""
    ids = list(ids)
    if not ids:
        raise ValueError("aux layer ids must name at least one layer, got []")
    out: list[int] = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"aux layer id {i!r} is not an int (valid range [0, {num_layers}))")
        if not 0 <= i < num_layers:
            raise ValueError(f"aux layer id {i} is out of range [0, {num_layers}) for a {num_layers}-layer target")
        if i in out:
            raise ValueError(f"aux layer id {i} appears twice in {ids}")
        out.append(i)
    return sorted(out)


def check_servable(ids: Sequence[int], architecture: str) -> None:
    """Refuse ids that some engine cannot be configured to capture for ``architecture`` (checked before any work,
    so an extraction or a training run does not end in an export that cannot be written)."""
    for engine in ENGINES:
        try:
            to_engine_layer_ids(ids, engine, architecture)
        except ValueError as e:
            raise ValueError(f"aux layer ids {sorted(ids)}: {e}") from None


def serving_family(architecture: str) -> str:
    """"deepseek" when SGLang serves the target with deepseek_v2.py (its ids[0]==1 heuristic), else "llama"."""
    return "deepseek" if _DEEPSEEK_FAMILY.match(architecture or "") else "llama"


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"unknown serving engine {engine!r}; expected one of {ENGINES}")


def to_engine_layer_ids(ids: Sequence[int], engine: str, architecture: str) -> list[int]:
    """The ``eagle_config.eagle_aux_hidden_state_layer_ids`` that make ``engine`` capture exactly ``ids``.

    SGLang llama.py adds 1 itself, so our ids go as they are. SGLang deepseek_v2.py adds 1 only when
    ids[0] == 1, so we write input-of-layer ids (``i + 1``), which is also what vLLM reads.
    """
    _check_engine(engine)
    ids = sorted(int(i) for i in ids)
    if not ids:
        raise ValueError("no layer ids to convert")
    if min(ids) < 0:
        raise ValueError(f"negative layer id in {ids}")
    if engine == "sglang" and serving_family(architecture) == "llama":
        return ids
    shifted = [i + 1 for i in ids]
    if engine == "sglang" and shifted[0] == 1:
        raise ValueError(
            f"layer ids {ids} cannot be expressed for SGLang's deepseek_v2.py ({architecture}): engine id 1 "
            "would be shifted again by its ids[0]==1 heuristic; use ids whose smallest is >= 1"
        )
    return shifted


def from_engine_layer_ids(ids: Sequence[int], engine: str, architecture: str) -> list[int]:
    """Inverse of :func:`to_engine_layer_ids`: what an existing drafter config's ids mean in our convention.

    For SGLang's deepseek family both ``[1, 29, 57]`` and ``[2, 30, 58]`` mean our ``[1, 29, 57]``.
    """
    _check_engine(engine)
    ids = sorted(int(i) for i in ids)
    if not ids:
        raise ValueError("no layer ids to convert")
    if engine == "sglang" and (serving_family(architecture) == "llama" or ids[0] == 1):
        ours = ids
    else:
        ours = [i - 1 for i in ids]
    if min(ours) < 0:
        raise ValueError(
            f"{engine} layer ids {ids} ({architecture}) include the embedding output (input of layer 0), "
            "which is not a decoder-layer output"
        )
    return ours
