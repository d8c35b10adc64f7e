"""Every command line spells its flags with hyphens in --help and accepts the underscore spelling too."""

from __future__ import annotations

import re

import pytest

from redraft.core.config import hyphenate_flags
from redraft.core.options import parse

PARSERS = {
    "python -m extract": "extract.config",
    "python -m extract.verify": "extract.verify",
    "train/main.py": "train.config",
    "python -m eval.acceptance": "eval.acceptance",
    "python -m eval.online": "eval.online",
    "python -m eval.engine_truth": "eval.engine_truth",
    "python -m eval.export": "eval.export",
    "python -m serve.bench": "serve.bench",
    "python -m eval.verify_engine": "eval.verify_engine",
    "python -m serve.tune": "serve.tune",
    "python -m redraft.pipeline.tune": "redraft.pipeline.tune",
}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_help_spells_flags_with_hyphens(command):
    module = __import__(PARSERS[command], fromlist=["build_parser"])
    text = module.build_parser().format_help()
    flags = re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", text)
    assert flags, command
    assert not [f for f in flags if "_" in f], f"{command} --help spells flags with underscores"


def test_hyphenate_flags_leaves_values_and_positionals_alone():
    argv = ["ckpt_dir", "--max_new_tokens", "8", "--out=runs/a_b", "--data", "x_y.jsonl", "--", "--keep_me"]
    assert hyphenate_flags(argv) == ["ckpt_dir", "--max-new-tokens", "8", "--out=runs/a_b", "--data", "x_y.jsonl",
                                     "--", "--keep_me"]


def test_underscore_spelling_is_accepted_everywhere(tmp_path):
    from extract.config import parse_args as extract_args
    from train.config import load_config

    cfg = extract_args(["--target", "t", "--data", "d", "--out", "o", "--max_new_tokens", "5", "--max-user-turns", "2"])
    assert (cfg.max_new_tokens, cfg.max_user_turns) == (5, 2)
    train = load_config(None, ["--data", "d", "--out", "o", "--max_steps", "3", "--ttt-steps", "4"])
    assert (train.max_steps, train.ttt_steps) == (3, 4)
    from eval.acceptance import DESCRIPTION, PROG, AcceptanceOptions

    acc = parse(AcceptanceOptions, ["ckpt", "--data", "d", "--num_draft_tokens", "6", "--batch-tokens", "9"],
                prog=PROG, description=DESCRIPTION)
    assert (acc.num_draft_tokens, acc.batch_tokens, acc.checkpoints) == (6, 9, ["ckpt"])
    from eval.verify_engine import PROG as VE_PROG
    from eval.verify_engine import VerifyEngineOptions

    ve = parse(VerifyEngineOptions, ["folder", "--engine", "vllm", "--context_length", "64"], prog=VE_PROG,
               description="")
    assert ve.context_length == 64
    from eval.online import parse_options as online_options

    on = online_options(["ckpt", "--data", "d", "--max_new_tokens", "7"])
    assert on.max_new_tokens == 7


def test_extract_list_options_take_commas(tmp_path):
    """--aux-layer-ids 1,14,29 (redraft.pipeline.tune passes a drafter's layers that way); a config file's YAML list too."""
    from extract.config import parse_args

    base = ["--target", "m", "--data", "d.jsonl", "--out", "o"]
    assert parse_args([*base, "--aux-layer-ids", "1,14,29"]).aux_layer_ids == [1, 14, 29]
    cfg = tmp_path / "x.yaml"
    cfg.write_text("aux_layer_ids: [2, 5, 7]\n")
    assert parse_args([*base, "--config", str(cfg)]).aux_layer_ids == [2, 5, 7]
