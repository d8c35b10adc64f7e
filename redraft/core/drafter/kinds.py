"""The one place a drafter module is chosen from its config: the EAGLE layer (eagle3, eagle3.1, p-eagle) or DFlash's
block (dflash), as transformers picks a class by config."""

from __future__ import annotations

from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.dflash import DFlashDrafter
from redraft.core.drafter.modeling import DrafterBase, Eagle3Drafter


def build_drafter(config: DrafterConfig, attention_impl: str = "eager") -> DrafterBase:
    """A freshly initialised drafter of ``config``'s method."""
    cls = DFlashDrafter if config.block else Eagle3Drafter
    return cls(config, attention_impl=attention_impl)
