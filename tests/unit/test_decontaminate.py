"""`--decontaminate` end to end on a tiny random Llama: MT-bench quotes and near-copies in a JSONL input are
dropped before the plan and the manifest says so; nothing is dropped without it; contradictions are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from extract.__main__ import main as extract_main
from extract.config import ExtractConfig, build_parser
from extract.decontaminate import Decontamination, self_check_covers
from extract.pipeline import run_extraction
from extract.records import read_records
from redraft.catalog.builtin import mtbench_records, resolve_data
from redraft.catalog.tiny_models import make_tiny_llama
from redraft.core.config import ConfigError
from redraft.core.dataset.format import MANIFEST_NAME
from redraft.core.dataset.reader import DatasetReader

WORDS = "the cat sat on a mat and then it ran far away to see the sun rise over hills".split()
UNRELATED = [f"u{i}" for i in range(5)]


def _sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n))


def _light_edit(text: str) -> str:
    """A near-duplicate: two words swapped for others and the last word cut."""
    words = text.split()
    words[1], words[5] = "formal", "about"
    return " ".join(words[:-1])


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("target") / "llama", num_layers=6)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory) -> tuple[Path, str, str]:
    """Five unrelated chats, one quoting an MT-bench first turn (in its second user turn), one a light edit."""
    questions = mtbench_records()
    quoted, edited = questions[0]["turns"][0], _light_edit(questions[1]["turns"][0])
    assert edited != questions[1]["turns"][0]

    def chat(rid: str, *users: str) -> str:
        msgs = []
        for k, u in enumerate(users):
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": _sentence(k + 3, 6)}]
        return json.dumps({"id": rid, "messages": msgs})

    lines = [chat(rid, _sentence(i, 5 + i)) for i, rid in enumerate(UNRELATED[:3])]
    lines.append(chat("quote", _sentence(9, 6), f"Please help me with this: {quoted}"))
    lines.append(chat("near", edited))
    lines += [chat(rid, _sentence(i + 4, 7)) for i, rid in enumerate(UNRELATED[3:])]
    path = tmp_path_factory.mktemp("data") / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, quoted, edited


def _cfg(target: Path, data: list[str], out: Path, **kw) -> ExtractConfig:
    base = dict(target=str(target), data=data, out=str(out), samples_per_shard=3, max_length=256,
                batch_tokens=1024, topk=4, rank=0, world_size=1)
    base.update(kw)
    return ExtractConfig(**base).validate()


@pytest.fixture(scope="module")
def decontaminated(tiny_target, mixed_file, tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("decon") / "ds"
    summary = run_extraction(_cfg(tiny_target, [str(mixed_file[0])], out, decontaminate=["mtbench"]))
    return out, summary


def test_quotes_and_near_duplicates_are_dropped_and_recorded(decontaminated, mixed_file):
    out, summary = decontaminated
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    d = manifest["decontamination"]
    assert d["sources"] == ["mtbench"]
    assert d["eval_prompts"] == 160  # 80 MT-bench questions, two turns each
    assert d["eval_overlap"] == 0.5
    assert (d["checked_records"], d["dropped"], d["dropped_ids"]) == (7, 2, ["quote", "near"])
    assert manifest["skipped"]["eval_overlap"] == 2
    assert manifest["num_samples"] == 5
    reader = DatasetReader(out)
    assert sorted(reader.get(i).sample_id for i in range(len(reader))) == sorted(UNRELATED)
    assert "dropped 2 of 7 records" in summary.line()
    plan = json.loads((out / "plan.json").read_text())
    assert plan["decontamination"]["sha256"] == d["sha256"] and plan["num_records"] == 5


def test_without_the_option_nothing_is_dropped(tiny_target, mixed_file, tmp_path):
    summary = run_extraction(_cfg(tiny_target, [str(mixed_file[0])], tmp_path / "ds"))
    assert "decontamination" not in summary.manifest
    assert "eval_overlap" not in summary.manifest["skipped"]
    assert summary.manifest["num_samples"] == 7
    assert "decontamination" not in summary.line()


def test_dropped_records_do_not_count_towards_max_samples(tiny_target, mixed_file, tmp_path):
    summary = run_extraction(_cfg(tiny_target, [str(mixed_file[0])], tmp_path / "ds", decontaminate=["mtbench"],
                                  max_samples=5))
    assert summary.manifest["num_samples"] == 5  # the first five records that pass, not five minus the dropped
    assert summary.manifest["decontamination"]["dropped"] == 2


def test_rerun_with_other_decontamination_settings_is_refused(decontaminated, tiny_target, mixed_file, tmp_path):
    for i, kw in enumerate(({}, {"decontaminate": ["mtbench"], "eval_overlap": 0.8})):
        out = tmp_path / f"ds{i}"
        shutil.copytree(decontaminated[0], out)
        with pytest.raises(ConfigError, match="decontamination"):
            run_extraction(_cfg(tiny_target, [str(mixed_file[0])], out, **kw))


def test_an_input_that_is_a_decontamination_source_is_refused(tiny_target, tmp_path, caplog):
    out = tmp_path / "never"
    code = extract_main(["--target", str(tiny_target), "--data", "mtbench", "--out", str(out),
                         "--decontaminate", "mtbench", "--regenerate"])
    assert code == 2
    assert "data 'mtbench'" in caplog.text and "decontamination source 'mtbench'" in caplog.text
    assert not out.exists()
    # The same file by another name is the same contradiction.
    with pytest.raises(ConfigError, match="every one of its records would be dropped"):
        run_extraction(_cfg(tiny_target, [str(resolve_data("mtbench"))], out, decontaminate=["mtbench"],
                            regenerate=True))


def test_self_written_prompts_are_counted_not_checked_twice(mixed_file, tmp_path):
    """Records of an exempt input (the self-written prompts, already checked) pass and are counted."""
    decon = Decontamination.build(["mtbench"], 0.5)
    path = mixed_file[0]
    decon.exempt = (path,)
    kept = read_records([path], keep=decon.keep).records
    assert len(kept) == 7 and decon.exempt_records == 7 and decon.dropped == 0
    decon.self_dropped = 3
    assert decon.manifest()["self_prompts"] == {"records": 7, "checked_while_sampling": True,
                                                "dropped_while_sampling": 3}
    base = dict(target="t", data=["self"], out="o", regenerate=True, decontaminate=["mtbench"])
    assert self_check_covers(ExtractConfig(**base).validate())
    assert not self_check_covers(ExtractConfig(**base, self_eval_overlap=0.9).validate())  # looser: check again
    assert not self_check_covers(ExtractConfig(**base, self_decontaminate=[str(path)]).validate())


def test_help_lists_the_options_and_says_why():
    text = " ".join(build_parser().format_help().split())
    assert "--decontaminate" in text and "--eval-overlap" in text
    assert "fresh traffic" in text
    with pytest.raises(ConfigError, match="decontaminate"):
        ExtractConfig(target="t", data=["x"], out="o", decontaminate=["self"]).validate()
    with pytest.raises(ConfigError, match="eval_overlap"):
        ExtractConfig(target="t", data=["x"], out="o", eval_overlap=0.0).validate()
