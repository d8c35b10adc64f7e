"""extract.progress: long stages log where they are on a timer, also while nothing advances."""

from __future__ import annotations

import logging
import time

import pytest

from extract.config import ConfigError, ExtractConfig, parse_args
from extract.progress import Heartbeat, advance
from extract.self_prompts import SelfPromptOptions


def test_the_heartbeat_logs_on_a_timer_with_done_total_rate_and_time_left(caplog):
    caplog.set_level(logging.INFO, logger="extract.progress")
    with Heartbeat("capture shard 0", total=10, unit="samples", every=0.05):
        advance(4, tokens=400)
        time.sleep(0.2)  # a long engine call: the timer keeps logging
    lines = [r.getMessage() for r in caplog.records if r.name == "extract.progress"]
    assert len(lines) >= 3
    assert lines[0].startswith("capture shard 0: 4/10 samples, ") and "tok/s" in lines[0] and "left" in lines[0]
    assert "last progress" in lines[-2]  # said while nothing advanced
    assert lines[-1].endswith("(done)")


def test_advance_outside_a_heartbeat_does_nothing_and_inner_ones_count_their_own():
    advance(5)  # no open heartbeat: no error, nothing counted
    with Heartbeat("outer", every=60) as outer:
        advance(1)
        with Heartbeat("inner", total=2, every=60) as inner:
            advance(2, tokens=7)
        advance(1)
    assert (outer.items, inner.items, inner.tokens) == (2, 2, 7)


def test_an_unknown_total_has_no_time_left():
    beat = Heartbeat("regenerate shard 3", unit="replies", every=60)
    beat.advance(3, 90)
    line = beat.line()
    assert line.startswith("regenerate shard 3: 3 replies, ") and "left" not in line


def _cfg(**kw) -> ExtractConfig:
    base = dict(target="t", data=["self"], out="o", regenerate=True, rank=0, world_size=1)
    base.update(kw)
    return ExtractConfig(**base).validate()


def test_max_samples_bounds_what_data_self_samples():
    opts = SelfPromptOptions.from_config(_cfg(max_samples=24))
    assert (opts.prompts, opts.max_samples) == (24, 96)  # not 1,000 prompts from up to 4,000 samples
    opts = SelfPromptOptions.from_config(_cfg(max_samples=24, self_prompts=10, self_max_samples=15))
    assert (opts.prompts, opts.max_samples) == (10, 15)
    assert SelfPromptOptions.from_config(_cfg()).prompts == 1000


def test_engine_args_from_json_on_the_command_line_and_a_yaml_mapping(tmp_path):
    cfg = parse_args(["--target", "t", "--data", "d", "--out", "o", "--backend", "sglang", "--engine-args",
                      '{"mem_fraction_static": 0.85, "enable_deterministic_inference": true}', "--rank", "0",
                      "--world-size", "1"])
    assert cfg.engine_args == {"mem_fraction_static": 0.85, "enable_deterministic_inference": True}
    yaml = tmp_path / "x.yaml"
    yaml.write_text("target: t\ndata: [d]\nout: o\nbackend: vllm\nengine_args:\n  tensor_parallel_size: 8\n")
    cfg = parse_args(["--config", str(yaml), "--rank", "0", "--world-size", "1"])
    assert cfg.engine_args == {"tensor_parallel_size": 8}
    with pytest.raises(ConfigError, match="engine_args.*--backend hf takes none"):
        _cfg(data=["d"], regenerate=False, engine_args={"x": 1})
    with pytest.raises(ConfigError, match="engine_args"):
        parse_args(["--target", "t", "--data", "d", "--out", "o", "--engine-args", "[1, 2]"])
