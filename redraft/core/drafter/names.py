"""The drafter's parameter names are the serving names: what the model module needs of the serving checkpoint.

The model (``redraft.core.drafter.modeling``) names its parameters as both engines' checkpoints do (un-prefixed
``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``); reading a foreign checkpoint maps its names
here. Everything else about the serving checkpoint (the tensor table, ``config.json``) is the serving format's
(``redraft.core.drafter.serving_format``), which the model does not import.
"""

from __future__ import annotations

EMBED_KEY = "embed_tokens.weight"  # the target's embedding: never in a serving checkpoint


def canonical_key(key: str, block: bool = False) -> str:
    """Our name for an SGLang-internal or speculators-style name (``model.`` prefix, ``layers.0.``); for a DFlash
    drafter (``block``) only the prefix goes: ``layers.{i}`` are its own names."""
    if key.startswith("model."):
        key = key[len("model."):]
    if key.startswith("layers.0.") and not block:
        key = "midlayer." + key[len("layers.0."):]
    return key
