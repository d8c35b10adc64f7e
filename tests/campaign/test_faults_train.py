"""Fault suite, training and evaluation side: corrupt data, mismatched drafters, kills, disk full.

Each corrupt-data case is checked by all three consumers: `extract.verify`, the trainer
(`train/main.py`) and the evaluator (`eval.acceptance`); each must name the damaged file.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_faults import flip_byte, kill_when, poke, run, self_kill_cmd, start, tensor_span, train_cmd
from helpers_train import base_args, make_dataset, make_target, run_main
from safetensors.torch import load_file

import redraft.core.atomic as atomic
from eval.acceptance import AcceptanceError
from eval.acceptance import main as eval_main
from extract.verify import verify_dataset
from redraft.catalog.tiny_models import make_tiny_llama
from redraft.core.dataset.format import DatasetError
from redraft.core.dataset.reader import DatasetReader
from redraft.core.drafter.folder import CheckpointError
from train.checkpoint import find_resume_checkpoint


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("faults_train")
    target, vocab = make_target(root / "target")
    data = make_dataset(root / "data", target, vocab)
    run_main(base_args(data, root / "run", max_steps=2))
    return {"root": root, "target": target, "vocab": vocab, "data": data, "ckpt": root / "run" / "step-0000002"}


def _copy(world, tmp_path: Path) -> Path:
    ds = tmp_path / "data"
    shutil.copytree(world["data"], ds)
    return ds


def _shard(ds: Path, i: int) -> Path:
    return ds / "shards" / f"shard-{i:06d}.safetensors"


def _first_rows(ds: Path, key: str, value: bytes) -> None:
    """Overwrite the first element of ``key`` in every sample of every shard (the writer refuses this)."""
    for shard in sorted((ds / "shards").glob("shard-*.safetensors")):
        start_, _, shape = tensor_span(shard, key)
        offsets = load_file(str(shard))["sample_offsets"].tolist()
        row_bytes = len(value) * (shape[1] if len(shape) > 1 else 1)
        for a in offsets[:-1]:
            poke(shard, start_ + a * row_bytes, value)


def _header_byte(ds: Path) -> None:
    shard = _shard(ds, 1)
    raw = shard.read_bytes()
    flip_byte(shard, raw.index(b'"', 8))  # a quote of the JSON header: it no longer parses


def _edit_manifest(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(ds: Path) -> None:
        manifest = json.loads((ds / "manifest.json").read_text())
        change(manifest)
        (ds / "manifest.json").write_text(json.dumps(manifest))
    return edit


def _shard_tokens(m: dict) -> None:
    m["shards"][1]["num_tokens"] += 1


def _total_samples(m: dict) -> None:
    m["num_samples"] += 1


ANY_SHARD = r"shard-00000\d\.safetensors"  # every shard is damaged: the first one read is named
# name -> (corrupt(ds), the file verify names, what verify says, regex of the file the trainer/evaluator name)
CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str, str, str]] = {
    "flipped_header_byte": (_header_byte, "shard-000001.safetensors", "sha256 mismatch",
                            r"shard-000001\.safetensors: not a readable safetensors file"),
    "truncated_shard": (lambda ds: _shard(ds, 1).write_bytes(_shard(ds, 1).read_bytes()[:-1000]),
                        "shard-000001.safetensors", "truncated or unreadable", r"shard-000001\.safetensors"),
    "missing_shard": (lambda ds: _shard(ds, 2).unlink(), "shard-000002.safetensors", "missing",
                      r"shard-000002\.safetensors: shard file is missing"),
    "manifest_shard_counts": (_edit_manifest(_shard_tokens), "shard-000001.safetensors", "counts differ",
                              r"shard-000001\.safetensors: num_tokens .* disagrees with .*manifest\.json"),
    "manifest_total_counts": (_edit_manifest(_total_samples), "manifest.json", "totals disagree",
                              r"manifest\.json: num_samples 65 disagrees with its shards \(64\)"),
    "nan_hidden_states": (lambda ds: _first_rows(ds, "aux_hidden", b"\xc0\x7f"),  # bf16 NaN
                          "shard-000000.safetensors", "non-finite values in aux_hidden",
                          ANY_SHARD + r": sample .* non-finite values in aux_hidden"),
    "inf_logprobs": (lambda ds: _first_rows(ds, "topk_logprobs", b"\x00\x00\x80\x7f"),  # float32 +inf
                     "shard-000000.safetensors", "non-finite values in topk_logprobs",
                     ANY_SHARD + r": sample .* non-finite values in topk_logprobs"),
    "token_id_outside_vocab": (lambda ds: _first_rows(ds, "input_ids", b"\xff\xff\xff\x7f"),
                               "shard-000000.safetensors", "sha256 mismatch",
                               ANY_SHARD + r": sample .* key 'input_ids' holds ids outside"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_dataset_is_detected_by_verify_trainer_and_evaluator(world, tmp_path, case):
    corrupt, name, verify_says, error = CORRUPTIONS[case]
    ds = _copy(world, tmp_path)
    corrupt(ds)

    problems = verify_dataset(ds, deep=True)
    assert any(line.startswith(("shards/" + name, name)) and verify_says in line for line in problems), problems

    out = tmp_path / "train"
    with pytest.raises(DatasetError, match=error):
        run_main(base_args(ds, out, max_steps=12, eval_every=0))
    assert not list(out.glob("step-*"))  # nothing trained on the damage was saved

    with pytest.raises(DatasetError, match=error):
        eval_main([str(world["ckpt"]), "--data", str(ds), "--split", "all", "--no-progress"])


def test_flipped_data_byte_is_caught_by_checksums(world, tmp_path):
    """A changed value that stays finite and in range: only the sha256 sees it (verify, or verify_checksums)."""
    ds = _copy(world, tmp_path)
    a, b, _ = tensor_span(_shard(ds, 1), "aux_hidden")
    flip_byte(_shard(ds, 1), (a + b) // 2)
    assert [line.split(":")[0] for line in verify_dataset(ds)] == ["shards/shard-000001.safetensors"]
    with pytest.raises(DatasetError, match="shard-000001.safetensors: sha256"):
        DatasetReader(ds, verify_checksums=True)


# ----------------------------------------------------------------------------- 3. mismatches


def _edited_checkpoint(world, tmp_path: Path, section: str, key: str, value) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(world["ckpt"], ckpt)
    record = json.loads((ckpt / "redraft.json").read_text())
    record[section][key] = value
    (ckpt / "redraft.json").write_text(json.dumps(record))
    return ckpt


MISMATCHES = {  # (redraft.json section, key, value of "another target", the data's value)
    "vocab_size": ("drafter", "vocab_size", 999, None),
    "target_hidden_size": ("drafter", "target_hidden_size", 128, 64),
    "aux_layer_ids": ("drafter", "aux_layer_ids", [1, 3, 4], [1, 2, 4]),
    "tokenizer_hash": ("dataset", "tokenizer_hash", "f" * 64, "t" * 64),
    "chat_template_hash": ("dataset", "chat_template_hash", "e" * 64, "c" * 64),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_drafter_of_another_target_is_refused_naming_both_values(world, tmp_path, case):
    section, key, theirs, ours = MISMATCHES[case]
    ours = world["vocab"] if ours is None else ours
    ckpt = _edited_checkpoint(world, tmp_path, section, key, theirs)
    out = tmp_path / "train"
    with pytest.raises(CheckpointError) as info:
        run_main(base_args(world["data"], out, init_from=ckpt))
    assert key in str(info.value) and repr(theirs) in str(info.value) and repr(ours) in str(info.value)
    assert not list(out.glob("step-*"))
    with pytest.raises(AcceptanceError) as info:
        eval_main([str(ckpt), "--data", str(world["data"]), "--no-progress"])
    assert repr(theirs) in str(info.value) and repr(ours) in str(info.value)


def test_dataset_used_with_another_target_folder_is_refused(world, tmp_path):
    other = make_tiny_llama(tmp_path / "other", vocab_size=world["vocab"] + 64)
    with pytest.raises(ValueError, match=rf"vocab_size={world['vocab'] + 64} but the dataset manifest says "
                                         rf"{world['vocab']}"):
        run_main(base_args(world["data"], tmp_path / "train", target_path=other))


# ----------------------------------------------------------------------------- 5. disk full


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert set(wa) == set(wb)
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []


@pytest.fixture(scope="module")
def straight(world) -> Path:
    """Uninterrupted 10-step run saving every 2 steps: what every faulted run must end at."""
    out = world["root"] / "straight"
    run_main(base_args(world["data"], out, max_steps=10, save_every=2))
    return out


class _FullDiskAt:
    """`open` for train.checkpoint: the ``n``-th trainer_state write fails with ENOSPC."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def __call__(self, path, mode="r", *a, **kw):
        f = open(path, mode, *a, **kw)
        if "trainer_state" in str(path) and "w" in mode:
            self.seen += 1
            if self.seen == self.n:
                def write(_data):
                    raise OSError(errno.ENOSPC, "No space left on device")
                f.write = write
        return f


def test_disk_full_while_writing_a_checkpoint(world, straight, tmp_path, monkeypatch):
    out = tmp_path / "run"
    args = base_args(world["data"], out, max_steps=10, save_every=2)
    monkeypatch.setattr(atomic, "open", _FullDiskAt(3), raising=False)
    with pytest.raises(OSError) as info:
        run_main(args)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(p.name for p in out.glob("step-*")) == ["step-0000002", "step-0000004"]
    assert find_resume_checkpoint(out, "auto") == out / "step-0000004"
    _assert_same_weights(out / "step-0000004", straight / "step-0000004")  # earlier checkpoints intact
    run_main(base_args(world["data"], out, max_steps=10, save_every=2, resume="auto"))
    _assert_same_weights(out / "step-0000010", straight / "step-0000010")
    assert not list(out.glob(".tmp-*"))


# ----------------------------------------------------------------------------- 6. kill and resume


def test_kill_and_resume_training_is_bit_exact(world, straight, tmp_path):
    out = tmp_path / "run"
    args = base_args(world["data"], out, max_steps=10, save_every=2, resume="auto")
    log = tmp_path / "train.log"

    def latest() -> str:
        p = out / "latest"
        return p.read_text().strip() if p.is_file() else ""

    # external: a random moment after step 4 was saved (mid-forward of step 5 or 6)
    proc = start(train_cmd(args), log)
    assert kill_when(proc, lambda: latest() == "step-0000004", timeout=300), log.read_text()[-3000:]
    # self: mid-checkpoint, step 6's training_state and serving files written, trainer_state not yet
    assert run(self_kill_cmd("train", args, "trainer_state.json:1"), log) == -9, log.read_text()[-3000:]
    assert find_resume_checkpoint(out, "auto") == out / "step-0000004"
    # self: step 8 renamed into place but `latest` not yet updated (still names an older step)
    assert run(self_kill_cmd("train", args, "step-0000008:1"), log) == -9, log.read_text()[-3000:]
    assert not (out / "step-0000008").exists() and (out / ".tmp-step-0000008").is_dir()
    assert run(self_kill_cmd("train", args, "latest:1"), log) == -9, log.read_text()[-3000:]
    assert (out / "step-0000008").is_dir() and latest() != "step-0000008"
    assert run(train_cmd(args), log) == 0, log.read_text()[-3000:]
    assert latest() == "step-0000010"
    _assert_same_weights(out / "step-0000010", straight / "step-0000010")
    # half-saved checkpoint folders are cleaned; the few-byte `.tmp-latest.<pid>` of the kill at the
    # `latest` rename is not (train/checkpoint.py rotate_checkpoints only removes .tmp-step-*)
    assert not list(out.glob(".tmp-step-*"))


def test_a_killed_resave_never_leaves_the_step_without_a_checkpoint(world, tmp_path):
    """A step saved again (a run killed after renaming step 4 in but before `latest` named it resumes from step 2
    and saves step 4 anew), killed between moving the old step 4 aside and renaming the new one in: the old one is
    put back, whole, by the next run; before, the old folder was deleted first."""
    out = tmp_path / "run"
    args = base_args(world["data"], out, max_steps=4, save_every=2, keep_last=1, resume="auto")
    log = tmp_path / "train.log"
    assert run(self_kill_cmd("train", args, "latest:2"), log) == -9, log.read_text()[-3000:]
    assert (out / "latest").read_text().strip() == "step-0000002" and (out / "step-0000004").is_dir()
    before = load_file(str(out / "step-0000004" / "model.safetensors"))
    assert run(self_kill_cmd("train", args, "step-0000004:1"), log) == -9, log.read_text()[-3000:]
    assert not (out / "step-0000004").exists() and (out / ".replaced-step-0000004").is_dir()
    assert find_resume_checkpoint(out, "auto") == out / "step-0000002"  # `latest` is followed, as before
    after = load_file(str(out / "step-0000004" / "model.safetensors"))  # and step 4 is back
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not (out / ".replaced-step-0000004").exists()
    assert run(train_cmd(args), log) == 0, log.read_text()[-3000:]
    assert (out / "latest").read_text().strip() == "step-0000004" and not list(out.glob(".replaced-*"))
