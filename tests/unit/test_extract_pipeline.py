"""The extraction stage end to end on a tiny random Llama: shards, manifest, resume, ranks, CLI."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers_paths import ROOT

from extract.__main__ import main as extract_main
from extract.backends.base import TeacherSpec
from extract.backends.hf import HFTarget
from extract.chat import tokenize_conversation
from extract.config import ExtractConfig, build_parser, load_yaml, parse_args
from extract.pipeline import run_extraction
from extract.records import read_records
from extract.verify import verify_dataset
from redraft.catalog.tiny_models import make_tiny_llama
from redraft.core.batching import pack_batches
from redraft.core.config import ConfigError
from redraft.core.dataset.format import MANIFEST_NAME
from redraft.core.dataset.reader import DatasetReader
from redraft.core.dataset.shard_record import RECORD_SUFFIX

WORDS = "the cat sat on a mat and then it ran far away to see the sun rise over hills".split()


def _sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("target") / "llama", num_layers=6)


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    lines = []
    for i in range(11):
        turns = [
            {"from": "human", "value": _sentence(i, 4 + i % 5)},
            {"from": "gpt", "value": _sentence(i + 1, 6 + i % 7)},
        ]
        if i % 3 == 0:
            turns += [{"from": "human", "value": _sentence(i + 2, 3)}, {"from": "gpt", "value": _sentence(i + 3, 5)}]
        lines.append(json.dumps({"id": f"c{i}", "conversations": turns}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _cfg(target: Path, data: Path, out: Path, **kw) -> ExtractConfig:
    base = dict(target=str(target), data=[str(data)], out=str(out), samples_per_shard=3, max_length=320,
                batch_tokens=1024, topk=8, rank=0, world_size=1)
    base.update(kw)
    return ExtractConfig(**base).validate()


def _files(root: Path) -> dict[str, bytes]:
    """Every dataset file (not the lock/plan/header bookkeeping) by relative path."""
    keep = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if (p.is_file() and not rel.startswith(".locks") and p.name not in ("plan.json", "header.json")
                and not p.name.endswith(RECORD_SUFFIX)):  # the writer's record holds the shard's mtime
            keep[rel] = p.read_bytes()
    return keep


@pytest.fixture(scope="module")
def reference_run(tiny_target, chat_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "ds"
    summary = run_extraction(_cfg(tiny_target, chat_file, out, teacher=["topk", "last_hidden"]))
    assert summary.manifest is not None
    return out


def test_manifest_and_features_match_the_target(reference_run, tiny_target, chat_file):
    manifest = json.loads((reference_run / MANIFEST_NAME).read_text())
    for key in ("format_version", "target", "tokenizer_hash", "chat_template_hash", "hidden_size", "num_layers",
                "aux_layer_ids", "aux_layer_convention", "teacher", "hidden_dtype", "max_length", "generation",
                "num_samples", "num_tokens", "num_loss_tokens", "skipped", "shards"):
        assert key in manifest, key
    assert manifest["num_samples"] == 11
    assert len(manifest["shards"]) == 4  # 11 samples, 3 per shard
    assert manifest["generation"] is None
    assert verify_dataset(reference_run) == []

    # Random access through the reader gives what the target computes for that conversation alone.
    reader = DatasetReader(reference_run)
    backend = HFTarget(str(tiny_target))
    records = read_records([chat_file]).records
    i = reader.index_of("c6")
    sample = reader.get(i)
    tok = tokenize_conversation(backend.tokenizer, records[6].messages, 320)
    assert sample.input_ids.tolist() == tok.input_ids
    assert sample.loss_mask.bool().tolist() == [bool(m) for m in tok.loss_mask]
    (cap,) = backend.capture([tok.input_ids], TeacherSpec(kinds=("topk", "last_hidden"), topk=8))
    torch.testing.assert_close(sample.aux_hidden, cap.aux_hidden.to(torch.bfloat16).float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(sample.last_hidden, cap.last_hidden.to(torch.bfloat16).float(), atol=0.05, rtol=0.02)
    assert torch.equal(sample.topk_ids, cap.topk_ids)
    counts = reader.token_counts()
    assert int(counts.sum()) == manifest["num_loss_tokens"]


def test_rerun_after_interruption_is_byte_identical(reference_run, tiny_target, chat_file, tmp_path, monkeypatch):
    from redraft.core.dataset.writer import ShardWriter

    out = tmp_path / "ds"
    real_finish = ShardWriter.finish
    calls = {"n": 0}

    def failing_finish(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed mid-run")
        return real_finish(self, *args, **kwargs)

    monkeypatch.setattr(ShardWriter, "finish", failing_finish)
    with pytest.raises(KeyboardInterrupt):
        run_extraction(_cfg(tiny_target, chat_file, out, teacher=["topk", "last_hidden"]))
    assert not (out / MANIFEST_NAME).exists()
    assert sorted(p.name for p in (out / "shards").glob("*.safetensors")) == [f"shard-00000{i}.safetensors"
                                                                           for i in range(2)]
    monkeypatch.setattr(ShardWriter, "finish", real_finish)
    summary = run_extraction(_cfg(tiny_target, chat_file, out, teacher=["topk", "last_hidden"]))
    assert summary.shards_reused == 2 and summary.shards_written == 2
    assert _files(out) == _files(reference_run)


def test_two_ranks_write_the_same_dataset_as_one(reference_run, tiny_target, chat_file, tmp_path):
    out = tmp_path / "ds"
    first = run_extraction(_cfg(tiny_target, chat_file, out, teacher=["topk", "last_hidden"], rank=1, world_size=2))
    assert first.manifest is None  # rank 0's shards are missing
    second = run_extraction(_cfg(tiny_target, chat_file, out, teacher=["topk", "last_hidden"], rank=0, world_size=2))
    assert second.manifest is not None
    assert _files(out) == _files(reference_run)


def test_corrupt_shard_is_redone_on_rerun(reference_run, tiny_target, chat_file, tmp_path):
    import shutil

    out = tmp_path / "ds"
    shutil.copytree(reference_run, out)
    shard = out / "shards" / "shard-000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert any("shard-000001" in p for p in verify_dataset(out))
    summary = run_extraction(_cfg(tiny_target, chat_file, out, teacher=["topk", "last_hidden"]))
    assert summary.shards_written == 1
    assert _files(out) == _files(reference_run)


def test_settings_change_is_refused(reference_run, tiny_target, chat_file, tmp_path):
    import shutil

    out = tmp_path / "ds"
    shutil.copytree(reference_run, out)
    with pytest.raises(ConfigError, match="topk"):
        run_extraction(_cfg(tiny_target, chat_file, out, teacher=["topk", "last_hidden"], topk=4))


def test_summary_parts_add_up_to_the_stage_wall_time(tiny_target, chat_file, tmp_path):
    start = time.perf_counter()
    summary = run_extraction(_cfg(tiny_target, chat_file, tmp_path / "ds"))
    wall = time.perf_counter() - start
    parts = summary.parts
    # Every part of a run without regeneration was seen, none is negative, and they add up to the stage's
    # own wall time, which is the caller's less the return.
    assert set(parts) == {"read", "plan", "load", "tokenize", "capture", "teacher", "write", "close", "finalize",
                          "other"}
    assert min(parts.values()) >= 0
    assert sum(parts.values()) == pytest.approx(summary.seconds, abs=0.01)
    assert 0 < summary.seconds <= wall < summary.seconds + 0.5
    # The spans cover the stage: what no span holds (progress bar, locks) is a small share.
    assert parts["other"] < 0.2 * summary.seconds
    line = summary.line()
    assert "capture " in line and "%)" in line


def test_fp8_and_regeneration(tiny_target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "turns": [_sentence(i, 5), _sentence(i + 4, 3)]})
                                 for i in range(5)) + "\n")
    out = tmp_path / "ds"
    summary = run_extraction(_cfg(tiny_target, prompts, out, regenerate=True, max_new_tokens=6,
                                  hidden_dtype="fp8", samples_per_shard=2))
    manifest = summary.manifest
    assert manifest is not None and manifest["hidden_dtype"] == "fp8"
    assert manifest["generation"] == {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 6, "seed": 0, "backend": "hf"}
    regenerated = read_records([out / "regenerated.jsonl"]).records
    assert [r.id for r in regenerated] == [f"p{i}" for i in range(5)]
    assert all([m.role for m in r.messages] == ["user", "assistant", "user", "assistant"] for r in regenerated)
    assert verify_dataset(out) == []
    reader = DatasetReader(out)
    # Every turn is captured from its generated ids; a conversation whose second prompt does not start
    # with the first turn's ids (random bytes decode to U+FFFD and re-encode differently) is two samples.
    regen = manifest["regeneration"]
    assert regen["turns"] == 10 and regen["samples"] == len(reader) and regen["mismatched_samples"] == 0
    assert {sid.split("/")[0] for sid in reader.sample_ids} == {f"p{i}" for i in range(5)}
    assert not manifest["skipped"]
    # The replies' time is its own part; the samples built from generated ids need no chat-template pass.
    assert summary.parts["regenerate"] > 0 and sum(summary.parts.values()) == pytest.approx(summary.seconds, abs=0.01)


def test_strict_mode_exits_2_and_writes_nothing(tiny_target, chat_file, tmp_path, caplog):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(chat_file.read_text().splitlines()[0] + "\n{not json\n")
    out = tmp_path / "never"
    code = extract_main(["--target", str(tiny_target), "--data", str(bad), "--out", str(out), "--strict"])
    assert code == 2
    assert not out.exists()
    assert f"{bad}:2" in caplog.text


def test_bad_records_are_skipped_and_counted(tiny_target, chat_file, tmp_path):
    bad = tmp_path / "mixed.jsonl"
    bad.write_text(chat_file.read_text() + "{not json\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]})
                   + "\n")
    out = tmp_path / "ds"
    summary = run_extraction(_cfg(tiny_target, bad, out))
    assert summary.manifest["skipped"]["invalid_json"] == 1
    assert summary.manifest["skipped"]["unknown_role"] == 1
    assert summary.manifest["num_samples"] == 11


def test_config_file_and_unknown_keys(tmp_path):
    good = tmp_path / "ok.yaml"
    good.write_text("target: t\ndata: [a.jsonl, b.jsonl]\nout: o\nteacher: topk,last_hidden\nhidden-dtype: fp8\n")
    cfg = parse_args(["--config", str(good), "--topk", "5", "--rank", "0", "--world-size", "1"])
    assert cfg.data == ["a.jsonl", "b.jsonl"] and cfg.teacher == ["topk", "last_hidden"]
    assert cfg.hidden_dtype == "fp8" and cfg.topk == 5
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: t\ntopk_size: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'topk_size'"):
        load_yaml(bad)
    for shipped in (ROOT / "configs").glob("*/extract.yaml"):
        load_yaml(shipped)  # the shipped configs only use real keys


def test_help_documents_every_option():
    text = build_parser().format_help()
    import dataclasses

    for f in dataclasses.fields(ExtractConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name


def test_rank_defaults_from_slurm(monkeypatch):
    from extract.config import resolve_rank

    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert resolve_rank(-1, 0) == (2, 4)
    with pytest.raises(ConfigError):
        resolve_rank(5, 4)


def test_pack_batches_bounds_padded_tokens():
    lengths = [5, 40, 12, 40, 7, 30, 1]
    batches = pack_batches(lengths, 80)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(max(lengths[i] for i in b) * len(b) <= 80 or len(b) == 1 for b in batches)
    assert batches == pack_batches(lengths, 80)


def _try_lock(path: str, queue) -> None:
    from extract.run_state import rank_lock

    try:
        with rank_lock(Path(path), 0):
            queue.put("locked")
    except ConfigError as e:
        queue.put(str(e))


def test_second_process_on_the_same_rank_is_refused(tmp_path):
    import multiprocessing as mp

    from extract.run_state import rank_lock

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with rank_lock(tmp_path, 0):
        proc = ctx.Process(target=_try_lock, args=(str(tmp_path), queue))
        proc.start()
        proc.join(30)
    assert "already writing rank 0" in queue.get(timeout=5)
    proc = ctx.Process(target=_try_lock, args=(str(tmp_path), queue))  # released: the next run proceeds
    proc.start()
    proc.join(30)
    assert queue.get(timeout=5) == "locked"


def test_prompt_too_long_to_answer_is_skipped_not_fatal(tiny_target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    long_prompt = " ".join([_sentence(1, 9)] * 40)  # far beyond max_length once tokenized
    prompts.write_text(json.dumps({"id": "long", "prompt": long_prompt}) + "\n"
                       + json.dumps({"id": "short", "prompt": _sentence(2, 4)}) + "\n")
    summary = run_extraction(_cfg(tiny_target, prompts, tmp_path / "ds", regenerate=True, max_new_tokens=4,
                                  max_length=160))
    assert summary.manifest["skipped"] == {"no_loss_tokens": 1}
    assert DatasetReader(tmp_path / "ds").sample_ids == ["short"]
