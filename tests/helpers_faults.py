"""Shared pieces of the fault suite: corpora, subprocess runners, kill helpers, and damage checks.

Kills come in two kinds. *External* kills watch the output folder from the test and SIGKILL the
process when it gets somewhere (a plan file, N shards, a checkpoint). *Self* kills make the process
SIGKILL itself at an exact point: this file doubles as a runner script that patches ``os.replace``
in the child (test-side only; no hook lives in product code), so "the temp file is fully written but
not yet renamed" or "half of the temp file is on disk" happen at a chosen write, every time.

    python tests/helpers_faults.py --kill-at NAME:N [--truncate] -- extract ARGS...
    python tests/helpers_faults.py --kill-at NAME:N -- train ARGS...
    python tests/helpers_faults.py --kill-at NAME:N --disk-full -- extract ARGS...   # ENOSPC there instead
"""

from __future__ import annotations

import fnmatch
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the cat sat on a mat and then it ran far away to see the sun rise over green hills "
         "while birds sang softly near old stone walls").split()
BOOKKEEPING = ("plan.json", "header.json")


# ----------------------------------------------------------------------------- corpora


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def good_record(rng: random.Random, i: int) -> dict:
    """A short two-turn ShareGPT conversation (a handful of tokens, so hundreds extract in seconds)."""
    return {"id": f"r{i:05d}", "conversations": [
        {"from": "human", "value": sentence(rng, rng.randint(1, 4))},
        {"from": "gpt", "value": sentence(rng, rng.randint(1, 5))},
    ]}


def write_corpus(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(good_record(rng, i)) + "\n" for i in range(n)))
    return path


# One malformed line per case: (skip reason, line bytes). Reasons are records.SKIP_REASONS.
def malformed_lines(rng: random.Random, long_chars: int) -> list[tuple[str, bytes]]:
    def j(obj: object) -> bytes:
        return json.dumps(obj).encode()

    user = {"role": "user", "content": "hi"}
    deep = "[" * 100_000 + "]" * 100_000
    nested: object = "x"
    for _ in range(300):
        nested = {"a": nested}
    return [
        ("invalid_json", b"{not json"),
        ("invalid_json", b'{"conversations": [{"from": "human", "value": "cut off'),
        ("invalid_json", deep.encode()),  # deeper than Python's parser recursion limit
        ("invalid_json", b'{"x": "' + b"y" * long_chars),  # a very long line that never closes
        ("not_utf8", b'{"conversations": [{"from": "human", "value": "\xff\xfe"}]}'),
        ("not_utf8", j({"messages": [{"role": "user", "content": "a\ud800b"}, {"role": "assistant", "content": "c"}]})),
        ("not_object", b"[1, 2, 3]"),
        ("not_object", b"42"),
        ("not_object", b"null"),
        ("not_object", j({"messages": ["hi", "there"]})),
        ("unknown_format", j({"text": "hello"})),
        ("unknown_format", j({"conversations": "human: hi"})),
        ("unknown_format", j({"prompt": None, "answer": "x"})),
        ("unknown_role", j({"messages": [{"role": "robot", "content": "x"}]})),
        ("unknown_role", j({"conversations": [{"from": "alien", "value": "x"}]})),
        ("non_string_content", j({"messages": [user, {"role": "assistant", "content": 5}]})),
        ("non_string_content", j({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})),
        ("non_string_content", j({"messages": [user, {"role": "assistant", "content": nested}]})),
        ("no_assistant_turn", j({"messages": [user]})),
        ("no_assistant_turn", j({"prompt": "hello"})),
        ("no_assistant_turn", j({"turns": ["a", "b"]})),
        ("empty_conversation", j({"messages": []})),
        ("empty_conversation", j({"messages": [{"role": "system", "content": "x"}]})),
        ("bad_turn_order", j({"messages": [{"role": "assistant", "content": "x"}, user]})),
        ("bad_generation", j({"messages": [user, {"role": "assistant", "content": "x", "generation": [1, 2]}]})),
        ("bad_generation", j({"messages": [user, {"role": "assistant", "content": "x", "generation": {
            "output_ids": [1, True], "finish_reason": "stop", "prompt_tokens": 3, "prompt_sha256": "0" * 64}}]})),
    ]


def write_malformed_corpus(folder: Path, *, rounds: int, long_chars: int, seed: int = 0) -> dict:
    """Files mixing good records with every skip reason, plus BOM, CRLF, blank and empty files.

    Returns {"paths", "skipped" (reason -> count), "good" (ids in read order), "first_bad" (origin)}.
    """
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    lines: list[tuple[str | None, bytes]] = []
    n_good = 0
    for _ in range(rounds):
        for _ in range(3):
            lines.append((f"r{n_good:05d}", json.dumps(good_record(rng, n_good)).encode()))
            n_good += 1
        lines += malformed_lines(rng, long_chars)
        lines.append((None, b"   "))  # whitespace-only lines are not records
    long_good = good_record(rng, n_good)
    long_good["conversations"][1]["value"] = sentence(rng, long_chars // 6)[:long_chars]
    lines.insert(len(lines) // 2, (f"r{n_good:05d}", json.dumps(long_good).encode()))
    n_good += 1
    rng.shuffle(lines)
    first_good = (f"r{n_good:05d}", json.dumps(good_record(rng, n_good)).encode())
    lines.insert(0, first_good)
    half = len(lines) // 2
    a, b = folder / "a.jsonl", folder / "b.jsonl"
    # a.jsonl: a UTF-8 BOM before a good first record, CRLF line ends; b.jsonl: LF with a trailing blank line.
    a.write_bytes(b"\xef\xbb\xbf" + b"".join(line + b"\r\n" for _, line in lines[:half]))
    b.write_bytes(b"".join(line + b"\n" for _, line in lines[half:]) + b"\n")
    empty_jsonl, empty_json, blank_json = folder / "empty.jsonl", folder / "empty.json", folder / "blank.json"
    empty_jsonl.write_bytes(b"")
    empty_json.write_bytes(b"")
    blank_json.write_bytes(b"\xef\xbb\xbf \r\n")
    skipped: dict[str, int] = {}
    good: list[str] = []
    first_bad = None
    for i, (tag, _) in enumerate(lines):
        path, lineno = (a, i + 1) if i < half else (b, i - half + 1)
        if tag is None:
            continue
        if tag.startswith("r"):
            good.append(tag)
        else:
            skipped[tag] = skipped.get(tag, 0) + 1
            first_bad = first_bad or f"{path}:{lineno}"
    return {"paths": [empty_jsonl, a, empty_json, b, blank_json], "skipped": skipped, "good": good,
            "first_bad": first_bad}


# ----------------------------------------------------------------------------- processes


def child_env() -> dict[str, str]:
    """Offline, CPU-only, one thread: children compute the same bits as the test process."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline",
               DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_ARRAY_TASK_ID",
                "SLURM_ARRAY_TASK_COUNT"):
        env.pop(key, None)
    return env


def extract_args(target: Path, data: Path, out: Path, **kw: object) -> list[str]:
    opts: dict[str, object] = dict(target=target, data=data, out=out, samples_per_shard=25, max_length=64,
                                   batch_tokens=512, topk=4, rank=0, world_size=1)
    opts.update(kw)
    return [x for k, v in opts.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def extract_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "extract", *args]


def train_cmd(args: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train" / "main.py"), *args]


def self_kill_cmd(stage: str, args: list[str], kill_at: str, truncate: bool = False) -> list[str]:
    """Run ``stage`` (extract or train) in a child that SIGKILLs itself at the ``kill_at`` rename."""
    extra = ["--truncate"] if truncate else []
    return [sys.executable, str(Path(__file__).resolve()), "--kill-at", kill_at, *extra, "--", stage, *args]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    fh = open(log, "ab")
    fh.write(f"$ {' '.join(cmd)}\n".encode())
    fh.flush()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=fh, stderr=subprocess.STDOUT)
    fh.close()
    return proc


def run(cmd: list[str], log: Path, timeout: float = 300) -> int:
    proc = start(cmd, log)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def kill_when(proc: subprocess.Popen, condition: Callable[[], bool], timeout: float = 300,
              poll: float = 0.002) -> bool:
    """SIGKILL ``proc`` as soon as ``condition()`` holds; False when the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    proc.kill()
    proc.wait()
    raise TimeoutError(f"condition not reached within {timeout} s")


# ----------------------------------------------------------------------------- damage checks


def dataset_files(root: Path) -> dict[str, bytes]:
    """The dataset's files by relative path: no locks, run bookkeeping (the writer's records, which hold
    mtimes), or hidden temp files."""
    from redraft.core.dataset.shard_record import RECORD_SUFFIX

    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if (p.is_file() and not any(part.startswith(".") for part in rel.parts) and p.name not in BOOKKEEPING
                and not p.name.endswith(RECORD_SUFFIX)):
            out[rel.as_posix()] = p.read_bytes()
    return out


def temp_leftovers(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob(".*tmp*"))


def partial_files_at_final_names(root: Path) -> list[str]:
    """Files at a final (non-hidden) name that do not parse: there must never be any."""
    from safetensors.torch import load_file

    from extract.verify import verify_dataset
    from redraft.core.dataset.format import DatasetError, read_shard_header

    bad = []
    for p in sorted((root / "shards").glob("*.safetensors")) if (root / "shards").is_dir() else []:
        try:
            read_shard_header(p)
        except DatasetError as e:
            bad.append(f"{p.name}: {e}")
    for name in ("plan.json", "header.json", "manifest.json"):
        if (root / name).exists():
            try:
                json.loads((root / name).read_text())
            except ValueError as e:
                bad.append(f"{name}: {e}")
    if (root / "token_counts.safetensors").exists():
        try:
            load_file(str(root / "token_counts.safetensors"))
        except Exception as e:  # any parse failure is the finding
            bad.append(f"token_counts.safetensors: {e}")
    if (root / "manifest.json").exists():
        bad += verify_dataset(root)  # a manifest at its final name describes complete shards
    return bad


def tensor_span(path: Path, key: str) -> tuple[int, int, list[int]]:
    """(first byte, end byte, shape) of tensor ``key``'s data in a safetensors file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    a, b = header[key]["data_offsets"]
    return 8 + n + a, 8 + n + b, header[key]["shape"]


def poke(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- self-kill runner


def _install_kill(pattern: str, nth: int, truncate: bool, disk_full: bool = False) -> None:
    """SIGKILL this process at the ``nth`` ``os.replace`` whose destination name matches ``pattern`` (or, with
    ``disk_full``, make that rename fail with ENOSPC: a failure the process handles)."""
    import errno

    real_replace = os.replace
    seen = {"n": 0}

    def replace(src, dst, *a, **kw):
        if fnmatch.fnmatch(Path(dst).name, pattern):
            seen["n"] += 1
            if seen["n"] == nth and disk_full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
            if seen["n"] == nth:
                if truncate and Path(src).is_file():
                    size = Path(src).stat().st_size
                    os.truncate(src, size // 2)  # as if the kill came in the middle of write()
                os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *a, **kw)

    os.replace = replace


def disk_full_cmd(stage: str, args: list[str], at: str) -> list[str]:
    """Run ``stage`` in a child whose ``at`` (NAME:N) rename fails with ENOSPC, as a full disk would."""
    return [sys.executable, str(Path(__file__).resolve()), "--kill-at", at, "--disk-full", "--", stage, *args]


def _main(argv: list[str]) -> int:
    sep = argv.index("--")
    opts, (stage, *args) = argv[:sep], argv[sep + 1:]
    pattern, nth = opts[opts.index("--kill-at") + 1].rsplit(":", 1)
    _install_kill(pattern, int(nth), "--truncate" in opts, "--disk-full" in opts)
    if stage == "extract":
        from extract.__main__ import main as extract_main

        return extract_main(args)
    if stage == "train":
        from train.main import main as train_main

        train_main(args)
        return 0
    raise SystemExit(f"unknown stage {stage!r}")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
