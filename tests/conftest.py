"""Test-wide settings: no hub, no wandb network, CPU DeepSpeed, thread pools sized to the workers, tiers in order."""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
# One converted SmolLM2 for the whole suite (and for later runs on the same checkout).
os.environ.setdefault("REDRAFT_CACHE", str(ROOT / ".cache" / "redraft"))

# Under pytest-xdist each worker gets its share of the cores for what it starts (engines, training processes,
# DeepSpeed ranks read OMP_NUM_THREADS): two workers on two cores with two-thread engines each would make
# OpenMP's spinning threads fight. One process (no xdist) leaves OMP_NUM_THREADS as the caller set it.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // WORKERS))

import torch  # noqa: E402  (after OMP_NUM_THREADS is set: torch reads it once)

torch.set_num_threads(1)

# Fixtures more than one tier uses (the built kimi-k25-mini, its model and tokenizer), defined once.
pytest_plugins = ("helpers_kimi",)

# The order xdist hands files out in (collection order): the stage tier first (it runs while `make test` builds the
# vLLM CPU venv in the background), then the engine tier, then the files that need kimi-k25-mini (marked
# uses_kimi_mini), by when its background build is done; the unit tier last. Within a tier, the longest files first
# (tests/durations.json, seconds per file from the last timed run: `scripts/ci_timing.py --durations`; a new file
# counts 0), so that no worker is left with a many-minute file while the other has finished: at 0928633 the two
# workers' sums were 674 s and 813 s in the plain order, 744 s each in this one.
TIER_ORDER = ("stage", "engine", "campaign", "unit")
DURATIONS = json.loads((ROOT / "tests" / "durations.json").read_text())


def _order(item) -> tuple[float, float]:
    path = Path(item.path).resolve().relative_to(ROOT)
    parts = path.relative_to("tests").parts
    tier = TIER_ORDER.index(parts[0]) if parts and parts[0] in TIER_ORDER else len(TIER_ORDER)
    if item.get_closest_marker("uses_kimi_mini"):
        tier = TIER_ORDER.index("engine") + 0.5
    return tier, -DURATIONS.get(path.as_posix(), 0.0)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_order)  # stable: a file's tests keep their order


# kimi-k25-mini takes minutes to build, once per cache, under a file lock. With several workers, the controller
# starts that build in the background when the session begins, so that no worker sleeps on the lock while the other
# builds: the builder and the workers share the cores from the first second.
_PREBUILD: list[subprocess.Popen] = []


def _needs_built_targets(config) -> bool:
    tiers = {"stage", "engine"}
    for arg in config.args or ["tests"]:
        parts = Path(arg.split("::")[0]).resolve().parts
        if "tests" in parts and (parts[-1] == "tests" or tiers & set(parts[parts.index("tests") + 1:][:1])):
            return True
    return False


def pytest_sessionstart(session):
    config = session.config
    workers = config.getoption("numprocesses", None) if hasattr(config.option, "numprocesses") else None
    if hasattr(config, "workerinput") or not isinstance(workers, int) or workers < 2:
        return
    if not _needs_built_targets(config):
        return
    log = ROOT / ".cache" / "prebuild-kimi-k25-mini.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    code = "from redraft.catalog.builtin import KIMI_MINI, resolve_target; print(resolve_target(KIMI_MINI))"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        _PREBUILD.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=out,
                                          stderr=subprocess.STDOUT))


def pytest_sessionfinish(session, exitstatus):
    for proc in _PREBUILD:  # a build the tests never waited for (a short selection): not left running
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


# Tests marked `sglang` need the real SGLang package. `.venv` has none (SGLang needs CUDA to install
# whole), so there they are skipped; the conformance lane runs them with its engine venv's python and
# REDRAFT_REQUIRE_SGLANG=1, where a missing SGLang (or any skip of such a test) is a failure, not a skip.
REQUIRE_SGLANG = "REDRAFT_REQUIRE_SGLANG"


def _sglang_required() -> bool:
    return os.environ.get(REQUIRE_SGLANG) == "1"


def pytest_runtest_setup(item):
    import importlib.util

    import pytest

    if item.get_closest_marker("sglang") is None or importlib.util.find_spec("sglang") is not None:
        return
    if _sglang_required():
        pytest.fail(f"{REQUIRE_SGLANG}=1 but SGLang is not installed in {sys.executable}", pytrace=False)
    pytest.skip("needs the real SGLang (the conformance lane runs it: make conformance)")


def pytest_runtest_makereport(item, call):
    """Inside the lane a skipped `sglang` test is a failed one: the lane exists to run them."""
    import pytest

    if not (_sglang_required() and item.get_closest_marker("sglang") is not None):
        return None
    report = pytest.TestReport.from_item_and_call(item, call)
    if report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped inside the conformance lane, where it must run: {report.longrepr}"
    return report
