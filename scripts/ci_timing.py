"""Where `.ci/run`'s time goes: every test's duration (pytest's junit XML) and every lane's phases, as one table.

`.ci/run` writes a junit XML per pytest lane and one ``LANE SECONDS`` line per lane into ``.cache/ci-timing/``;
this script reads them and prints the lanes, the slowest tests and the slowest files, and writes the same as JSON
and markdown (``docs/results/ci-timing/`` holds the committed ones):

    python scripts/ci_timing.py .cache/ci-timing --json report.json --markdown report.md --top 50

A junit ``time`` is the test's setup, call and teardown together, so a module's shared fixture is charged to the
first test that asks for it (pytest's ``junit_duration_report = total``).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

PHASES_NAME = "lanes.txt"


def read_tests(folder: Path) -> list[dict]:
    """Every test case of every junit XML in folder: lane (the file's stem), id, file, seconds, outcome."""
    tests = []
    for xml in sorted(folder.glob("*.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome = "passed"
            for kind in ("failure", "error", "skipped"):
                if case.find(kind) is not None:
                    outcome = kind
            module = case.get("classname", "").split(".")
            file = "/".join(p for p in module if p.startswith("test_") or p in ("unit", "stage", "engine", "campaign"))
            last = next((i for i, p in enumerate(module) if p.startswith("test_")), len(module) - 1)
            tests.append({"lane": xml.stem, "id": f"{case.get('classname')}::{case.get('name')}",
                          "file": file or case.get("classname", ""), "seconds": float(case.get("time", 0.0)),
                          "outcome": outcome, "path": "/".join(module[: last + 1]) + ".py"})
    return tests


def read_lanes(folder: Path) -> list[dict]:
    """The ``LANE SECONDS [FAILED]`` lines `.ci/run` appends, in order (lanes of the two streams overlap in time;
    the line ``total`` is the run's wall time)."""
    path = folder / PHASES_NAME
    if not path.is_file():
        return []
    lanes = []
    for line in path.read_text().splitlines():
        words = line.split()
        failed = words[-1:] == ["FAILED"]  # a lane that failed still has its seconds
        words = words[:-1] if failed else words
        if len(words) == 2 and words[1].isdigit():
            lanes.append({"lane": words[0] + (" (failed)" if failed else ""), "seconds": int(words[1])})
    return lanes


def summarise(tests: list[dict], lanes: list[dict], top: int) -> dict:
    per_file: dict[tuple[str, str], float] = defaultdict(float)
    per_lane: dict[str, list[float]] = defaultdict(list)
    for t in tests:
        per_file[t["lane"], t["file"]] += t["seconds"]
        per_lane[t["lane"]].append(t["seconds"])
    return {
        "lanes": lanes,
        "test_lanes": {lane: {"tests": len(s), "test_seconds": round(sum(s), 1)} for lane, s in per_lane.items()},
        "slowest_tests": [{k: (round(v, 1) if k == "seconds" else v) for k, v in t.items() if k != "path"}
                          for t in sorted(tests, key=lambda t: -t["seconds"])[:top]],
        "slowest_files": [{"lane": lane, "file": f, "seconds": round(s, 1)}
                          for (lane, f), s in sorted(per_file.items(), key=lambda kv: -kv[1])[:top]],
    }


def file_durations(tests: list[dict]) -> dict[str, float]:
    """Seconds per test file (its tests' junit times summed), keyed by its path from the repository root: the
    order tests/conftest.py hands files to the xdist workers in (longest first within a tier)."""
    per_path: dict[str, float] = defaultdict(float)
    for t in tests:
        per_path[t["path"]] += t["seconds"]
    return {path: round(s, 1) for path, s in sorted(per_path.items())}


def markdown(report: dict) -> str:
    out = []
    if report["lanes"]:
        out += ["| lane | seconds |", "|---|---:|"]
        out += [f"| {x['lane']} | {x['seconds']:,} |" for x in report["lanes"]]  # "total": .ci/run's wall time
        out += [""]
    out += ["| pytest lane | tests | sum of test seconds |", "|---|---:|---:|"]
    out += [f"| {lane} | {v['tests']} | {v['test_seconds']:,} |" for lane, v in report["test_lanes"].items()]
    out += ["", f"Slowest {len(report['slowest_tests'])} tests (setup + call + teardown):", "",
            "| # | lane | test | seconds |", "|---:|---|---|---:|"]
    out += [f"| {i} | {t['lane']} | `{t['id']}` | {t['seconds']:,} |" for i, t in enumerate(report["slowest_tests"], 1)]
    out += ["", "Slowest files:", "", "| lane | file | seconds |", "|---|---|---:|"]
    out += [f"| {f['lane']} | `{f['file']}` | {f['seconds']:,} |" for f in report["slowest_files"]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="where .ci/run wrote its junit XMLs and lanes.txt")
    parser.add_argument("--top", type=int, default=50, help="how many tests and files to list (default 50)")
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the tables as markdown here")
    parser.add_argument("--durations", type=Path,
                        help="update seconds per test file here (tests/durations.json: the suite's file order); the "
                             "files this run did not time keep their entries")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"ci_timing: {args.folder}: not a folder", file=sys.stderr)
        return 2
    tests, lanes = read_tests(args.folder), read_lanes(args.folder)
    if not tests and not lanes:
        print(f"ci_timing: {args.folder}: no junit XML and no {PHASES_NAME}", file=sys.stderr)
        return 2
    report = summarise(tests, lanes, args.top)
    text = markdown(report)
    print(text, end="")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    if args.durations:
        kept = json.loads(args.durations.read_text()) if args.durations.is_file() else {}
        merged = {**kept, **file_durations(tests)}
        args.durations.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
