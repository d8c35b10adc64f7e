"""redraft.core.options: one dataclass is a command's --help, YAML keys and values; mistakes are one ConfigError line."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from redraft.core.config import ByteSize, ConfigError
from redraft.core.options import build_parser, option, parse


@dataclass(kw_only=True)  # required options may follow optional ones
class Opts:
    ckpt: str = option(help="a checkpoint", group="inputs", positional=True)
    data: list[str] = option([], "datasets", group="inputs")
    steps: int = option(3, "draft steps", group="model")
    width: int | None = option(None, "optional width", group="model")
    betas: tuple[float, float] = option((0.9, 0.95), "two floats", group="model")
    engine: str = option("vllm", "engine", group="engine", choices=("vllm", "sglang"))
    engine_args: dict = option({}, "engine settings", group="engine")
    window: ByteSize = option(ByteSize(0), "bytes", group="storage")
    stream: bool = option(False, "a switch", group="storage")
    out: str = option(help="where", group="output")

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"steps: must be >= 1, got {self.steps}")


def _parse(argv, **kw):
    return parse(Opts, argv, prog="cmd", description="d", **kw)


def test_flags_of_every_type():
    o = _parse(["C", "--out", "O", "--data", "a,b", "--data", "c", "--steps", "1e1", "--width", "8",
                "--betas", "0.8,0.9", "--engine", "sglang", "--engine-args", '{"x": 1}', "--window", "2MiB",
                "--stream"])
    assert (o.ckpt, o.out, o.data, o.steps, o.width, o.betas) == ("C", "O", ["a", "b", "c"], 10, 8, (0.8, 0.9))
    assert (o.engine, o.engine_args, o.window, o.stream) == ("sglang", {"x": 1}, 2 << 20, True)
    assert _parse(["C", "--out=O", "--stream", "false"]).stream is False
    assert _parse(["C", "--out", "O", "--stream", "--no-stream"]).stream is False
    assert _parse(["C", "--out", "O", "--width", "none"]).width is None


def test_yaml_then_flags_and_unknown_keys_by_name(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("out: O\nsteps: 5\ndata: [x, y]\nstream: true\n")
    o = _parse(["C", "--config", str(cfg), "--steps", "2"])
    assert (o.out, o.steps, o.data, o.stream) == ("O", 2, ["x", "y"], True)
    cfg.write_text("out: O\nstep: 5\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown key 'step' \(known: .*steps"):
        _parse(["C", "--config", str(cfg)])
    cfg.write_text("out: O\nengine: tgi\n")
    with pytest.raises(ConfigError, match=r"engine='tgi': expected one of \['vllm', 'sglang'\]"):
        _parse(["C", "--config", str(cfg)])


@pytest.mark.parametrize("argv,pattern", [
    (["C"], r"^cmd: --out is required \(see cmd --help\)$"),
    ([], r"^cmd: the following arguments are required: ckpt \(see cmd --help\)$"),
    (["C", "--out", "O", "--stepz", "2"], r"unrecognized arguments: --stepz 2 \(see cmd --help\)"),
    (["C", "--out", "O", "--steps", "two"], r"^steps='two': expected an integer$"),
    (["C", "--out", "O", "--steps", "0"], r"^steps: must be >= 1, got 0$"),
    (["C", "--out", "O", "--engine", "tgi"], r"argument --engine: invalid choice: 'tgi'"),
    (["C", "--out", "O", "--betas", "1"], r"^betas='1': expected 2 comma-separated values$"),
    (["C", "--out", "O", "--stream", "maybe"], r"^stream='maybe': expected a boolean"),
    (["C", "--out", "O", "--window", "lots"], r"^window='lots': not a size in bytes"),
])
def test_mistakes_are_one_line_naming_the_option(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _parse(argv)


def test_help_is_grouped_in_declaration_order():
    text = build_parser(Opts, prog="cmd", description="d").format_help()
    heads = [h for h in ("inputs:", "model:", "engine:", "storage:", "output:", "config:") if h in text]
    assert heads == ["inputs:", "model:", "engine:", "storage:", "output:", "config:"]
    assert [text.index(h) for h in heads] == sorted(text.index(h) for h in heads)
    assert "(default: 3)" in text and "--no-stream" not in text and "(default: required)" in text


def test_to_argv_is_read_back_as_the_same_options():
    from redraft.core.options import to_argv

    o = _parse(["C", "--out", "O", "--data", "a,b", "--width", "8", "--betas", "0.8,0.9", "--engine", "sglang",
                "--engine-args", '{"x": 1}', "--window", "2MiB", "--stream"])
    argv = to_argv(o)
    assert argv[0] == "C" and "--steps" not in argv  # defaults are left out
    assert _parse(argv) == o
    back = _parse(["C", "--out", "O", "--width", "none", "--no-stream"])
    assert _parse(to_argv(back)) == back
    assert "--engine" not in to_argv(o, skip=("engine",))
