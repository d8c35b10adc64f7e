"""Test-wide settings: no hub, no wandb network, CPU DeepSpeed, small thread pools."""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
# One converted SmolLM2 for the whole suite (and for later runs on the same checkout).
os.environ.setdefault("REDRAFT_CACHE", str(ROOT / ".cache" / "redraft"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

torch.set_num_threads(1)
