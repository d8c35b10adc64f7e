"""configs/kimi-k25/: extract, train, eval, export and serve settings agree with one another."""

from __future__ import annotations

from helpers_paths import ROOT

from extract.config import load_yaml
from redraft.core.layers import default_aux_layer_ids, to_engine_layer_ids
from redraft.core.target_weights import weight_key_candidates
from train.config import load_config

KIMI = ROOT / "configs" / "kimi-k25"
ARCH = "KimiK25ForConditionalGeneration"  # Kimi-K2.5: 61 layers, hidden 7168, vocab 163840, context 262144


def _serve_env() -> dict[str, str]:
    lines = (KIMI / "serve.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def _parsed(module, config: str, *positional: str):
    return module.parse_options(["--config", str(KIMI / config), *positional])


def test_kimi_configs_agree():
    import eval.acceptance as acceptance
    import eval.export as export

    extract = load_yaml(KIMI / "extract.yaml")
    train = load_config(str(KIMI / "train.yaml"), ["--data", "d", "--out", "o"])
    ev = _parsed(acceptance, "eval.yaml", "RUN", "--data", "D")
    ex = _parsed(export, "export.yaml", "RUN", "OUT")
    serve = _serve_env()

    # one target, one parallelism, one context
    assert extract["target"] == ex.target == serve["TARGET"]
    assert extract["tp_size"] == ex.tp == int(serve["TP"]) == 8
    assert extract["max_length"] == train.max_length
    assert train.max_position_embeddings == ex.max_position_embeddings == 262144
    assert train.hidden_size == 7168 and train.draft_vocab_size == 32000
    assert train.dtype == ex.dtype == ev.dtype == "bf16"

    # layers: extraction's default for 61 layers, in both engines' config convention
    assert extract.get("aux_layer_ids", []) == []
    ours = default_aux_layer_ids(61)
    assert ours == [1, 29, 57]
    assert to_engine_layer_ids(ours, "sglang", ARCH) == [1, 29, 57]  # read alike by SGLang 0.5.10 and 0.5.23
    assert to_engine_layer_ids(ours, "vllm", ARCH) == [2, 30, 58]
    assert ex.format == "sglang"

    # what is evaluated offline is what SGLang will draft and serve
    assert (ev.steps, ev.topk, ev.num_draft_tokens) == (ex.steps, ex.topk, ex.num_draft_tokens)
    assert ex.topk != 1 or ex.num_draft_tokens == ex.steps + 1  # SGLang's rule for chains
    assert ex.max_running_requests == int(serve["MAX_RUNNING_REQUESTS"]) > 48  # never the speculative cap
    assert ex.cuda_graph_max_bs == int(serve["CUDA_GRAPH_MAX_BS"]) >= ex.max_running_requests

    # Kimi-K2.5's text model sits under language_model: its embedding key is looked up prefixed first
    kimi_config = {"architectures": [ARCH], "model_type": "kimi_k25",
                   "text_config": {"model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61,
                                   "vocab_size": 163840, "tie_word_embeddings": False}}
    embed, head = weight_key_candidates(kimi_config)
    assert embed[0] == "language_model.model.embed_tokens.weight"
    assert head[0] == "language_model.lm_head.weight"


def test_unknown_key_in_an_eval_config_is_refused(tmp_path):
    import pytest

    import eval.export as export
    from redraft.core.config import ConfigError

    bad = tmp_path / "export.yaml"
    bad.write_text("format: sglang\nspeculative_steps: 3\n")
    with pytest.raises(ConfigError, match=r"export.yaml: unknown key 'speculative_steps'"):
        export.parse_options(["--config", str(bad), "RUN", "OUT"])


def test_kimi_configs_hold_thinking_conversations():
    """Kimi-K2.5's thinking conversations run 8K-64K tokens: the configs keep 32K of them whole, end to end."""
    import eval.acceptance as acceptance
    from extract.config import parse_args
    from extract.shard_plan import sample_bytes
    from redraft.core.dataset.format import bytes_per_token

    extracts = [parse_args(["--config", str(KIMI / name)], validate=False) for name in ("extract.yaml",
                                                                                        "extract-vllm.yaml")]
    trains = [load_config(str(KIMI / name), ["--data", "d", "--out", "o"]) for name in ("train.yaml", "train-mla.yaml")]
    ev = _parsed(acceptance, "eval.yaml", "RUN", "--data", "D")
    length = extracts[0].max_length
    assert length >= 32768
    assert {e.max_length for e in extracts} == {t.max_length for t in trains} == {length}

    for e in extracts:
        assert e.max_new_tokens + 2048 <= length  # a reply and its prompt are stored whole, not cut
        per_token = int(bytes_per_token(7168, 3, e.hidden_dtype, e.teacher, e.topk))
        assert e.samples_per_shard * sample_bytes(length, per_token) <= e.shard_bytes  # the worst case fits a shard
        assert e.batch_tokens >= length  # a whole sample in one capture batch
    sglang = extracts[0]
    assert sglang.backend == "sglang" and sglang.engine_args["context_length"] > length  # one prefill pass

    for t in trains:
        assert t.tokens_per_batch >= length  # a whole sample in one micro-batch
        assert t.activation_checkpointing and t.attention_impl != "eager"  # 674 KiB a token kept, not 3,341
    assert ev.batch_tokens >= length
