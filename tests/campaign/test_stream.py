"""Streaming: extraction fills a bounded window of shards while training consumes it (issue 24).

Real processes on a tiny Llama target: ``python -m extract --window-bytes`` and ``train/main.py --stream`` on one
folder, side by side. Held here:
- the streamed run equals a run over the finished dataset in the same order (``data_order: stream``), bit for bit
  (fp32 checkpoint), and trains the same sample ids in the same order;
- the folder's peak bytes stay within the window plus one shard;
- random SIGKILLs of either side, each restarted with the same command, lose no sample and train none twice
  (the trained order, cut at each resume point, is the unkilled run's) and end at the same weights;
- a corrupt or foreign shard in the window is refused by name, never trained on.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers_faults import extract_args, extract_cmd, flip_byte, start, train_cmd, write_corpus
from helpers_paths import ROOT
from helpers_train import base_args
from safetensors.torch import load_file

from extract.config import parse_args
from extract.pipeline import run_extraction
from redraft.catalog.tiny_models import make_tiny_llama
from redraft.core.dataset.format import DatasetError, shard_relpath
from redraft.core.dataset.window import folder_bytes, seal_path

RECORDS, PER_SHARD = 960, 10  # 96 shards of ~340 KB
KILLS = 20
GROUP = 2  # stream_group_shards: the window (3 shards) holds a group plus the shard being written


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    target = make_tiny_llama(root / "target", num_layers=6)
    corpus = write_corpus(root / "corpus.jsonl", RECORDS, seed=11)
    offline = root / "offline"
    assert run_extraction(parse_args(_extract_args(target, corpus, offline))).manifest is not None
    shard_sizes = [(offline / shard_relpath(s)).stat().st_size for s in range(RECORDS // PER_SHARD)]
    reference = root / "reference"  # the finished folder in the stream order: what every streamed run must equal
    assert subprocess.run(train_cmd(_train_args(offline, reference, stream=False)), cwd=_root(),
                          env=_env(), capture_output=True).returncode == 0
    return {"root": root, "target": target, "corpus": corpus, "offline": offline, "reference": reference,
            "window": 3 * max(shard_sizes), "max_shard": max(shard_sizes)}


def _root() -> Path:
    return ROOT


def _env() -> dict[str, str]:
    from helpers_faults import child_env

    return child_env()


def _extract_args(target: Path, corpus: Path, out: Path, **kw: object) -> list[str]:
    return extract_args(target, corpus, out, samples_per_shard=PER_SHARD, max_length=128, batch_tokens=1024,
                        stream_group_shards=GROUP, **kw)


def _train_args(data: Path, out: Path, *, stream: bool, **kw: object) -> list[str]:
    opts: dict[str, object] = dict(data_order="stream", stream_group_shards=GROUP, max_steps=0, save_every=7,
                                   log_every=5, log_sample_ids=True, stream_poll_s=0.2)
    if stream:
        opts.update(stream=True, resume="auto")
    opts.update(kw)
    return base_args(data, out, **opts)


def _weights(run: Path) -> dict:
    return load_file(str(run / (run / "latest").read_text().strip() / "model.safetensors"))


def _trained(run: Path) -> list[tuple[int, list[str]]]:
    """(global position, ids) per trained micro-batch, as rank 0 logged them (every launch, appended)."""
    rows = []
    for line in (run / "sample_ids" / "rank-0.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line a SIGKILL cut (the log is line-buffered: at most one per kill)
            continue
    return [(r["position"], r["ids"]) for r in rows]


def _effective(rows: list[tuple[int, list[str]]]) -> list[list[str]]:
    """The micro-batches that count: a restarted trainer resumes at its checkpoint, so the rows a killed launch
    logged after it are redone; keep, for each position, the row of the last launch that trained it."""
    by_position: dict[int, list[str]] = {}
    for position, ids in rows:
        by_position[position] = ids
    return [by_position[p] for p in sorted(by_position)]


def _same_weights(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_a_streamed_run_equals_the_offline_run_in_bounded_disk(world, tmp_path):
    ds, run = tmp_path / "ds", tmp_path / "run"
    ex = start(extract_cmd(_extract_args(world["target"], world["corpus"], ds, window_bytes=world["window"])),
               tmp_path / "extract.log")
    tr = start(train_cmd(_train_args(ds, run, stream=True)), tmp_path / "train.log")
    peak = 0
    deadline = time.monotonic() + 600
    while ex.poll() is None or tr.poll() is None:
        assert time.monotonic() < deadline, "the streamed run did not finish in 600 s"
        peak = max(peak, folder_bytes(ds) if ds.exists() else 0)
        time.sleep(0.01)
    assert ex.returncode == 0, (tmp_path / "extract.log").read_text()[-3000:]
    assert tr.returncode == 0, (tmp_path / "train.log").read_text()[-3000:]
    limit = world["window"] + world["max_shard"] + (64 << 10)  # + plan, header and seals (a few KB)
    print(f"peak {peak:,} bytes; window {world['window']:,} + one shard {world['max_shard']:,}")
    assert peak <= limit, (peak, limit)
    assert (tmp_path / "train.log").read_text().count("waiting for group") >= 1  # it did wait on the extraction
    assert "window full" in (tmp_path / "extract.log").read_text()  # and the extraction on it
    assert _effective(_trained(run)) == _effective(_trained(world["reference"]))
    assert _same_weights(_weights(run), _weights(world["reference"])) == 0.0
    assert not list((ds / "shards").glob("shard-00000[0-7].safetensors"))  # trained shards are gone


def _after(seconds: float):
    t = time.monotonic() + seconds
    return lambda: time.monotonic() >= t


def _kill_point(side: str, ds: Path, run: Path, rng: random.Random):
    """A random moment of one side's work: (what, condition); the kill comes when it holds (or after 8 s)."""
    def count(folder: Path, pattern: str) -> int:
        return len(list(folder.glob(pattern))) if folder.is_dir() else 0

    def rows() -> int:
        f = run / "sample_ids" / "rank-0.jsonl"
        return len(f.read_text().splitlines()) if f.is_file() else 0

    if side == "extract":
        seals, n = count(ds / "shards", "*.seal.json") + count(ds / "consumed", "*.seal.json"), rng.randint(1, 2)
        return rng.choice([
            ("a shard half-written", lambda: count(ds / "shards", ".shard-*.tmp-*") > 0),
            (f"{n} more shard(s) landed", lambda: count(ds / "shards", "*.seal.json")
             + count(ds / "consumed", "*.seal.json") >= seals + n),
            ("at start-up", _after(rng.uniform(0.3, 3.0))),
        ])
    trained, n = rows(), rng.randint(1, 15)
    return rng.choice([
        ("a checkpoint being written", lambda: count(run, ".tmp-step-*") > 0),
        (f"{n} more micro-batches", lambda: rows() >= trained + n),
        ("at start-up", _after(rng.uniform(0.3, 3.0))),
    ])


def test_random_kills_of_either_side_lose_nothing(world, tmp_path):
    """KILLS SIGKILLs, the two sides in turn, each at a random moment of its work (mid-shard, after shards
    landed, mid-checkpoint, mid-step, at start-up or while it waits), each side restarted at once with the
    same command."""
    ds, run = tmp_path / "ds", tmp_path / "run"
    cmds = {"extract": extract_cmd(_extract_args(world["target"], world["corpus"], ds, window_bytes=world["window"])),
            "train": train_cmd(_train_args(ds, run, stream=True))}
    procs = {k: start(c, tmp_path / f"{k}.log") for k, c in cmds.items()}
    rng = random.Random(24)
    kills: list[tuple[str, str]] = []
    deadline = time.monotonic() + 1500
    while any(p.poll() is None for p in procs.values()):
        assert time.monotonic() < deadline, f"not finished after the kills {kills}"
        for k, p in procs.items():  # a side that failed on its own (not killed) is a failure, not restarted
            assert p.poll() is None or p.returncode == 0, (k, (tmp_path / f"{k}.log").read_text()[-3000:])
        alive = [k for k, p in procs.items() if p.poll() is None]
        if len(kills) >= KILLS or not alive:
            time.sleep(0.05)
            continue
        turn = ("extract", "train")[len(kills) % 2]
        side = turn if turn in alive else alive[0]
        what, ready = _kill_point(side, ds, run, rng)
        until = time.monotonic() + 8.0
        while procs[side].poll() is None and not ready() and time.monotonic() < until:
            time.sleep(0.005)
        if procs[side].poll() is None:
            procs[side].send_signal(signal.SIGKILL)
            procs[side].wait()
            kills.append((side, what if ready() else f"{what}: waited 8 s"))
            procs[side] = start(cmds[side], tmp_path / f"{side}.log")  # the same command again
    counts = {k: sum(1 for s, _ in kills if s == k) for k in cmds}
    print(f"kills: {counts}: {kills}")
    for k, p in procs.items():
        assert p.returncode == 0, (k, (tmp_path / f"{k}.log").read_text()[-3000:])
    assert len(kills) == KILLS and min(counts.values()) >= 5, kills
    assert _effective(_trained(run)) == _effective(_trained(world["reference"]))  # 0 lost, 0 twice
    assert _same_weights(_weights(run), _weights(world["reference"])) == 0.0


def test_a_corrupt_or_foreign_shard_is_refused_by_name(world, tmp_path):
    """A sealed shard whose bytes changed, or a seal of another extraction plan: the trainer stops, naming it."""
    from train.config import parse_cli
    from train.stream import StreamSource

    ds = tmp_path / "ds"
    corpus = write_corpus(tmp_path / "corpus.jsonl", 6 * PER_SHARD, seed=5)  # 3 groups of 2 shards
    assert run_extraction(parse_args(_extract_args(world["target"], corpus, ds, window_shards=100))).manifest
    cfg = parse_cli(_train_args(ds, tmp_path / "run", stream=True))
    source = StreamSource(ds, cfg, 0, 1, wait=True)
    assert source._landed(0)
    flip_byte(ds / shard_relpath(3), 200)  # group 1, not read yet
    with pytest.raises(DatasetError, match=r"shard-000003.safetensors: sha256 .* differs from its seal .*corrupt"):
        source._landed(1)
    seal = json.loads(seal_path(ds, 5).read_text())  # group 2
    seal_path(ds, 5).write_text(json.dumps({**seal, "plan": "0" * 64}))
    with pytest.raises(DatasetError, match=r"shard-000005.seal.json: sealed for another extraction plan"):
        source._landed(2)
    shutil.rmtree(ds)


def test_slurm_stream_sh_runs_both_sides_on_one_machine(world, tmp_path):
    """The one-machine command: extraction and training side by side; the trainer, done at --max-steps before
    the stream ends, tells the waiting extraction to stop."""
    import sys

    import yaml
    from helpers_faults import child_env

    ext, tr = tmp_path / "extract.yaml", tmp_path / "train.yaml"
    ext.write_text(yaml.safe_dump({"target": str(world["target"]), "data": [str(world["corpus"])],
                                   "samples_per_shard": PER_SHARD, "max_length": 128, "batch_tokens": 1024,
                                   "topk": 4}))
    tr.write_text(yaml.safe_dump({"dtype": "fp32", "draft_vocab_size": 64, "tokens_per_batch": 160, "lr": 3e-3,
                                  "ttt_steps": 3, "intermediate_size": 128, "save_every": 5, "eval_every": 0,
                                  "log_every": 5, "report_to": "none", "stream_group_shards": 2,
                                  "stream_poll_s": 0.2}))
    env = {**child_env(), "PYTHON": sys.executable, "EXTRACT_CONFIG": str(ext), "TRAIN_CONFIG": str(tr),
           "WINDOW": str(world["window"])}
    ds, run = tmp_path / "ds", tmp_path / "run"
    res = subprocess.run(["bash", "slurm/stream.sh", str(ds), str(run), "--max-steps", "20"], cwd=_root(),
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (run / "latest").read_text().strip() == "step-0000020"
    assert json.loads((ds / "trainer_done.json").read_text())["step"] == 20
    assert "the streaming trainer needs no more shards" in res.stderr
    assert len(list((ds / "shards").glob("*.seal.json"))) < RECORDS // PER_SHARD  # it stopped early


def _launch_two(args: list[str]) -> list[str]:
    import sys

    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            "configs/accelerate/cpu-2proc-zero2.yaml", "--num_processes", "2", "train/main.py", *args]


def test_two_ranks_stream_as_they_would_read_the_finished_folder(world, tmp_path):
    """2 ranks under DeepSpeed ZeRO-2: rank 0 looks at the window and both follow; the streamed run equals the
    2-rank run over the finished folder in the stream order, bit for bit."""
    offline, streamed, ds = tmp_path / "offline", tmp_path / "streamed", tmp_path / "ds"
    assert subprocess.run(_launch_two(_train_args(world["offline"], offline, stream=False, max_steps=40)),
                          cwd=_root(), env=_env(), capture_output=True).returncode == 0
    ex = start(extract_cmd(_extract_args(world["target"], world["corpus"], ds, window_bytes=world["window"])),
               tmp_path / "extract.log")
    tr = start(_launch_two(_train_args(ds, streamed, stream=True, max_steps=40)), tmp_path / "train.log")
    assert tr.wait(600) == 0, (tmp_path / "train.log").read_text()[-3000:]
    assert ex.wait(600) == 0, (tmp_path / "extract.log").read_text()[-3000:]
    assert _same_weights(_weights(streamed), _weights(offline)) == 0.0
    ids = {run: sorted(i for f in (run / "sample_ids").glob("rank-*.jsonl") for line in f.read_text().splitlines()
                       for i in json.loads(line)["ids"]) for run in (offline, streamed)}
    assert ids[streamed] == ids[offline] and len(ids[offline]) > 0
