"""A drafter folder as the check reads it: config.json, model.safetensors, and which architecture.

Refusals raise ``FolderError`` naming the file and key, so "could not run" is never confused with
"the engine refused the checkpoint".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WEIGHTS = "model.safetensors"
LLAMA = "llama"
MLA = "mla"
# architecture name in config.json -> drafter kind (the engines map both names of a kind to one class)
ARCHITECTURES = {
    "LlamaForCausalLMEagle3": LLAMA,
    "Eagle3LlamaForCausalLM": LLAMA,
    "Eagle3DeepseekV2ForCausalLM": MLA,
    "Eagle3DeepseekV3ForCausalLM": MLA,
}


class FolderError(ValueError):
    """The folder cannot be checked at all (missing file, unreadable JSON, unknown architecture)."""


@dataclass
class DrafterFolder:
    path: Path
    config: dict[str, Any]
    kind: str  # LLAMA | MLA
    architecture: str

    @property
    def draft_vocab(self) -> int | None:
        v = self.config.get("draft_vocab_size")
        return int(v) if v is not None else None

    @property
    def vocab(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def aux_layer_ids(self) -> list[int]:
        ids = (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return [int(i) for i in ids] if ids else []

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor, read once (the per-key loads reuse them)."""
        from safetensors import safe_open

        with safe_open(str(self.path / WEIGHTS), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}


def read_folder(path: str | Path) -> DrafterFolder:
    """The folder's config and kind; FolderError names what is missing or wrong."""
    path = Path(path).resolve()
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FolderError(f"{cfg_file}: no such file (a drafter folder holds config.json and {WEIGHTS})")
    if not (path / WEIGHTS).is_file():
        others = sorted(p.name for p in path.glob("*.safetensors*")) or ["none"]
        raise FolderError(f"{path / WEIGHTS}: no such file (only a single {WEIGHTS} is checked; "
                          f"found: {', '.join(others)})")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise FolderError(f"{cfg_file}: not JSON ({e})") from e
    archs = config.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1:
        raise FolderError(f"{cfg_file}: key 'architectures' must be a list of one name, got {archs!r}")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise FolderError(f"{cfg_file}: architectures[0] {arch!r} is not an EAGLE-3 drafter this check knows "
                          f"({', '.join(sorted(ARCHITECTURES))})")
    for key in ("vocab_size", "hidden_size"):
        if not isinstance(config.get(key), int):
            raise FolderError(f"{cfg_file}: key {key!r} must be an integer, got {config.get(key)!r}")
    return DrafterFolder(path=path, config=config, kind=ARCHITECTURES[arch], architecture=arch)
