"""EAGLE-3.1 (DrafterConfig.method "eagle3.1"): fc_norm and norm_output as SGLang 0.5.23 and vLLM 0.32 read them.

The reference semantics are written here from the engines' code, not from the module under test: vLLM
``llama_eagle3.py::combine_hidden_states`` (one RMSNorm per aux chunk, eps rms_norm_eps, weight * x /
rms, then fc) and the last lines of its ``LlamaModel.forward`` (``aux_output = hidden_states if
self.norm_output else hidden_prenorm``: the next step reads the post-norm tensor that lm_head reads); SGLang
``llama_eagle3.py`` / ``kimi_k25_eagle3.py`` do the same. The end-to-end proof is the engine-truth lane's kinds
phase (offline walk = vLLM's counters per request for an EAGLE-3.1 drafter of each attention kind).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers_drafter import MLA_SERVING_KEYS, SERVING_KEYS, tiny_drafter

from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.modeling import Eagle3Drafter
from redraft.core.drafter.serving_format import (
    ServingFormatError,
    check_serving_state,
    drafter_config_from_serving,
    serving_config,
)
from redraft.core.drafter.ttt_attention import TTTCache

torch.set_num_threads(1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_fc_reads_each_aux_layer_normed_on_its_own(attention):
    d = tiny_drafter(seed=3, attention=attention, method="eagle3.1")
    c = d.config
    aux = torch.randn(2, 5, c.num_aux_layers * c.target_hidden_size) * torch.tensor([0.1, 3.0, 40.0]).repeat_interleave(
        c.target_hidden_size)  # layers of very different scales, as a target's low/mid/high layers are
    w = [d.state_dict()[f"fc_norm.{i}.weight"] for i in range(c.num_aux_layers)]
    chunks = aux.split(c.target_hidden_size, dim=-1)
    want = torch.cat([_rms(x, wi, c.rms_norm_eps) for x, wi in zip(chunks, w, strict=True)], -1) @ d.fc.weight.T
    torch.testing.assert_close(d.project(aux), want)
    plain = aux @ d.fc.weight.T
    assert not torch.allclose(d.project(aux), plain, atol=1e-3)  # the norm is there


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_each_step_passes_on_the_tensor_lm_head_reads(attention):
    new = tiny_drafter(seed=5, attention=attention, method="eagle3.1")
    old = Eagle3Drafter(DrafterConfig.from_dict({**new.config.to_dict(), "method": "eagle3"}))
    old.load_serving_state_dict({k: v for k, v in new.state_dict().items() if not k.startswith("fc_norm.")},
                                strict=False)
    old.embed_tokens.weight.data.copy_(new.embed_tokens.weight)
    c = new.config
    ids = torch.randint(0, c.vocab_size, (1, 6))
    pos = torch.arange(6)[None]
    h0 = torch.randn(1, 6, c.hidden_size)
    h2 = old(ids, h0, pos, TTTCache(), None)  # EAGLE-3's step: the layer's output, pre-norm
    state = new(ids, h0, pos, TTTCache(), None)
    torch.testing.assert_close(state, _rms(h2, old.norm.weight, c.rms_norm_eps))  # norm_output
    torch.testing.assert_close(new.compute_logits(state), old.compute_logits(h2))  # lm_head(norm(h2)) either way
    # the second step reads the post-norm state: EAGLE-3's layer fed that tensor agrees, fed h2 it does not
    cache_new, cache_old, cache_pre = TTTCache(), TTTCache(), TTTCache()
    s1 = new(ids, new(ids, h0, pos, cache_new, None), pos + 1, cache_new, None)
    first = _rms(old(ids, h0, pos, cache_old, None), old.norm.weight, c.rms_norm_eps)
    torch.testing.assert_close(s1, _rms(old(ids, first, pos + 1, cache_old, None), old.norm.weight, c.rms_norm_eps))
    pre_rule = old(ids, old(ids, h0, pos, cache_pre, None), pos + 1, cache_pre, None)
    assert not torch.allclose(_rms(pre_rule, old.norm.weight, c.rms_norm_eps), s1, atol=1e-3)


@pytest.mark.parametrize("attention,keys", [("gqa", SERVING_KEYS), ("mla", MLA_SERVING_KEYS)])
def test_the_serving_folder_carries_both_switches_and_a_norm_per_aux_layer(attention, keys):
    d = tiny_drafter(seed=1, attention=attention, method="eagle3.1")
    state = d.serving_state_dict()
    assert set(state) == keys | {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    check_serving_state(state, d.config, "vllm")
    for engine in ("sglang", "vllm"):
        config = serving_config(d.config, engine=engine)
        assert config["fc_norm"] is True and config["norm_output"] is True  # top level: where both engines read
        assert "fc_norm" not in config["eagle_config"]
        back = drafter_config_from_serving(json.loads(json.dumps(config)), engine=engine,
                                           target_architecture=d.config.target_architecture,
                                           target_num_layers=d.config.target_num_layers)
        assert back.method == "eagle3.1" and back == d.config.__class__.from_dict(
            {**d.config.to_dict(), "torch_dtype": back.torch_dtype, "max_position_embeddings":
             back.max_position_embeddings})
    plain = serving_config(DrafterConfig.from_dict({**d.config.to_dict(), "method": "eagle3"}))
    assert plain["fc_norm"] is False and "norm_output" not in plain  # SpecForge reads norm_output otherwise


def test_a_folder_that_mixes_the_two_rules_is_refused_by_key():
    d = tiny_drafter(seed=1, method="eagle3.1")
    base = serving_config(d.config)
    facts = {"target_architecture": d.config.target_architecture, "target_num_layers": d.config.target_num_layers}
    for change, named in (({"norm_output": False}, "fc_norm=true with norm_output false"),
                          ({"fc_norm": False}, "norm_output=true with fc_norm false"),
                          ({"eagle_config": {**base["eagle_config"], "fc_norm": True}}, "eagle_config.fc_norm")):
        with pytest.raises(ServingFormatError, match=named):
            drafter_config_from_serving({**base, **change}, **facts)
    alias = {k: v for k, v in base.items() if k != "fc_norm"} | {"use_aux_norm": True}  # SGLang's older name
    assert drafter_config_from_serving(alias, **facts).method == "eagle3.1"
    with pytest.raises(ValueError, match="method='eagle3.2'"):
        DrafterConfig.from_dict({**d.config.to_dict(), "method": "eagle3.2"})


def test_warm_start_across_methods_is_refused_by_key():
    from redraft.core.drafter.folder import CheckpointError
    from train.checkpoint import check_init_compatible

    new = tiny_drafter(method="eagle3.1").config
    old = DrafterConfig.from_dict({**new.to_dict(), "method": "eagle3"})
    with pytest.raises(CheckpointError, match="set drafter_method: eagle3.1"):
        check_init_compatible(new, old, "published-3.1", ("attention", "method"))
