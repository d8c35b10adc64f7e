"""--init-from on other data: the draft vocabulary is rebuilt from the new data, old lm_head rows move with their tokens.

Drafter A is trained on data whose tokens are ids 20..51; B warm-starts from A on data whose tokens
are ids 40..71, so the two vocabularies share ids 40..51 only. Runs at lr 0 save exactly the
weights they start from (AdamW with lr 0 and no weight decay changes nothing), which is how the
step-0 state of a real ``train/main.py`` run is read here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_train import CYCLE_IDS, base_args, foreign_folder, make_dataset, make_target, run_main
from safetensors.torch import load_file

from redraft.core.dataset.reader import DatasetReader
from redraft.core.drafter.folder import CheckpointError
from redraft.core.drafter.vocab import build_vocab_mapping, draft_token_ids

torch.set_num_threads(1)

N = 32  # draft vocabulary of every run here (each dataset uses 32 distinct tokens)
B_IDS = list(range(40, 72))  # overlaps A's CYCLE_IDS (20..51) in 40..51
STEP0 = dict(max_steps=1, lr=0.0)  # saves the initial weights of a real run


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm_start")
    target, vocab = make_target(root / "target")
    data_a = make_dataset(root / "data_a", target, vocab, num_samples=32)
    data_b = make_dataset(root / "data_b", target, vocab, num_samples=32, cycle_ids=B_IDS)
    run_main(base_args(data_a, root / "A", max_steps=3, draft_vocab_size=N))
    run_main(base_args(data_b, root / "C", draft_vocab_size=N, **STEP0))  # scratch on B's data, at step 0
    return {"root": root, "data_a": data_a, "data_b": data_b, "A": root / "A" / "step-0000003",
            "C": root / "C" / "step-0000001"}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _record(folder: Path) -> dict:
    return json.loads((folder / "redraft.json").read_text())


def _token_rows(w: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """target token id -> its lm_head row."""
    return {int(t): row for t, row in zip(draft_token_ids(w["d2t"]), w["lm_head.weight"], strict=True)}


def _check_rebuilt(b: dict[str, torch.Tensor], a: dict[str, torch.Tensor], scratch: dict[str, torch.Tensor]) -> int:
    """B's vocabulary is the scratch run's, shared tokens carry A's rows, new ones the scratch init;
    every other tensor is A's. Returns the number of kept rows."""
    assert torch.equal(b["d2t"], scratch["d2t"]) and torch.equal(b["t2d"], scratch["t2d"])
    rows_a, rows_b, rows_c = _token_rows(a), _token_rows(b), _token_rows(scratch)
    kept = sorted(set(rows_a) & set(rows_b))
    assert kept, "the two vocabularies must overlap for this test to mean anything"
    for t in kept:
        assert torch.equal(rows_b[t], rows_a[t]), f"token {t}: lm_head row is not A's"
    for t in sorted(set(rows_b) - set(rows_a)):
        assert torch.equal(rows_b[t], rows_c[t]), f"token {t}: a new row is not the scratch init"
    others = [k for k in a if k not in ("d2t", "t2d", "lm_head.weight")]
    assert others and [k for k in others if not torch.equal(a[k], b[k])] == []
    return len(kept)


def test_rebuild_is_the_scratch_vocab_with_old_rows_moved(world):
    out = world["root"] / "B_rebuild"
    run_main(base_args(world["data_b"], out, draft_vocab_size=N, init_from=world["A"], **STEP0))
    a, b, c = _weights(world["A"]), _weights(out / "step-0000001"), _weights(world["C"])
    counts = DatasetReader(world["data_b"]).token_counts()
    assert torch.equal(b["d2t"], build_vocab_mapping(counts, N)[0])
    assert draft_token_ids(a["d2t"]).tolist() == CYCLE_IDS and draft_token_ids(b["d2t"]).tolist() == B_IDS
    kept = _check_rebuilt(b, a, c)
    assert kept == len(set(CYCLE_IDS) & set(B_IDS))
    warm = _record(out / "step-0000001")["warm_start"]
    assert warm == {"source": str(world["A"]), "vocab": "rebuild", "draft_vocab_size": N, "old_draft_vocab_size": N,
                    "kept_rows": kept, "new_rows": N - kept, "dropped_rows": N - kept}


def test_keep_reproduces_the_old_vocabulary_and_head(world):
    out = world["root"] / "B_keep"
    run_main(base_args(world["data_b"], out, draft_vocab_size=N, init_from=world["A"], warm_start_vocab="keep",
                       **STEP0))
    a, b = _weights(world["A"]), _weights(out / "step-0000001")
    assert set(a) == set(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert _record(out / "step-0000001")["warm_start"]["vocab"] == "keep"


def test_rebuild_takes_this_runs_draft_vocab_size(world):
    """A scratch run's N (48 here, A has 32): zero-count ids fill the rest, A's rows still move."""
    out, n = world["root"] / "B_48", 48
    run_main(base_args(world["data_b"], out, draft_vocab_size=n, init_from=world["A"], **STEP0))
    scratch = world["root"] / "C_48"
    run_main(base_args(world["data_b"], scratch, draft_vocab_size=n, **STEP0))
    b = _weights(out / "step-0000001")
    assert b["d2t"].numel() == n
    kept = _check_rebuilt(b, _weights(world["A"]), _weights(scratch / "step-0000001"))
    warm = _record(out / "step-0000001")["warm_start"]
    assert (warm["kept_rows"], warm["new_rows"], warm["old_draft_vocab_size"]) == (kept, n - kept, N)
    with pytest.raises(CheckpointError, match=f"draft_vocab_size: .* has {N}, the data/config needs {n}"):
        run_main(base_args(world["data_b"], world["root"] / "x", draft_vocab_size=n, init_from=world["A"],
                           warm_start_vocab="keep"))


def test_sglang_layout_source_is_rebuilt_the_same_way(world):
    src = foreign_folder(world["A"], world["root"] / "A_sglang")  # config.json + model.safetensors only
    out = world["root"] / "B_sglang"
    run_main(base_args(world["data_b"], out, draft_vocab_size=N, init_from=src, **STEP0))
    kept = _check_rebuilt(_weights(out / "step-0000001"), _weights(src), _weights(world["C"]))
    assert _record(out / "step-0000001")["warm_start"]["kept_rows"] == kept


def test_resume_restores_the_warm_started_run_exactly(world, caplog):
    """A warm-started run stopped at step 2 and resumed ends bit-exact with an uninterrupted one, keeps its
    warm-start record, and is not warm-started again (its d2t stays the rebuilt one)."""
    args = dict(draft_vocab_size=N, init_from=world["A"], max_steps=4, save_every=2, lr=3e-3)
    straight, stopped = world["root"] / "B_straight", world["root"] / "B_stopped"
    run_main(base_args(world["data_b"], straight, **args))
    run_main(base_args(world["data_b"], stopped, stop_at_step=2, **args))
    assert (stopped / "latest").read_text().strip() == "step-0000002"
    with caplog.at_level("INFO"):
        run_main(base_args(world["data_b"], stopped, resume="auto", **args))
    assert "is not applied again" in caplog.text and "draft vocabulary rebuilt" not in caplog.text
    end_s, end_r = straight / "step-0000004", stopped / "step-0000004"
    assert (end_s / "model.safetensors").read_bytes() == (end_r / "model.safetensors").read_bytes()
    assert _record(end_r)["warm_start"] == _record(end_s)["warm_start"] == _record(stopped / "step-0000002")[
        "warm_start"]
    assert _record(end_r)["warm_start"]["vocab"] == "rebuild"

