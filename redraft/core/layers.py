"""The one place that owns redraft's layer-id convention (what "aux layer i" means, here and in each engine).

Convention: id ``i`` is the residual stream leaving decoder layer ``i`` (0-based), i.e. HF
``output_hidden_states[i + 1]``, i.e. what SGLang/vLLM capture at the *input* of layer ``i + 1``.
Serving engines disagree on how they read configured ids, so every conversion to or from an
engine's ``eagle_aux_hidden_state_layer_ids`` goes through :func:`to_engine_layer_ids` /
:func:`from_engine_layer_ids` and nowhere else.

What each engine does with configured ids (SGLang 0.5.23 proven by capturing every layer it returns and
matching each against the HF backend's per-layer outputs: ``tests/engine/sglang/test_sglang_capture.py``; vLLM 0.32 by
``tests/engine/vllm/test_vllm_capture.py``):

- vLLM: id ``e`` is the input of layer ``e`` (``e = L`` the last layer's output, before the final norm).
- SGLang ``llama.py`` (and the other Llama-style models): captures the input of layer ``e + 1``; ids must be
  ``< L`` (its range check) and the input of layer ``L`` does not exist, so the last layer's output is never
  captured (it silently comes back one layer short).
- SGLang ``deepseek_v2.py`` (DeepSeek-V2/V3, Kimi-K2/K2.5): 0.5.23 captures the input of layer ``e + 1`` when the
  *first* configured id is 1, else the input of layer ``e``; 0.5.10 the input of layer ``e + 1`` for every id
  (sglang#25454); ids must be ``< L``. When our first layer is 1 redraft writes our ids as they are (read alike by
  both versions: Kimi-K2.5's ``[1, 29, 57]``); otherwise input-of-layer ids (``i + 1``), never with 1 first, which
  0.5.23 reads as asked (0.5.10 one layer deeper: ``serve.doctor`` says so), layer 0's output included; the last
  layer's output is out of reach here too.

So for SGLang an aux layer is one of ``0 .. L-2``; for vLLM one of ``0 .. L-1``.

One HF quirk: for the last layer (i = L-1) HF's ``hidden_states[L]`` is already post-final-norm, while
redraft (like vLLM's end_layer capture) keeps the pre-norm output of layer L-1.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from redraft.core.errors import UserError

AUX_LAYER_CONVENTION = (
    "aux layer id i = output of decoder layer i (0-based) = HF output_hidden_states[i+1] "
    "= the residual stream SGLang/vLLM capture at the input of layer i+1"
)

ENGINES = ("sglang", "vllm")


class LayerError(UserError):
    """Aux layer ids that a target or an engine cannot take; the message names the ids and the limit."""

# Architectures served by SGLang's deepseek_v2.py, which adds 1 to configured ids only when ids[0] == 1.
_DEEPSEEK_FAMILY = re.compile(r"^(DeepseekV2|DeepseekV3|KimiK2|KimiK25)", re.IGNORECASE)

MIN_LAYERS = 4  # three distinct aux layers that every engine can capture: 0 .. L-2 (SGLang never returns L-1)


def default_aux_layer_ids(num_layers: int, architecture: str | None = None) -> list[int]:
    """Low/middle/high layers: ``[1, L//2 - 1, L - 4]`` (SpecForge's default, same tensors as the engines').

    Small test models (4 <= L < 8) get three distinct ascending ids below the last layer (which SGLang cannot
    capture), avoiding layer 0 from 5 layers on. ``architecture`` is accepted for symmetry and changes nothing:
    the same ids are capturable in every engine for every family.
    """
    del architecture
    n = int(num_layers)
    if n < MIN_LAYERS:
        raise LayerError(f"need at least {MIN_LAYERS} decoder layers to pick 3 aux layers every engine can capture "
                         f"(SGLang never returns the last layer's output), got num_layers={n}")
    if n >= 8:
        return [1, n // 2 - 1, n - 4]
    low = 1 if n >= 5 else 0
    high = n - 2
    return [low, (low + high) // 2, high]


def validate_aux_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Return ids sorted ascending (the concatenation order of aux features); reject bad ones loudly."""
    ids = list(ids)
    if not ids:
        raise LayerError("aux layer ids must name at least one layer, got []")
    out: list[int] = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise LayerError(f"aux layer id {i!r} is not an int (valid range [0, {num_layers}))")
        if not 0 <= i < num_layers:
            raise LayerError(f"aux layer id {i} is out of range [0, {num_layers}) for a {num_layers}-layer target")
        if i in out:
            raise LayerError(f"aux layer id {i} appears twice in {ids}")
        out.append(i)
    return sorted(out)


def check_servable(ids: Sequence[int], architecture: str, num_layers: int | None = None) -> None:
    """Refuse ids that some engine cannot be configured to capture for ``architecture`` (checked before any work,
    so an extraction or a training run does not end in an export that cannot be served). ``num_layers``: the
    target's depth, needed to refuse its last layer (SGLang never captures it)."""
    for engine in ENGINES:
        try:
            to_engine_layer_ids(ids, engine, architecture, num_layers)
        except LayerError as e:
            raise LayerError(f"aux layer ids {sorted(ids)}: {e}") from None


def serving_family(architecture: str) -> str:
    """"deepseek" when SGLang serves the target with deepseek_v2.py (its ids[0]==1 heuristic), else "llama"."""
    return "deepseek" if _DEEPSEEK_FAMILY.match(architecture or "") else "llama"


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise LayerError(f"unknown serving engine {engine!r}; expected one of {ENGINES}")


def to_engine_layer_ids(ids: Sequence[int], engine: str, architecture: str,
                        num_layers: int | None = None) -> list[int]:
    """The ``eagle_config.eagle_aux_hidden_state_layer_ids`` that make ``engine`` capture exactly ``ids``.

    vLLM and SGLang's deepseek_v2.py read input-of-layer ids (``i + 1``); for the latter the list never starts
    with 1 (which would shift every id again), so when our layer 0 is asked for, its engine id goes last.
    SGLang's llama.py adds 1 itself, so our ids go as they are. For SGLang, ``num_layers`` (when known) refuses
    the last layer, whose output it never captures.
    """
    _check_engine(engine)
    ids = sorted(int(i) for i in ids)
    if not ids:
        raise LayerError("no layer ids to convert")
    if min(ids) < 0:
        raise LayerError(f"negative layer id in {ids}")
    if engine == "sglang" and num_layers is not None and max(ids) >= int(num_layers) - 1:
        raise LayerError(
            f"layer {max(ids)} cannot be captured by SGLang for a {num_layers}-layer target ({architecture}): "
            f"SGLang captures the input of layer i + 1, and the last layer ({int(num_layers) - 1}) has no next "
            f"layer; use ids up to {int(num_layers) - 2}"
        )
    if engine == "sglang" and serving_family(architecture) == "llama":
        return ids
    if engine == "sglang" and ids[0] == 1:
        return ids  # first id 1: SGLang adds 1 to each, 0.5.10 (every id) and 0.5.23 (first is 1) alike
    shifted = [i + 1 for i in ids]
    if engine == "sglang" and shifted[0] == 1:
        shifted = shifted[1:] + [1]  # deepseek_v2.py shifts every id again when the first is 1
    return shifted


def to_dflash_layer_ids(ids: Sequence[int], architecture: str) -> list[int]:
    """``dflash_config.target_layer_ids`` that make vLLM capture exactly ``ids``: vLLM adds 1 to each to get the
    ids it captures (``get_eagle3_aux_layers_from_config``), so they are its EAGLE ids less one."""
    return [i - 1 for i in to_engine_layer_ids(ids, "vllm", architecture)]


def from_engine_layer_ids(ids: Sequence[int], engine: str, architecture: str) -> list[int]:
    """Inverse of :func:`to_engine_layer_ids`: what an existing drafter config's ids mean in our convention.

    For SGLang's deepseek family the rule reads the first id *as written*: both ``[1, 29, 57]`` and
    ``[2, 30, 58]`` mean our ``[1, 29, 57]``, and ``[2, 3, 1]`` means our ``[0, 1, 2]``.
    """
    _check_engine(engine)
    written = [int(i) for i in ids]
    if not written:
        raise LayerError("no layer ids to convert")
    if engine == "sglang" and (serving_family(architecture) == "llama" or written[0] == 1):
        ours = sorted(written)
    else:
        ours = sorted(i - 1 for i in written)
    if min(ours) < 0:
        raise LayerError(
            f"{engine} layer ids {written} ({architecture}) include the embedding output (input of layer 0), "
            "which is not a decoder-layer output"
        )
    return ours


# SGLang's reading of a DeepSeek-family drafter's ids changed (sglang#25454): 0.5.10 adds 1 to every id; 0.5.23 adds 1
# only when the first id is 1 (models/deepseek_v2.py set_eagle3_layers_to_capture). Which release between them first
# had the change is not known here; 0.5.9's Kimi-K2.5 wrapper forwards no EAGLE-3 capture at all (0.5.10 adds it).
SGLANG_SHIFT_ALWAYS = (0, 5, 10)  # the version known to add 1 to every id
SGLANG_SHIFT_FIRST_IS_1 = (0, 5, 23)  # from this version on: add 1 only when the first id is 1


# The engine versions whose reading of a drafter's ids is known here (from each version's source), which an export
# records it was checked against: SGLang's two rules above; vLLM reads input-of-layer ids in the versions its tests
# serve (0.32 on the CPU, 0.33 in the loader checks).
CHECKED_VERSIONS = {"sglang": ("0.5.10", "0.5.23"), "vllm": ("0.32", "0.33")}


def versions_reading(written: Sequence[int], engine: str, architecture: str, trained: Sequence[int]) -> dict[str, bool]:
    """Per engine version of :data:`CHECKED_VERSIONS`: does it capture the layers ``trained`` (our convention) for a
    drafter config that asks ``written``?"""
    _check_engine(engine)
    out = {}
    for version in CHECKED_VERSIONS[engine]:
        read = (sglang_read_layer_ids(written, architecture, version) if engine == "sglang"
                else from_engine_layer_ids(written, engine, architecture))
        out[version] = read is not None and read == sorted(int(i) for i in trained)
    return out


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """(0, 5, 23) from "0.5.23", "0.5.23.post1" or "v0.5.23rc0"; None when it is not a version."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or "").strip())
    return None if m is None else tuple(int(g or 0) for g in m.groups())


def sglang_read_layer_ids(written: Sequence[int], architecture: str, version: str | None) -> list[int] | None:
    """The layers (our convention) a given SGLang version captures for a drafter config's ``written`` ids.

    Llama-style targets: the same in every version (llama.py adds 1 itself). DeepSeek family (Kimi-K2/K2.5): 0.5.23
    and later add 1 only when the first id is 1; 0.5.10 adds 1 to every id. None where the version's rule is not
    known here (before 0.5.10, or between 0.5.10 and 0.5.23 with a first id other than 1, where the two rules part).
    """
    written = [int(i) for i in written]
    if serving_family(architecture) == "llama":
        return sorted(written)
    v = parse_version(version)
    if v is None:
        return None
    if v >= SGLANG_SHIFT_FIRST_IS_1:
        return from_engine_layer_ids(written, "sglang", architecture)
    if v == SGLANG_SHIFT_ALWAYS or (v > SGLANG_SHIFT_ALWAYS and written and written[0] == 1):
        return sorted(written)  # input of layer i + 1 for every id: our ids as written
    return None
