"""eval.acceptance: CLI, outputs, split, fit check, import of foreign folders, teacher kinds."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers_acceptance import make_case, write_case_dataset, write_target
from helpers_drafter import tiny_drafter
from safetensors.torch import save_file

from eval import acceptance as acc
from eval import evaluation_inputs as inputs
from eval import simulate as sim
from redraft.core.dataset.reader import DatasetReader
from redraft.core.drafter.folder import write_drafter_folder
from redraft.core.drafter.serving_format import serving_config

STEPS = 3
LENGTHS = [24, 18, 16, 12, 20, 10]


def _write_ckpt(folder, drafter, record):
    folder.mkdir(parents=True)
    write_drafter_folder(folder, drafter.config, drafter.serving_state_dict(), record)
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc")
    good = tiny_drafter(3).eval()
    other = tiny_drafter(5).eval()
    other.embed_tokens.weight.data.copy_(good.embed_tokens.weight)  # one target, one embedding
    case = make_case(good, LENGTHS, steps=STEPS, seed=2)
    lm_head = torch.randn(good.config.vocab_size, good.config.target_hidden_size)
    target = write_target(root / "target", good, lm_head)
    sources = ["alpha", "beta", "alpha", "beta", "alpha", "beta"]
    data = write_case_dataset(root / "data", case, good, target, lm_head, sources=sources)
    greedy = write_case_dataset(root / "greedy", case, good, target, lm_head, generation={"temperature": 0.0})
    val = ["c1", "c2", "c3", "c4", "c5"]
    run = root / "run"
    _write_ckpt(run / "step-0000010", other, {"val_ids": val, "step": 10})
    _write_ckpt(run / "step-0000020", good, {"val_ids": val, "step": 20})
    (run / "latest").write_text("step-0000020\n")
    bad = _write_ckpt(root / "other", other, {"val_ids": ["c2", "c3", "c4", "c5"], "step": 7})
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps(serving_config(good.config)))
    save_file(good.serving_state_dict(), str(foreign / "model.safetensors"))
    return dict(root=root, good=good, case=case, target=target, data=data, greedy=greedy, run=run,
                step10=run / "step-0000010", other=bad, foreign=foreign, val=val)


def test_resolve_run_folder_follows_latest(world):
    assert inputs.resolve_checkpoint(world["run"]) == world["run"] / "step-0000020"
    assert inputs.resolve_checkpoint(world["step10"]) == world["step10"]
    with pytest.raises(acc.AcceptanceError, match="not a drafter folder"):
        inputs.resolve_checkpoint(world["root"])


def test_evaluate_matches_direct_simulation(world):
    """The orchestration (batching, padding, teacher from the stored top-k) reproduces the maths exactly."""
    reader = DatasetReader(world["data"])
    res = acc.evaluate(world["run"], reader, steps=STEPS, split="all", batch_tokens=40)
    case = world["case"]
    chain, _ = sim.simulate_chain_greedy(world["good"], input_ids=case["input_ids"],
                                         aux_hidden=case["aux_hidden"], attention_mask=case["attention_mask"],
                                         loss_mask=case["loss_mask"], target_ids=case["target_ids"], steps=STEPS)
    pp = res["per_position"]  # the diagnostic: the mean over every drafting position
    assert res["positions"] == pp["positions"] == len(chain.sample)
    assert pp["accepted_drafts"] == pytest.approx(float(chain.accepted.double().mean()), abs=1e-9)
    assert pp["tau"] == pytest.approx(1 + float(chain.accepted.double().mean()), abs=1e-9)
    assert pp["accepted_drafts"] > 0.3  # the case is built from this drafter
    for k in range(STEPS):
        assert pp["accept_rate"][k] == pytest.approx(float((chain.accepted > k).double().mean()), abs=1e-9)
        assert pp["tau_per_chain_length"][str(k + 1)] == pytest.approx(
            1 + float(chain.accepted.clamp(max=k + 1).double().mean()), abs=1e-9)
    alpha = chain.sample % 2 == 0
    assert res["by_source"]["alpha"]["per_position_tau"] == pytest.approx(
        1 + float(chain.accepted[alpha].double().mean()), abs=1e-9)
    assert res["by_category"]["odd"]["positions"] == int((~alpha).sum())
    # the headline is the engine walk over the same drafts (eval.engine_walk; checked against an engine
    # emulation in test_engine_walk.py): a different, here smaller, number
    walk = res["engine_walk"]
    assert res["tau_estimator"] == "engine_walk" and res["tau"] == walk["tau"]
    assert walk["tau"] == pytest.approx(1 + walk["accepted_tokens"] / walk["rounds"])
    assert res["accept_rate"] == [a / walk["rounds"] for a in walk["accepted_per_pos"]]
    assert walk["requests"] == sum(1 + (n > 12) for n in LENGTHS)  # make_case's hole splits answers over 12
    assert res["evaluation"] == "estimate" and res["tokens_per_s"] > 0
    assert res["split"] == "all" and res["samples"] == len(LENGTHS)


def test_teacher_from_last_hidden_agrees_with_topk(world):
    reader = DatasetReader(world["data"])
    a = acc.evaluate(world["run"], reader, steps=STEPS, split="all", teacher="topk")
    b = acc.evaluate(world["run"], reader, steps=STEPS, split="all", teacher="last_hidden")
    assert a["tau_per_chain_length"] == b["tau_per_chain_length"]
    assert a["tau"] > 1.3


def _agreement(case):
    """(agreeing, counted) straight from the case: assistant tokens equal to the previous row's argmax; an
    answer's last token off the argmax (a cut answer's closing token, which no engine returns) is not counted."""
    ids, tgt, lm, am = case["input_ids"], case["target_ids"], case["loss_mask"], case["attention_mask"]
    counted = lm[:, 1:] & am[:, 1:]
    same = ids[:, 1:] == tgt[:, :-1]
    last = counted & ~torch.cat((counted[:, 1:], torch.zeros_like(counted[:, :1])), 1)  # last token of each answer
    counted = counted & ~(last & ~same)
    return int((same & counted).sum()), int(counted.sum())


def test_exact_label_comes_from_the_data(world, tmp_path):
    """'exact' iff every counted assistant token is the teacher's argmax; the manifest's word is not enough."""
    good = world["good"]
    lm_head = torch.randn(good.config.vocab_size, good.config.target_hidden_size, generator=torch.Generator().manual_seed(4))
    target = write_target(tmp_path / "target", good, lm_head)
    case = make_case(good, [20, 14, 16], steps=STEPS, seed=5, follow=1.0)
    agree, counted = _agreement(case)
    assert agree == counted  # follow 1.0: the data is the argmax path
    greedy = write_case_dataset(tmp_path / "greedy", case, good, target, lm_head, generation={"temperature": 0.0})
    res = acc.evaluate(world["run"], DatasetReader(greedy), steps=STEPS, split="all")
    assert res["evaluation"] == "exact"
    assert res["data_argmax_agreement"] == {"agreeing": counted, "counted": counted, "fraction": 1.0}
    # one assistant token off the argmax: same manifest (temperature 0), no longer exact
    off = {k: v.clone() for k, v in case.items()}
    off["input_ids"][1, 9] = (off["target_ids"][1, 8] + 1) % good.config.vocab_size
    agree_off, counted_off = _agreement(off)
    assert (agree_off, counted_off) == (counted - 1, counted)
    data = write_case_dataset(tmp_path / "off", off, good, target, lm_head, generation={"temperature": 0.0})
    res = acc.evaluate(world["run"], DatasetReader(data), steps=STEPS, split="all")
    assert res["evaluation"] == "estimate"
    assert res["data_argmax_agreement"]["agreeing"] == agree_off
    assert res["data_argmax_agreement"]["counted"] == counted_off
    assert f"{agree_off} of {counted_off}" in res["evaluation_note"]
    # the world's data (follow 0.85): the fraction reported is the fraction in the data
    a, c = _agreement(world["case"])
    res = acc.evaluate(world["run"], DatasetReader(world["greedy"]), steps=STEPS, split="all")
    assert a < c and res["evaluation"] == "estimate"
    assert res["data_argmax_agreement"]["fraction"] == pytest.approx(a / c)


def test_foreign_folder_gives_the_same_numbers(world, caplog):
    reader = DatasetReader(world["data"])
    ours = acc.evaluate(world["run"], reader, steps=STEPS, split="all")
    with caplog.at_level(logging.WARNING):
        theirs = acc.evaluate(world["foreign"], reader, steps=STEPS, split="val")
    assert "ALL" in caplog.text  # no recorded split: falls back to every sample, loudly
    assert theirs["tau_per_chain_length"] == ours["tau_per_chain_length"]
    assert theirs["step"] is None


def test_split_logic(world, caplog):
    reader = DatasetReader(world["data"])
    rec_a = {"val_ids": world["val"]}
    rec_b = {"val_ids": ["c2", "c3", "c4", "c5", "zz"]}
    assert acc.select_samples(reader, [rec_a], "val") == ([1, 2, 3, 4, 5], "val")
    with caplog.at_level(logging.WARNING):
        idx, desc = acc.select_samples(reader, [rec_a, rec_b, None], "val")
    assert (idx, desc) == ([2, 3, 4, 5], "val")
    assert "intersection" in caplog.text
    assert acc.select_samples(reader, [rec_a], "all") == (list(range(len(LENGTHS))), "all")
    assert acc.select_samples(reader, [rec_a], "val", max_samples=2) == ([1, 2], "val")
    assert acc.select_samples(reader, [None], "val")[1] == "all"
    with pytest.raises(acc.AcceptanceError, match="--split all"):
        acc.select_samples(reader, [{"val_ids": ["nope"]}], "val")


def test_fit_check_names_both_values(world, tmp_path):
    reader = DatasetReader(world["data"])
    wrong = tiny_drafter(1, aux_layer_ids=[1, 2, 5], vocab_size=80)
    folder = _write_ckpt(tmp_path / "wrong", wrong, {"val_ids": world["val"]})
    with pytest.raises(acc.AcceptanceError) as e:
        acc.evaluate(folder, reader, steps=STEPS)
    msg = str(e.value)
    assert "vocab size" in msg and "80" in msg and "64" in msg
    assert "aux layer ids" in msg and "[1, 2, 5]" in msg and "[1, 2, 4]" in msg


def test_settings_are_checked(world):
    reader = DatasetReader(world["data"])
    with pytest.raises(acc.AcceptanceError, match="num-draft-tokens"):
        acc.evaluate(world["run"], reader, steps=STEPS, topk=2)
    with pytest.raises(acc.AcceptanceError, match="temperature 0 only"):
        acc.evaluate(world["run"], reader, steps=STEPS, topk=2, num_draft_tokens=4, temperature=1.0)
    with pytest.raises(acc.AcceptanceError, match="--engine sglang"):
        acc.evaluate(world["run"], reader, steps=STEPS, topk=2, num_draft_tokens=4, engine="vllm")
    with pytest.raises(acc.AcceptanceError, match=r"\[2, 11\]"):
        acc.evaluate(world["run"], reader, steps=STEPS, topk=2, num_draft_tokens=12)


def test_temperature_and_tree_modes(world):
    reader = DatasetReader(world["data"])
    hot = acc.evaluate(world["run"], reader, steps=STEPS, split="all", temperature=0.8)
    assert hot["evaluation"] == "expected" and 1.0 < hot["tau"] <= STEPS + 1
    assert hot["tau_estimator"] == "per_position_expected" and hot["engine_walk"] is None
    assert all(a >= b for a, b in zip(hot["accept_rate"], hot["accept_rate"][1:], strict=False))
    rs = acc.evaluate(world["run"], reader, steps=STEPS, split="all", temperature=0.8, rejection_sampling=True)
    assert rs["settings"]["rejection_sampling"] and rs["tau"] != hot["tau"]
    tree = acc.evaluate(world["run"], reader, steps=STEPS, split="all", topk=2, num_draft_tokens=6, tree_positions=3)
    assert tree["tree"]["positions"] == tree["by_source"]["alpha"]["tree_positions"] + \
        tree["by_source"]["beta"]["tree_positions"]
    assert tree["tree"]["positions"] <= 3 * len(LENGTHS)
    assert tree["tau"] == tree["tree"]["tau"] == tree["engine_walk"]["tau"] and tree["tau"] >= 1.0
    assert tree["engine_walk"]["requests"] == sum(1 + (n > 12) for n in LENGTHS)
    assert tree["settings"]["engine"] == "sglang" and tree["sglang_request_accept_length"] >= 1.0


def test_cli_side_by_side_outputs(world, tmp_path, capsys):
    out_json, out_md, out_png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    report = acc.main([str(world["run"]), str(world["other"]), "--data", str(world["data"]), "--steps", str(STEPS),
                       "--json", str(out_json), "--markdown", str(out_md), "--plot", str(out_png), "--no-progress"])
    table = capsys.readouterr().out
    assert "tau (chain, engine walk, 1 + accepted/rounds)" in table and "tau chain length 3" in table
    assert "diagnostic: per-position mean tau" in table and "eval tokens/s" in table
    assert "tau source=alpha" in table and "estimate" in table
    saved = json.loads(out_json.read_text())
    names = [str(world["run"]), str(world["other"])]
    assert list(saved["checkpoints"]) == names
    assert saved["split"] == "val" and saved["samples"] == 4  # intersection of the two recorded splits
    for name in names:
        r = saved["checkpoints"][name]
        assert set(r["tau_per_chain_length"]) == {"1", "2", "3"}
        assert {"tau", "accepted_drafts", "accept_rate", "by_source", "by_category", "tokens_per_s",
                "positions", "evaluation", "stop_reasons", "engine_walk", "per_position",
                "data_argmax_agreement"} <= set(r)
    good, bad = (saved["checkpoints"][n]["tau"] for n in names)
    assert good > bad  # the data was built from the first drafter's own drafts
    assert saved["checkpoints"][names[0]]["step"] == 20
    assert out_md.read_text().startswith("| metric |")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["checkpoints"][names[0]]["tau"] == good


def test_cli_help_mentions_every_option(capsys):
    with pytest.raises(SystemExit):
        acc.main(["--help"])
    text = capsys.readouterr().out
    for opt in ("--steps", "--topk", "--num-draft-tokens", "--temperature", "--split", "--max-samples", "--target",
                "--batch-tokens", "--json", "--markdown", "--plot", "--device", "--tree-positions", "--engine",
                "--rejection-sampling", "--max-new-tokens"):
        assert opt in text
