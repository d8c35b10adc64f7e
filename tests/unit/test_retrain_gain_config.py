"""The shipped benchmarks/retrain_gain.py configs load and pass its checks; a bad key is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import retrain_gain as rg
from helpers_paths import ROOT


@pytest.mark.parametrize("name", ["retrain_gain.yaml", "retrain_budget.yaml"])
def test_shipped_configs_load(name: str) -> None:
    cfg = rg.BenchConfig.load(ROOT / "configs" / "demo" / name)
    assert (ROOT / cfg.train_config).is_file()
    assert cfg.scaled(0.25).train_prompts == round(cfg.train_prompts * 0.25)


def test_budget_multiples_are_checked(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("budget_multiples: [1]\n")
    with pytest.raises(rg.BenchError, match="budget_multiples must be integers >= 2"):
        rg.BenchConfig.load(bad)
    bad.write_text("budget_multipels: [2]\n")
    with pytest.raises(rg.BenchError, match=r"unknown key\(s\) \['budget_multipels'\]"):
        rg.BenchConfig.load(bad)
