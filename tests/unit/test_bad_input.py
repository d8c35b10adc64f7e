"""Every entry point, given bad input: exit code 2, one line naming the option, file or value, no traceback.

The battery: a missing required option, a path that does not exist, a folder of the wrong kind, an unknown key in
--config, a bad value, an empty input. Each command runs in-process through its ``cli`` (what ``python -m`` runs),
so an uncaught exception fails the test as a traceback would fail the user.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import pytest
from helpers_drafter import tiny_drafter
from helpers_store import make_dataset

from redraft.catalog.tiny_models import make_tiny_llama
from redraft.core.drafter.folder import write_drafter_folder

MODULES = {"extract": "extract.__main__", "train": "train.main", "acceptance": "eval.acceptance",
           "export": "eval.export", "online": "eval.online", "engine_truth": "eval.engine_truth",
           "serving": "serve.bench", "tune": "serve.tune", "pipeline_tune": "redraft.pipeline.tune",
           "verify_engine": "eval.verify_engine", "doctor": "serve.doctor",
           "pipeline_doctor": "redraft.pipeline.doctor",
           "verify": "extract.verify"}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_input")
    target = make_tiny_llama(root / "target", num_layers=4)
    ds = root / "ds"
    make_dataset(ds)
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["target"]["path"] = str(target)  # a dataset whose target exists: errors come from what is bad
    (ds / "manifest.json").write_text(json.dumps(manifest))
    empty_ds = root / "empty_ds"
    make_dataset(empty_ds, shard_lengths=[[]])
    (root / "folder").mkdir()
    df = root / "dflash"  # a DFlash drafter (served by vLLM only)
    df.mkdir()
    d = tiny_drafter(seed=0, method="dflash", mask_token_id=3, num_layers=1, block_size=3, target_hidden_size=32)
    write_drafter_folder(df, d.config, d.serving_state_dict(), {"format": "redraft-test"})
    pe = root / "p-eagle"  # a P-EAGLE drafter (served by vLLM only)
    pe.mkdir()
    d = tiny_drafter(seed=0, method="p-eagle", mask_token_id=3)
    write_drafter_folder(pe, d.config, d.serving_state_dict(), {"format": "redraft-test"})
    (root / "bad.yaml").write_text("bogus_key: 1\n")
    (root / "no-levels.json").write_text('{"engine": "vllm", "info": {}, "levels": []}')
    (root / "empty.jsonl").write_text("")
    (root / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                             {"role": "assistant", "content": "Hello"}]}) + "\n")
    return {"root": root, "target": target, "ds": ds, "empty_ds": empty_ds, "folder": root / "folder", "p_eagle": pe,
            "dflash": df,
            "bad": root / "bad.yaml", "empty": root / "empty.jsonl", "chat": root / "chat.jsonl",
            "no_levels": root / "no-levels.json"}


def _cases(w: dict[str, Path]) -> list[tuple[str, str, list[str], str]]:
    """(command, kind, argv, what the one line must name)."""
    r, t, ds, f, bad = w["root"], str(w["target"]), str(w["ds"]), str(w["folder"]), str(w["bad"])
    out = str(r / "out")
    return [
        ("extract", "missing option", ["--target", t, "--out", out], "data: required"),
        ("extract", "no such path", ["--target", t, "--data", "/no/such.jsonl", "--out", out], "/no/such.jsonl"),
        ("extract", "wrong kind of folder", ["--target", f, "--data", str(w["chat"]), "--out", out], f),
        ("extract", "unknown config key", ["--config", bad], "bogus_key"),
        ("extract", "bad value", ["--target", t, "--data", "d", "--out", out, "--topk", "zero"], "topk='zero'"),
        ("extract", "empty input", ["--target", t, "--data", str(w["empty"]), "--out", out], "no record to extract"),
        ("train", "missing option", ["--out", out], "data is required"),
        ("train", "no such path", ["--data", "/no/such", "--out", out], "/no/such"),
        ("train", "wrong kind of folder", ["--data", f, "--out", out], f"{f}/manifest.json"),
        ("train", "unknown config key", ["--config", bad], "bogus_key"),
        ("train", "bad value", ["--data", ds, "--out", out, "--lr", "fast"], "lr='fast'"),
        ("train", "empty input", ["--data", str(w["empty_ds"]), "--out", out], "holds no sample"),
        ("train", "a kind no engine serves", ["--data", ds, "--out", out, "--drafter-method", "p-eagle",
                                              "--drafter-attention", "mla"], "drafter_attention=mla"),
        ("train", "kinds mixed", ["--data", ds, "--out", out, "--mask-token-id", "3"], "mask_token_id=3"),
        ("train", "a DFlash kind no engine serves", ["--data", ds, "--out", out, "--drafter-method", "dflash",
                                                     "--drafter-attention", "mla"], "drafter_attention=mla"),
        ("train", "DFlash kinds mixed", ["--data", ds, "--out", out, "--dflash-layers", "2"], "dflash_layers=2"),
        ("train", "a sequence-parallel size the world cannot split", ["--data", ds, "--out", out,
                                                                       "--sequence-parallel", "2"],
         "sequence_parallel=2 does not divide the 1 process(es)"),
        ("train", "sequence parallel on a stream", ["--data", ds, "--out", out, "--sequence-parallel", "2",
                                                    "--stream", "true"], "sequence_parallel=2 trains a finished"),
        ("train", "sequence parallel with DFlash", ["--data", ds, "--out", out, "--sequence-parallel", "2",
                                                    "--drafter-method", "dflash", "--mask-token-id", "3"],
         "sequence_parallel=2: dflash"),
        ("acceptance", "missing option", ["ckpt"], "--data is required"),
        ("acceptance", "no such path", ["/no/such", "--data", ds], "/no/such"),
        ("acceptance", "wrong kind of folder", [f, "--data", ds], f"{f}: not a drafter folder"),
        ("acceptance", "unknown config key", ["ckpt", "--data", ds, "--config", bad], "bogus_key"),
        ("acceptance", "bad value", ["ckpt", "--data", ds, "--steps", "x"], "steps='x'"),
        ("acceptance", "empty input", ["ckpt", "--data", str(w["empty_ds"])], "no sample"),
        ("export", "missing option", ["ckpt", out], "--format is required"),
        ("export", "no such path", ["/no/such", out, "--format", "vllm"], "/no/such"),
        ("export", "wrong kind of folder", [f, out, "--format", "vllm"], f"{f}: not a drafter folder"),
        ("export", "unknown config key", ["c", "o", "--config", bad], "bogus_key"),
        ("export", "bad value", ["c", "o", "--format", "tgi"], "invalid choice: 'tgi'"),
        ("online", "missing option", ["ckpt"], "--data is required"),
        ("online", "no such path", ["/no/such", "--data", ds], "/no/such"),
        ("online", "wrong kind of folder", [f, "--data", ds], f),
        ("online", "unknown config key", ["c", "--data", "d", "--config", bad], "bogus_key"),
        ("online", "bad value", ["c", "--data", ds, "--engine", "tgi"], "invalid choice: 'tgi'"),
        ("online", "empty input", ["ckpt", "--data", str(w["empty_ds"])], "no sample"),
        ("engine_truth", "missing option", ["ckpt"], "--data is required"),
        ("engine_truth", "no such path", ["/no/such", "--data", ds], "/no/such"),
        ("engine_truth", "wrong kind of folder", ["ckpt", "--data", f], f"{f}/manifest.json"),
        ("engine_truth", "unknown config key", ["c", "--data", "d", "--config", bad], "bogus_key"),
        ("engine_truth", "bad value", ["c", "--data", "d", "--steps", "x"], "steps=['x']"),
        ("engine_truth", "unknown bucket", ["c", "--data", "d", "--require-bucket", "4K"], "'4K': not a position bucket"),
        ("serving", "no such path", ["--prompts", "/no/such.jsonl", "--base", "http://127.0.0.1:9"], "/no/such.jsonl"),
        ("serving", "unknown config key", ["--config", bad], "bogus_key"),
        ("serving", "bad value", ["--concurrency", "0"], "concurrency=[0]"),
        ("tune", "missing option", ["d"], "--target is required"),
        ("tune", "wrong kind of folder", [f, "--target", t, "--data", ds, "--offline", f, "--out", out],
         f"EXPORT {f}: not an eval.export folder"),
        ("tune", "no such path", ["/no/such", "--target", t, "--data", ds, "--offline", f, "--out", out],
         "EXPORT /no/such: no such folder"),
        ("tune", "unknown config key", ["d", "--target", t, "--config", bad], "bogus_key"),
        ("tune", "bad value", ["d", "--target", t, "--steps", "x"], "steps=['x']"),
        ("pipeline_tune", "missing option", ["d", "--prompts", "mtbench"], "--target is required"),
        ("pipeline_tune", "no such path", ["/no/such", "--target", t, "--prompts", "mtbench", "--out", out],
         "/no/such: no such folder"),
        ("pipeline_tune", "wrong kind of folder", ["d", "--target", t, "--data", f, "--out", out],
         f"--data {f}: no manifest.json"),
        ("pipeline_tune", "a kind the engine does not serve", [str(w["p_eagle"]), "--target", t, "--prompts",
                                                                "mtbench", "--engine", "sglang", "--out", out],
         "a p-eagle drafter, which only vllm serves"),
        ("export", "a kind the engine does not serve", [str(w["p_eagle"]), out, "--format", "sglang"],
         "SGLang 0.5.23 has no parallel drafting"),
        ("export", "a DFlash kind the engine does not serve", [str(w["dflash"]), out, "--format", "sglang"],
         "CUDA, NPU and XPU only"),
        ("pipeline_tune", "unknown config key", ["d", "--target", t, "--config", bad], "bogus_key"),
        ("pipeline_tune", "bad value", ["d", "--target", t, "--prompts", "p", "--engine", "tgi"], "'tgi'"),
        ("verify_engine", "missing option", [], "required: folder"),
        ("verify_engine", "no such path", ["/no/such", "--engine", "vllm"], "/no/such/config.json: no such file"),
        ("verify_engine", "unknown config key", ["f", "--config", bad], "bogus_key"),
        ("verify_engine", "bad value", ["f", "--engine", "tgi"], "invalid choice: 'tgi'"),
        ("verify", "missing option", [], "required: DIR"),
        ("verify", "no such path", ["/no/such"], "/no/such is not a directory"),
        ("verify", "wrong kind of folder", [f], f"{f}/manifest.json: manifest is missing"),
        ("verify", "unknown config key", ["f", "--config", bad], "bogus_key"),
        ("doctor", "missing option", [], "url"),
        ("doctor", "wrong kind of folder", ["--url", "http://127.0.0.1:9", "--drafter", f], f"--drafter {f}: no config"),
        ("doctor", "unknown config key", ["--url", "u", "--config", bad], "bogus_key"),
        ("doctor", "bad value", ["--url", "u", "--concurrency", "0"], "concurrency=[0]"),
        ("doctor", "no server there", ["--url", "http://127.0.0.1:9", "--max-seconds", "20"], "127.0.0.1:9"),
        ("doctor", "no such path", ["--evidence", "/no/such.json"], "--evidence /no/such.json: no such file"),
        ("doctor", "wrong kind of file", ["--evidence", bad], "not JSON"),
        ("doctor", "two things to examine", ["--url", "u", "--evidence", bad], "one of them"),
        ("doctor", "an empty record", ["--evidence", str(w["no_levels"])], "levels: expected a non-empty list"),
        ("pipeline_doctor", "missing option", ["--url", "u", "--out", out], "--target is required"),
        ("pipeline_doctor", "a number it computes itself", ["--url", "u", "--target", t, "--out", out,
                                                            "--offline-tau", "2"], "--offline-tau"),
        ("pipeline_doctor", "no server there", ["--url", "http://127.0.0.1:9", "--target", t, "--out", out,
                                                "--max-seconds", "20"], "127.0.0.1:9"),
    ]


def test_every_entry_point_refuses_bad_input_in_one_line(world, capsys, caplog):
    caplog.set_level(logging.INFO)
    failures = []
    for command, kind, argv, named in _cases(world):
        caplog.clear()
        capsys.readouterr()
        rc = importlib.import_module(MODULES[command]).cli(argv)
        out = capsys.readouterr()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        text = "\n".join([*errors, out.err, out.out])
        if rc != 2 or named not in text or "Traceback" in text:
            failures.append(f"{command} ({kind}): exit {rc}, wanted 2 naming {named!r}; got: {text.strip()[-400:]}")
    assert not failures, "\n".join(failures)
    assert not (world["root"] / "out").exists()  # nothing written half-way
