"""The lane's engine-loading judge (eval/loadcheck) and its drafter writer, without the engines.

A fake engine with SGLang's habits (silent skips, a stacked gate/up, a q_a/kv_a pair it only fuses
when both arrive, d2t outside the parameters) drives the real procedure, so every verdict rule is
exercised here; the real engines run in the lane (conformance/run.sh, phase 4).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conformance import check_engines as ce
from conformance import foreign_drafter as fd
from conformance.make_drafters import MLA_DRAFTERS
from eval import verify_engine
from eval.loadcheck import probe
from eval.loadcheck.check import SetupError, run_check
from eval.loadcheck.folder import LLAMA, MLA, FolderError, read_folder
from eval.loadcheck.layout import stacked_shards
from eval.loadcheck.targets import synth_target, target_config

H, N_INTER, V, VD = 4, 4, 10, 4  # hidden, intermediate, vocab, draft vocab of the fake


class FakeModel(torch.nn.Module):
    """Parameter names and loading rules in SGLang's style, at toy size."""

    def __init__(self, skip_d2t: bool = False, transpose_fc: bool = False) -> None:
        super().__init__()
        self.config = type("Cfg", (), {"draft_vocab_size": VD, "vocab_size": V, "hidden_size": H,
                                       "target_hidden_size": H})()
        self.fc = torch.nn.Parameter(torch.empty(H, H))
        self.gate_up = torch.nn.Parameter(torch.empty(2 * N_INTER, H))
        self.fused = torch.nn.Parameter(torch.empty(6, H))  # q_a (2 rows) + kv_a (4 rows)
        self.embed = torch.nn.Parameter(torch.empty(V, H))
        self.hot_token_id = None
        self.skip_d2t, self.transpose_fc = skip_d2t, transpose_fc
        self._pending: dict[str, torch.Tensor] = {}

    def load_weights(self, weights) -> None:
        for name, t in weights:
            with torch.no_grad():
                if name == "d2t":
                    if not self.skip_d2t:
                        self.hot_token_id = t + torch.arange(t.shape[0])
                elif name in ("fc.weight", "norm.weight"):  # norm.weight: a loader bug writing fc twice
                    self.fc.copy_(t.T if self.transpose_fc else t)
                elif name == "mlp.gate_proj.weight":
                    self.gate_up[:N_INTER] = t
                elif name == "mlp.up_proj.weight":
                    self.gate_up[N_INTER:] = t
                elif name in ("attn.q_a_proj.weight", "attn.kv_a_proj_with_mqa.weight"):
                    self._pending[name] = t
                    if len(self._pending) == 2:
                        self.fused.copy_(torch.cat([self._pending.pop("attn.q_a_proj.weight"),
                                                    self._pending.pop("attn.kv_a_proj_with_mqa.weight")]))
                # anything else: skipped without a word, as SGLang does


class FakeEngine:
    name = "fake"
    version = "fake 1.0"

    def __init__(self, model: FakeModel | None = None, build_error: Exception | None = None) -> None:
        self.model, self.build_error = model or FakeModel(), build_error

    def build(self) -> torch.nn.Module:
        if self.build_error:
            raise self.build_error
        return self.model

    def load_all(self, model: torch.nn.Module) -> None:
        model.load_weights(iter(self.tensors.items()))

    def load_keys(self, model, items) -> None:
        model._pending.clear()
        model.load_weights(iter(items))

    def reset(self, model) -> None:
        model.hot_token_id = None

    def vocab_map(self, model) -> torch.Tensor | None:
        return model.hot_token_id

    def vocab_map_required(self, model) -> bool:
        return True

    def target_vocab(self, model) -> int:
        return V

    def provided_by_target(self, name: str, model) -> str | None:
        return "the target's embedding" if name == "embed" else None

    def shards(self, model) -> dict[str, list[probe.Shard]]:
        return {"gate_up": [probe.Shard("gate_proj", 0, N_INTER), probe.Shard("up_proj", N_INTER, 2 * N_INTER)],
                "fused": [probe.Shard("q_a_proj", 0, 2), probe.Shard("kv_a_proj_with_mqa", 2, 6)]}

    def partners(self, key: str, keys: Sequence[str]) -> list[str]:
        pair = {"attn.q_a_proj.weight": "attn.kv_a_proj_with_mqa.weight",
                "attn.kv_a_proj_with_mqa.weight": "attn.q_a_proj.weight"}
        return [pair[key]] if key in pair and pair[key] in keys else []

    def cleanup(self) -> None:
        pass


def good_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"fc.weight": torch.randn(H, H, generator=g), "mlp.gate_proj.weight": torch.randn(N_INTER, H, generator=g),
            "mlp.up_proj.weight": torch.randn(N_INTER, H, generator=g), "attn.q_a_proj.weight": torch.randn(2, H, generator=g),
            "attn.kv_a_proj_with_mqa.weight": torch.randn(4, H, generator=g),
            "d2t": torch.tensor([0, 2, 4, 5]), "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, torch.tensor([0, 3, 6, 8]), True)}


def check(tmp_path: Path, state: dict[str, torch.Tensor], engine: FakeEngine | None = None) -> probe.Report:
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Eagle3DeepseekV2ForCausalLM"],
                                                   "vocab_size": V, "hidden_size": H}))
    save_file(state, str(folder / "model.safetensors"))
    engine = engine or FakeEngine()
    engine.tensors = state
    return run_check(engine, read_folder(folder))


# ----------------------------------------------------------------------------- the procedure


def test_a_whole_checkpoint_passes_and_every_key_is_traced(tmp_path):
    rep = check(tmp_path, good_state())
    assert rep.ok, rep.problems
    assert rep.by_design == {"embed": "the target's embedding"}
    uses = {u.key: u for u in rep.keys}
    assert uses["mlp.up_proj.weight"].wrote == {"gate_up": [(N_INTER, 2 * N_INTER)]}
    assert uses["attn.q_a_proj.weight"].together_with == ["attn.kv_a_proj_with_mqa.weight"]
    assert uses["d2t"].vocab_map and uses["t2d"].by_design
    line = rep.verdict()
    assert line.startswith("VERDICT fake PASS") and "(t2d skipped by design)" in line
    assert ce.parse_verdicts(line)["fake"].status == "PASS"
    assert rep.warnings == []
    state = good_state()
    state["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, torch.tensor([0, 3, 6, 9]), True)
    rep = check(tmp_path, state)
    assert rep.ok and rep.warnings == ["t2d disagrees with d2t at 2 target ids (both engines ignore t2d)"]


def test_a_renamed_key_is_ignored_and_its_shard_named(tmp_path):
    state = good_state()
    state["mlp.upp_proj.weight"] = state.pop("mlp.up_proj.weight")
    rep = check(tmp_path, state)
    assert not rep.ok
    assert any(p.startswith("parameter gate_up not loaded") and "rows 4..7 of 8 (the up_proj shard)" in p
               for p in rep.problems), rep.problems
    assert any("key mlp.upp_proj.weight ignored" in p for p in rep.problems)
    assert ce.parse_verdicts(rep.verdict())["fake"].status == "FAIL"


def test_a_fused_pair_missing_one_half_loses_both(tmp_path):
    state = good_state()
    del state["attn.kv_a_proj_with_mqa.weight"]
    rep = check(tmp_path, state)
    assert any("parameter fused not loaded" in p and "q_a_proj/kv_a_proj_with_mqa shards" in p for p in rep.problems)
    assert any("key attn.q_a_proj.weight ignored" in p for p in rep.problems)


def test_keys_writing_the_same_rows_and_wrong_values_are_problems(tmp_path):
    state = good_state()
    state["norm.weight"] = state["fc.weight"].clone()
    rep = check(tmp_path, state)
    assert any("keys fc.weight and norm.weight both write fc" in p for p in rep.problems), rep.problems
    rep = check(tmp_path, good_state(), FakeEngine(FakeModel(transpose_fc=True)))
    assert any("fc.weight landed in fc" in p and "other values" in p for p in rep.problems), rep.problems


def test_the_vocab_map_is_required_and_validated(tmp_path):
    state = good_state()
    del state["d2t"]
    rep = check(tmp_path, state)
    assert any(p.startswith("no d2t although draft_vocab_size (4) != the target vocab (10)") for p in rep.problems)
    rep = check(tmp_path, good_state(), FakeEngine(FakeModel(skip_d2t=True)))
    assert "d2t is in the checkpoint but the engine holds no draft->target map" in rep.problems
    state = good_state()
    state["d2t"] = torch.tensor([0, 0, 9, 9])  # targets 0, 1, 11, 12: outside the vocab
    rep = check(tmp_path, state)
    assert any("outside the target vocab [0, 10)" in p for p in rep.problems)


def test_nonfinite_checkpoint_values_and_build_refusals_fail(tmp_path):
    state = good_state()
    state["fc.weight"][0, 0] = float("nan")
    assert any("fc.weight holds NaN" in p for p in check(tmp_path, state).problems)
    rep = check(tmp_path, good_state(), FakeEngine(build_error=ValueError("requires q_lora_rank")))
    assert rep.problems == ["fake could not build the draft model: ValueError: requires q_lora_rank"]
    with pytest.raises(SetupError):
        check(tmp_path, good_state(), FakeEngine(build_error=SetupError("sglang is not importable")))


# ----------------------------------------------------------------------------- pieces


def test_sentinels_spans_and_shard_names():
    p = torch.zeros(6, 2)
    ints = torch.zeros(3, dtype=torch.int64)
    probe.sentinel_fill([p, ints])
    assert probe.written_spans(p) == [] and probe.written_spans(ints) == []
    p[1:3] = 1.0
    assert probe.written_spans(p) == [(1, 3)]
    shards = [probe.Shard("a", 0, 1), probe.Shard("b", 1, 3), probe.Shard("c", 3, 6)]
    assert probe.describe_unwritten("w", p, shards) == "8/12 elements never written; rows 0, 3..5 of 6 (the a/c shards)"
    assert probe.sentinel_rows(torch.zeros(2, dtype=torch.bool)) is None


def test_stacked_shards_of_both_architectures():
    llama = {"intermediate_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2,
             "hidden_size": 8}
    got = stacked_shards([("model.layers.0.self_attn.qkv_proj.weight", 16), ("x.mlp.gate_up_proj.weight", 16)], llama)
    assert [(s.label, s.start, s.stop) for s in got["model.layers.0.self_attn.qkv_proj.weight"]] == [
        ("q_proj", 0, 8), ("k_proj", 8, 12), ("v_proj", 12, 16)]
    mla = {"intermediate_size": 8, "q_lora_rank": 6, "kv_lora_rank": 4, "qk_rope_head_dim": 2}
    got = stacked_shards([("a.self_attn.fused_qkv_a_proj_with_mqa.weight", 12), ("b.fused_qkv_a_proj.weight", 12),
                          ("c.fused_qkv_a_proj.weight", 13)], mla)
    assert [s.label for s in got["b.fused_qkv_a_proj.weight"]] == ["q_a_proj", "kv_a_proj_with_mqa"]
    assert "c.fused_qkv_a_proj.weight" not in got  # sizes that do not add up name nothing


def test_read_folder_names_the_file_and_key(tmp_path):
    with pytest.raises(FolderError, match=r"config.json: no such file"):
        read_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MysteryForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FolderError, match=r"architectures\[0\] 'MysteryForCausalLM' is not an EAGLE-3 drafter"):
        read_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                      "hidden_size": 8}))
    with pytest.raises(FolderError, match=r"key 'vocab_size' must be an integer"):
        read_folder(tmp_path)


def test_vllm_targets_fit_the_drafter(tmp_path):
    mla = read_folder(fd.write_folder(tmp_path / "mla", fd.PRESETS["mla-tiny"]))
    t = synth_target(mla, context_length=8192)
    assert t["architectures"] == ["DeepseekV3ForCausalLM"] and t["num_hidden_layers"] == 7
    assert (t["vocab_size"], t["hidden_size"], t["kv_lora_rank"], t["max_position_embeddings"]) == (1000, 64, 32, 8192)
    llama = read_folder(fd.write_folder(tmp_path / "llama", fd.PRESETS["llama-tiny"]))
    assert synth_target(llama)["architectures"] == ["LlamaForCausalLM"]
    given = tmp_path / "target.json"
    given.write_text(json.dumps(fd.kimi_k25_target_config()))
    assert target_config(mla, given, None)["model_type"] == "kimi_k25"
    with pytest.raises(FolderError, match="no such file"):
        target_config(mla, tmp_path / "nope.json", None)


def test_verify_engine_cannot_run_on_a_missing_folder(tmp_path, capsys):
    assert verify_engine.main([str(tmp_path / "nope"), "--engine", "sglang"]) == 2
    assert "VERDICT sglang ERROR:" in capsys.readouterr().out
    assert verify_engine.main(["--engine", "tgi"]) == 2


# ----------------------------------------------------------------------------- the engine-layout drafters


def test_mla_layout_is_the_one_the_engines_read(tmp_path):
    """The MLA keys and shapes, written out by hand from kimi_k25_eagle3.py / deepseek_eagle3.py."""
    s = fd.PRESETS["mla-kimi"]
    shapes = s.tensors()
    a = "midlayer.self_attn."
    assert shapes[f"{a}q_a_proj.weight"] == (1536, 2 * 7168)
    assert shapes[f"{a}q_b_proj.weight"] == (64 * (128 + 64), 1536)
    assert shapes[f"{a}kv_a_proj_with_mqa.weight"] == (512 + 64, 2 * 7168)
    assert shapes[f"{a}kv_b_proj.weight"] == (64 * (128 + 128), 512)
    assert shapes[f"{a}o_proj.weight"] == (7168, 64 * 128)
    assert shapes["fc.weight"] == (7168, 3 * 7168) and shapes["lm_head.weight"] == (32000, 7168)
    c = s.config()
    assert c["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and c["model_type"] == "deepseek_v2"
    assert "n_routed_experts" not in c and c["num_hidden_layers"] == 1
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True}
    assert c["rope_parameters"]["rope_type"] == "yarn"
    n = sum(int(torch.Size(d).numel()) for d in shapes.values())
    assert 0.85e9 < n < 0.95e9
    direct = fd.PRESETS["mla-tiny-direct-q"].tensors()
    assert f"{a}q_proj.weight" in direct and f"{a}q_a_proj.weight" not in direct


def test_written_folders_hold_a_valid_vocab_and_the_defects_asked_for(tmp_path):
    out = fd.write_folder(tmp_path / "x", fd.PRESETS["mla-tiny"], renames={"norm.weight": "norm2.weight"},
                          drops=["t2d"], config_overrides={"num_hidden_layers": 2})
    state = load_file(str(out / "model.safetensors"))
    assert "norm2.weight" in state and "norm.weight" not in state and "t2d" not in state
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert state["fc.weight"].dtype == torch.bfloat16
    targets = state["d2t"] + torch.arange(200)
    assert targets.unique().numel() == 200 and int(targets.max()) < 1000
    assert torch.equal(targets, targets.sort().values)
    with pytest.raises(KeyError, match="--rename nope=x: no key 'nope'"):
        fd.apply_defects(state, {"nope": "x"}, [])
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_the_lanes_mla_drafters_and_their_expectations():
    assert {n: v[1] for n, v in MLA_DRAFTERS.items()} == {"mla-small": "PASS", "mla-kimi": "PASS",
                                                         "mla-direct-q": "FAIL"}
    assert all(v[0] in fd.PRESETS for v in MLA_DRAFTERS.values())
    assert ce.MLA_BASE in MLA_DRAFTERS


def test_mla_negative_controls_break_what_they_say(tmp_path):
    good = fd.write_folder(tmp_path / "mla-small", fd.PRESETS["mla-tiny"])
    kind, renames = ce.MLA_BROKEN[0]
    bad = ce.break_export(good, tmp_path / "bad", kind, renames)
    keys = set(load_file(str(bad / "model.safetensors")))
    assert "midlayer.self_attn.kv_a_proj.weight" in keys and "midlayer.self_attn.kv_a_proj_with_mqa.weight" not in keys
    assert read_folder(bad).kind == MLA and read_folder(fd.write_folder(tmp_path / "l", fd.PRESETS["llama-tiny"])).kind == LLAMA
    with pytest.raises(KeyError, match="no key 'midlayer.self_attn.q_proj.weight'"):  # q_a/q_b here, no q_proj
        ce.break_export(good, tmp_path / "bad2", "renamed", {"midlayer.self_attn.q_proj.weight": "x"})


def test_check_foreign_needs_the_small_mla_drafter(tmp_path):
    failures, n = ce.check_foreign("python-unused", tmp_path, tmp_path / "logs")
    assert n == 0 and len(failures) == 1 and "no mla-small.json" in failures[0]


def test_the_warm_start_drafter_means_the_demo_layers_to_our_importer():
    """llama-smollm stands for an SGLang-layout drafter of SmolLM2: its config ids must read as the demo's."""
    from redraft.core.drafter.serving_format import drafter_config_from_serving

    cfg = drafter_config_from_serving(fd.PRESETS["llama-smollm"].config(), target_architecture="LlamaForCausalLM",
                                      target_num_layers=30)
    assert cfg.aux_layer_ids == [1, 14, 26]
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.draft_vocab_size) == (576, 3, 4096)
