"""configs/kimi-k25.yaml, Kimi-K2.5's one config: every stage reads its section, and the settings hold what the
runbook promises (the facts the stages share are written once, under ``facts``, so nothing here compares copies)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers_paths import ROOT

from extract.config import parse_args
from redraft.core.config import ConfigError
from redraft.core.layers import default_aux_layer_ids, to_engine_layer_ids
from redraft.core.options import config_section
from redraft.core.target_weights import weight_key_candidates
from train.config import load_config

KIMI = ROOT / "configs" / "kimi-k25.yaml"
ARCH = "KimiK25ForConditionalGeneration"  # Kimi-K2.5: 61 layers, hidden 7168, vocab 163840, context 262144
TRAIN = ["--data", "d", "--out", "o"]


def _parsed(module, *args: str, section: str = ""):
    return module.parse_options(["--config", f"{KIMI}{section}", *args])


def test_every_stage_reads_its_own_section():
    import eval.acceptance as acceptance
    import eval.export as export

    extract = parse_args(["--config", str(KIMI)], validate=False)
    vllm = parse_args(["--config", f"{KIMI}#extract-vllm"], validate=False)
    train, mla = load_config(str(KIMI), TRAIN), load_config(f"{KIMI}#train-mla", TRAIN)
    ev = _parsed(acceptance, "RUN", "--data", "D")
    ex = _parsed(export, "RUN", "OUT")
    assert (extract.backend, vllm.backend) == ("sglang", "vllm")
    assert (train.drafter_attention, mla.drafter_attention) == ("gqa", "mla")
    assert ex.format == "sglang" and ev.split == "val"
    # a flag still wins over the file
    assert load_config(str(KIMI), [*TRAIN, "--lr", "1e-4"]).lr == 1e-4


def test_the_served_setting_is_the_evaluated_one_and_never_the_cap():
    import eval.acceptance as acceptance
    import eval.export as export

    ev, ex = _parsed(acceptance, "RUN", "--data", "D"), _parsed(export, "RUN", "OUT")
    serve = config_section(f"{KIMI}#serve")[1]
    assert (ev.steps, ev.topk, ev.num_draft_tokens) == (ex.steps, ex.topk, ex.num_draft_tokens)
    assert ex.topk != 1 or ex.num_draft_tokens == ex.steps + 1  # SGLang's rule for chains
    assert ex.max_running_requests == serve["max_running_requests"] > 48  # never the speculative cap
    assert serve["cuda_graph_max_bs"] >= serve["max_running_requests"]
    assert parse_args(["--config", str(KIMI)], validate=False).tp_size == ex.tp == serve["tp"] == 8


def test_layers_and_weights_as_both_engines_read_kimi():
    assert parse_args(["--config", str(KIMI)], validate=False).aux_layer_ids in ([], None)
    ours = default_aux_layer_ids(61)
    assert ours == [1, 29, 57]
    assert to_engine_layer_ids(ours, "sglang", ARCH) == [1, 29, 57]  # read alike by SGLang 0.5.10 and 0.5.23
    assert to_engine_layer_ids(ours, "vllm", ARCH) == [2, 30, 58]
    # Kimi-K2.5's text model sits under language_model: its embedding key is looked up prefixed first
    kimi_config = {"architectures": [ARCH], "model_type": "kimi_k25",
                   "text_config": {"model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61,
                                   "vocab_size": 163840, "tie_word_embeddings": False}}
    embed, head = weight_key_candidates(kimi_config)
    assert embed[0] == "language_model.model.embed_tokens.weight"
    assert head[0] == "language_model.lm_head.weight"


def test_kimi_configs_hold_thinking_conversations():
    """Kimi-K2.5's thinking conversations run 8K-64K tokens: the configs keep 32K of them whole, end to end."""
    import eval.acceptance as acceptance
    from extract.shard_plan import sample_bytes
    from redraft.core.dataset.format import bytes_per_token

    extracts = [parse_args(["--config", f"{KIMI}{s}"], validate=False) for s in ("", "#extract-vllm")]
    trains = [load_config(f"{KIMI}{s}", TRAIN) for s in ("", "#train-mla")]
    ev = _parsed(acceptance, "RUN", "--data", "D")
    length = extracts[0].max_length
    assert length >= 32768
    assert {e.max_length for e in extracts} == {t.max_length for t in trains} == {length}
    for e in extracts:
        assert e.max_new_tokens + 2048 <= length  # a reply and its prompt are stored whole, not cut
        per_token = int(bytes_per_token(7168, 3, e.hidden_dtype, e.teacher, e.topk))
        assert e.samples_per_shard * sample_bytes(length, per_token) <= e.shard_bytes  # the worst case fits a shard
        assert e.batch_tokens >= length  # a whole sample in one capture batch
    assert extracts[0].engine_args["context_length"] > length  # SGLang: one prefill pass
    for t in trains:
        assert t.tokens_per_batch >= length  # a whole sample in one micro-batch
        assert t.activation_checkpointing and t.attention_impl != "eager"  # 674 KiB a token kept, not 3,341
    assert ev.batch_tokens >= length


def test_a_target_config_refuses_by_name(tmp_path):
    import eval.export as export

    bad = tmp_path / "export.yaml"
    bad.write_text("format: sglang\nspeculative_steps: 3\n")
    with pytest.raises(ConfigError, match=r"export.yaml: unknown key 'speculative_steps'"):
        export.parse_options(["--config", str(bad), "RUN", "OUT"])
    sectioned = tmp_path / "t.yaml"
    sectioned.write_text("facts:\n  steps: &steps 3\nstages:\n  export: {format: sglang, speculative_steps: *steps}\n"
                         "  train: {lr: 1.0e-4}\n")
    with pytest.raises(ConfigError, match=r"t.yaml#export: unknown key 'speculative_steps'"):
        export.parse_options(["--config", str(sectioned), "RUN", "OUT"])
    with pytest.raises(ConfigError, match=r"no stage section 'nope' \(sections: export, train\)"):
        export.parse_options(["--config", f"{sectioned}#nope", "RUN", "OUT"])
    (tmp_path / "odd.yaml").write_text("stages: {train: {lr: 1}}\nlr: 2\n")
    with pytest.raises(ConfigError, match=r"'facts' and 'stages' only \(found lr\)"):
        load_config(str(tmp_path / "odd.yaml"), TRAIN)


def test_redraft_config_prints_a_section_for_a_shell():
    res = subprocess.run([sys.executable, "-m", "redraft", "config", f"{KIMI}#serve", "--env"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    env = dict(line.split("=", 1) for line in res.stdout.splitlines())
    assert env["TP"] == "8" and env["MAX_RUNNING_REQUESTS"] == "256" and env["TARGET"] == "/models/Kimi-K2.5"
    whole = subprocess.run([sys.executable, "-m", "redraft", "config", str(KIMI)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert whole.returncode == 2 and "#STAGE" in whole.stderr and "Traceback" not in whole.stderr
