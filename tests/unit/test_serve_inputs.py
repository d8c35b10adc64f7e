"""serve.tune reads only files the upstream stages wrote: an offline report about exactly its traffic, and exports
whose redraft.json names their engine. Mismatches are refused by file and reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redraft.engines.launch import export_engine
from serve.traffic import Traffic, TrafficError, read_offline
from serve.tune import TuneError, TuneOptions, read_exports


def _offline(tmp_path: Path, traffic_data: Path, **changes) -> Path:
    res = {"tau_per_chain_length": {"1": 1.4, "2": 1.6, "3": 1.7}, "accept_rate": [0.4, 0.2, 0.1], "samples": 3,
           "tokens": 90, "evaluation": "engine walk", "data_argmax_agreement": {"fraction": 1.0},
           "settings": {"engine": "vllm", "topk": 1, "temperature": 0.0}}
    report = {"data": str(traffic_data), "split": "all", "samples": 3, "checkpoints": {"ckpt": res}}
    for key, value in changes.items():
        (res if key == "settings" else report)[key] = value  # the report's data, split, samples; the walk's settings
    path = tmp_path / "offline.json"
    path.write_text(json.dumps(report))
    return path


def test_the_offline_report_must_be_about_the_traffic(tmp_path):
    data = tmp_path / "traffic"
    traffic = Traffic(data=data, prompts=[[1, 2]] * 3, max_tokens=8, samples=3, source="mtbench")
    off = read_offline(_offline(tmp_path, data), traffic, 2)
    assert off["tau"] == {1: 1.4, 2: 1.6}  # chains up to the sweep's longest
    cases = [({"data": str(tmp_path / "other")}, "not on --data"),
             ({"samples": 2}, "the traffic is the first 3 of all"),
             ({"split": "val"}, "--split all"),
             ({"settings": {"engine": "sglang", "topk": 1}}, "vLLM's walk"),
             ({"settings": {"engine": "vllm", "topk": 1, "temperature": 0.7}}, "greedy chains")]
    for change, named in cases:
        with pytest.raises(TrafficError, match=named):
            read_offline(_offline(tmp_path, data, **change), traffic, 2)
    with pytest.raises(TrafficError, match="--steps 5"):
        read_offline(_offline(tmp_path, data), traffic, 5)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(TrafficError, match="bad.json: unreadable"):
        read_offline(tmp_path / "bad.json", traffic, 2)


def _export(folder: Path, engine: str) -> str:
    folder.mkdir(parents=True)
    (folder / "redraft.json").write_text(json.dumps({"format": "redraft-export", "serving_format": engine}))
    return str(folder)


def test_the_engine_swept_is_the_one_the_export_names(tmp_path):
    vllm, sglang = _export(tmp_path / "v", "vllm"), _export(tmp_path / "s", "sglang")
    opts = TuneOptions(drafter=sglang, target="t", data="d", offline="o", exports=[vllm])
    assert read_exports(opts) == ("sglang", {"sglang": sglang, "vllm": vllm})
    assert export_engine(tmp_path) is None
    with pytest.raises(TuneError, match="not an eval.export folder"):
        read_exports(TuneOptions(drafter=str(tmp_path), target="t", data="d", offline="o"))
    with pytest.raises(TuneError, match="a second vllm export"):
        read_exports(TuneOptions(drafter=vllm, target="t", data="d", offline="o",
                                 exports=[_export(tmp_path / "v2", "vllm")]))
