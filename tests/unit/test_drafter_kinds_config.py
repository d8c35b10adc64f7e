"""benchmarks/drafter_kinds.py's shipped configs (the kinds comparison and issue 36's methods table): every (target,
kind, method) command they would run parses as a valid train config of that kind (so a broken pairing is found here,
not an hour into the benchmark)."""

from __future__ import annotations

from pathlib import Path

import drafter_kinds as dk
import pytest
from helpers_paths import ROOT

from train.config import parse_cli

CFG = dk.KindsConfig.load(dk.DEFAULT_CONFIG, {})
METHODS_CFG = dk.KindsConfig.load(ROOT / "configs/demo/drafter_methods.yaml", {})
COMMANDS = [(cfg, spec, *v) for cfg in (CFG, METHODS_CFG) for spec in cfg.targets for v in dk.variants(cfg, spec)]


@pytest.mark.parametrize("bench,spec,name,kind,method", COMMANDS,
                         ids=[f"{c is CFG and 'kinds' or 'methods'}-{dk.target_slug(s)}-{n}" for c, s, n, _, _ in COMMANDS])
def test_every_training_command_parses(bench: dk.KindsConfig, spec: dk.TargetSpec, name: str, kind: str, method: str,
                                       tmp_path: Path) -> None:
    cmd = dk.train_cmd(bench, spec, kind, 1, tmp_path / "data", tmp_path / "out", method)
    assert cmd[1] == "train/main.py"
    cfg = parse_cli(cmd[2:])
    assert cfg.drafter_attention == kind and cfg.drafter_method == method
    assert cfg.seed == 1 and cfg.max_steps == bench.steps
    if kind == "mla":
        assert cfg.num_key_value_heads is None and cfg.head_dim is None
    for key, value in (spec.mla if kind == "mla" else spec.gqa).items():
        assert getattr(cfg, key) == value


def test_both_targets_and_their_online_kinds() -> None:
    assert {dk.target_slug(t): t.online for t in CFG.targets} == {"smollm2-135m-instruct": ["gqa"],
                                                                  "kimi-k25-mini": ["mla"]}


def test_unknown_target_key_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("targets:\n  - {name: x, train_config: y, gqa_sizes: {}}\n")
    with pytest.raises(dk.BenchError, match=r"targets\[0\] has unknown keys \['gqa_sizes'\]"):
        dk.KindsConfig.load(bad, {})


def test_every_method_for_the_attention_kinds_it_is_served_with() -> None:
    assert [name for name, _, _ in dk.variants(CFG)] == ["gqa", "mla", "gqa-eagle3.1", "mla-eagle3.1", "gqa-p-eagle",
                                                       "gqa-dflash"]


def test_the_methods_table_trains_what_vllm_cpu_serves_beside_each_target() -> None:
    got = {dk.target_slug(t): [n for n, _, _ in dk.variants(METHODS_CFG, t)] for t in METHODS_CFG.targets}
    assert got == {"smollm2-135m-instruct": ["gqa", "gqa-eagle3.1", "gqa-p-eagle", "gqa-dflash"],
                   "kimi-k25-mini": ["mla", "mla-eagle3.1"]}
    assert all(t.online == t.kinds for t in METHODS_CFG.targets)


def test_an_unknown_attention_kind_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("targets:\n  - {name: x, train_config: y, kinds: [gqa, mqa]}\n")
    with pytest.raises(dk.BenchError, match=r"targets\[0\]\.kinds \['gqa', 'mqa'\] must name some of"):
        dk.KindsConfig.load(bad, {})


def test_the_speed_up_is_read_from_a_real_serve_tune_report() -> None:
    import json

    report = json.loads((ROOT / "docs/results/serving-tune/B-mtbench/report.json").read_text())
    got = dk.speedups(report, 3)
    assert set(got) == {"1", "4", "16"}
    for level in report["answer"]["per_concurrency"]:
        want = next(s for s in level["settings"] if s["k"] == 3)
        assert got[str(level["concurrency"])]["speedup"] == want["speedup"]["median"]
    with pytest.raises(dk.BenchError, match="no chain of 9"):
        dk.speedups(report, 9)


def test_one_target_is_selected_by_name() -> None:
    kimi = dk.select_targets(METHODS_CFG, ["kimi-k25-mini"])
    assert [t.name for t in kimi.targets] == ["kimi-k25-mini"] and kimi.steps == METHODS_CFG.steps
    both = dk.select_targets(METHODS_CFG, ["kimi-k25-mini", "smollm2-135m-instruct"])
    assert [t.name for t in both.targets] == [t.name for t in METHODS_CFG.targets]


def test_an_unknown_target_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        dk.main(["--out", str(tmp_path / "w"), "--config", str(ROOT / "configs/demo/drafter_methods.yaml"),
                 "--target", "kimi-k2"])
    assert e.value.code == 2 and "'kimi-k2' is not a target" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
