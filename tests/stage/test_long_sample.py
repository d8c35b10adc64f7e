"""A conversation of more than 32,768 tokens, whole, through the three stages' real command lines (issue 45).

Kimi-K2.5's thinking conversations run 8K-64K tokens; the stages must take one whole, not its first 4K: ``python -m
extract`` captures it in chunks through the target's KV cache (``capture_chunk_tokens``: activation memory bounded by
the chunk), ``train/main.py`` trains on it at a token budget that holds it (the ``sdpa`` path: the drafter's
attention builds no [T, T] tensor, tests/unit/test_long_attention.py; 33 s a step here, eager's 95 s), and ``python -m eval.acceptance`` walks it and reports τ in every
position bucket, 16K+ included. The conversation is chitchat's conversations joined turn after turn into one
multi-turn chat, so the assistant's turns (the positions trained and drafted) are spread over all of it.

The target is a 64-wide random Llama with a 64K context: the shape proves nothing here, the length does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_paths import ROOT

from redraft.catalog.long_chats import transcripts
from redraft.catalog.packaged import chitchat_records
from redraft.catalog.tiny_models import make_tiny_llama

MIN_TOKENS = 32_768
MAX_LENGTH = 33_000
CHARS = 80_000  # the tiny chat tokenizer reads ~2 characters a token: a chat of ~40K tokens, cut at MAX_LENGTH


def joined_chat(chars: int) -> dict:
    """One ShareGPT record: chitchat's conversations, each one turn ("A: ..." / "B: ..." lines), speakers alternating,
    until ``chars`` characters (36 turns). Each of chitchat's messages a turn of its own would be 979 turns, and the
    chat template rendered once per assistant turn makes tokenization grow as turns x length: 73 s here."""
    turns: list[str] = []
    for text in transcripts(chitchat_records()):
        turns.append(text)
        if sum(map(len, turns)) >= chars:
            break
    roles = ("human", "gpt")
    return {"id": "long-joined", "conversations": [{"from": roles[i % 2], "value": v} for i, v in enumerate(turns)]}


def _run(args: list[str], log: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=900, check=False)
    assert proc.returncode == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("long-sample")
    target = make_tiny_llama(root / "target", num_layers=4, heads=(2, 1), max_positions=65_536)
    data = root / "long.jsonl"
    data.write_text(json.dumps(joined_chat(CHARS)) + "\n")
    ds, run = root / "data", root / "run"
    _run(["-m", "extract", "--target", str(target), "--data", str(data), "--out", str(ds), "--backend", "hf",
          "--no-regenerate", "--max-length", str(MAX_LENGTH), "--capture-chunk-tokens", "8192", "--topk", "8"],
         root / "extract.log")
    _run(["train/main.py", "--data", str(ds), "--out", str(run), "--dtype", "fp32", "--draft-vocab-size", "64",
          "--intermediate-size", "128", "--tokens-per-batch", str(MAX_LENGTH), "--max-steps", "1", "--lr", "3e-3",
          "--ttt-steps", "3", "--val-fraction", "0", "--save-every", "0", "--eval-every", "0", "--log-every", "1",
          "--attention-impl", "sdpa", "--report-to", "none"], root / "train.log")
    report = root / "acceptance.json"
    _run(["-m", "eval.acceptance", str(run), "--data", str(ds), "--steps", "3", "--split", "all", "--no-progress",
          "--json", str(report)], root / "eval.log")
    return {"data": ds, "run": run, "report": report, "root": root}


def test_the_whole_conversation_is_captured_in_chunks(stages):
    from redraft.core.dataset.reader import DatasetReader

    reader = DatasetReader(stages["data"])
    assert len(reader) == 1
    sample = reader.get(0)
    length = int(sample.input_ids.numel())
    assert length >= MIN_TOKENS, f"the joined chat is {length} tokens: too short to hold a 32K sample"
    assert sample.aux_hidden.shape[0] == length and bool(sample.loss_mask[MIN_TOKENS // 2:].any())
    manifest = json.loads((stages["data"] / "manifest.json").read_text())
    assert manifest["max_length"] == MAX_LENGTH


def test_training_took_the_whole_sample_each_step(stages):
    rows = [json.loads(x) for x in (stages["run"] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    (step,) = train
    assert step["tokens"] >= MIN_TOKENS and step["micro_batches"] == 1, step  # the sample whole, in one micro-batch
    assert step["loss_tokens"] > MIN_TOKENS // 4 and step["loss"] == step["loss"], step


def test_acceptance_reports_every_position_bucket(stages):
    report = json.loads(stages["report"].read_text())
    (result,) = report["checkpoints"].values()
    buckets = result["engine_walk"]["tau_by_position"]
    assert set(buckets) == {"0-4K", "4K-16K", "16K+"}
    assert all(buckets[name]["rounds"] > 0 for name in buckets), buckets
    assert all(buckets[name]["tau"] >= 1.0 for name in buckets), buckets
