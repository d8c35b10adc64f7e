"""Serving export/import: the key table, config.json per engine, refusals, atomic OUT, launch line, round trip."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from helpers_drafter import SERVING_KEYS, tiny_config, tiny_drafter
from safetensors.torch import load_file, save_file

from eval.export import ExportConfig, ExportError, export_checkpoint, main
from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.folder import CheckpointError, load_drafter_checkpoint, write_drafter_folder
from redraft.core.drafter.modeling import Eagle3Drafter
from redraft.core.drafter.serving_format import (
    ServingFormatError,
    check_serving_state,
    drafter_config_from_serving,
    expected_tensors,
    serving_config,
)
from redraft.engines.launch import CAP_NOTE, LaunchError, LaunchPlan, sglang_command

torch.set_num_threads(1)

RECORD = {"format": "redraft-checkpoint", "step": 7,
          "dataset": {"path": "/nowhere/data", "tokenizer_hash": "t" * 64, "target_config_hash": "h" * 64}}


def kimi_config() -> DrafterConfig:
    """SpecForge's Kimi-K2.5 drafter shape (serving_engines.md §1a) with the target's 256K context."""
    return DrafterConfig(
        hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, head_dim=128, intermediate_size=18432,
        vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168, aux_layer_ids=[1, 29, 57],
        target_num_layers=61, target_architecture="KimiK25ForConditionalGeneration", rope_theta=1e6,
        max_position_embeddings=262144,
    )


def write_ckpt(folder: Path, seed: int = 0, **overrides) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """A redraft step folder as the trainer writes it (fp32 weights)."""
    d = tiny_drafter(seed=seed, torch_dtype="float32", **overrides)
    folder.mkdir(parents=True)
    state = d.serving_state_dict()
    write_drafter_folder(folder, d.config, state, RECORD)
    return d.config, state


def make_target(folder: Path, *, vocab: int = 64, hidden: int = 32, layers: int = 8,
                arch: str = "LlamaForCausalLM", **extra) -> torch.Tensor:
    """A target folder with just config.json and its input embedding; returns the embedding."""
    folder.mkdir(parents=True)
    cfg = {"architectures": [arch], "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": layers,
           "max_position_embeddings": 256, **extra}
    (folder / "config.json").write_text(json.dumps(cfg))
    emb = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(5))
    save_file({"model.embed_tokens.weight": emb, "lm_head.weight": torch.zeros(vocab, hidden)},
              str(folder / "model.safetensors"))
    return emb


def mutate_weights(folder: Path, fn) -> None:
    sd = load_file(str(folder / "model.safetensors"))
    fn(sd)
    save_file(sd, str(folder / "model.safetensors"))


def export(src: Path, out: Path, fmt: str = "sglang", **kw) -> Path:
    kw.setdefault("dtype", "fp32")
    return export_checkpoint(ExportConfig(ckpt=str(src), out=str(out), format=fmt, **kw)).out


# ----------------------------------------------------------------------------- the table


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_table_is_exactly_the_drafter_serving_keys(fmt):
    cfg = tiny_config()
    table = expected_tensors(cfg, fmt)
    assert set(table) == SERVING_KEYS
    served = Eagle3Drafter(cfg).serving_state_dict()
    assert {k: v.shape for k, v in table.items()} == {k: tuple(v.shape) for k, v in served.items()}
    assert table["d2t"].kind == "int64" and table["t2d"].kind == "bool"
    assert not any(k.startswith(("model.", "layers.")) for k in table)
    with_emb = expected_tensors(cfg, fmt, with_embedding=True)
    assert set(with_emb) - set(table) == {"embed_tokens.weight"}
    assert with_emb["embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size)


def test_kimi_k25_table_and_config_match_the_reference_numbers():
    cfg = kimi_config()
    t = {k: v.shape for k, v in expected_tensors(cfg, "sglang", with_embedding=True).items()}
    for k in ("q_proj", "k_proj", "v_proj"):
        assert t[f"midlayer.self_attn.{k}.weight"] == (8192, 14336)
    assert t["midlayer.self_attn.o_proj.weight"] == (7168, 8192)
    assert t["midlayer.mlp.gate_proj.weight"] == t["midlayer.mlp.up_proj.weight"] == (18432, 7168)
    assert t["midlayer.mlp.down_proj.weight"] == (7168, 18432)
    assert t["fc.weight"] == (7168, 21504)
    assert t["lm_head.weight"] == (32000, 7168)
    assert t["embed_tokens.weight"] == (163840, 7168)
    assert t["d2t"] == (32000,) and t["t2d"] == (163840,)
    for engine, ids in (("sglang", [1, 29, 57]), ("vllm", [2, 30, 58])):  # SGLang's: read alike by 0.5.10 and 0.5.23
        c = serving_config(cfg, engine=engine)
        assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
        assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
        assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (
            7168, 64, 64, 128)
        assert (c["intermediate_size"], c["vocab_size"], c["draft_vocab_size"], c["target_hidden_size"]) == (
            18432, 163840, 32000, 7168)
        assert c["max_position_embeddings"] == 262144  # = the target's context: no SGLang override needed
        assert c["num_hidden_layers"] == 1 and c["num_aux_hidden_states"] == 3
        assert c["rope_theta"] == 1e6 and c["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
        assert c["tie_word_embeddings"] is False and c["norm_before_residual"] is False
        assert c["bias"] is False and c["attention_bias"] is False and c["torch_dtype"] == "bfloat16"
        back = drafter_config_from_serving(c, target_architecture=cfg.target_architecture,
                                           target_num_layers=61, engine=engine)
        assert back == cfg


@pytest.mark.parametrize(("arch", "layers", "ids", "sglang", "vllm"), [
    ("LlamaForCausalLM", 30, [1, 14, 26], [1, 14, 26], [2, 15, 27]),  # SGLang llama.py adds 1 itself
    ("DeepseekV3ForCausalLM", 61, [1, 29, 57], [1, 29, 57], [2, 30, 58]),  # first id 1: SGLang adds 1 in any version
    ("KimiK25ForConditionalGeneration", 61, [1, 29, 57], [1, 29, 57], [2, 30, 58]),
    ("KimiK25ForConditionalGeneration", 61, [2, 30, 58], [3, 31, 59], [3, 31, 59]),  # 0.5.23 reads it as asked
])
def test_config_layer_ids_per_engine(arch, layers, ids, sglang, vllm):
    cfg = tiny_config(aux_layer_ids=ids, target_num_layers=layers, target_architecture=arch)
    for engine, want in (("sglang", sglang), ("vllm", vllm)):
        c = serving_config(cfg, engine=engine)
        assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == want
        assert "eagle_aux_hidden_state_layer_ids" not in c  # nested only: SGLang's capture ignores top level
        back = drafter_config_from_serving(c, target_architecture=arch, target_num_layers=layers, engine=engine)
        assert back.aux_layer_ids == ids


def test_rope_is_written_in_both_spellings_and_read_from_either():
    from transformers import LlamaConfig

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    cfg = tiny_config(rope_theta=5e5, rope_scaling=yarn)
    c = serving_config(cfg)
    assert c["rope_theta"] == 5e5 and c["rope_scaling"] == yarn
    assert c["rope_parameters"] == {**yarn, "rope_theta": 5e5}
    # transformers 5 (what the engines' config parsing builds on) sees the same rope
    assert LlamaConfig(**c).rope_parameters == {**yarn, "rope_theta": 5e5}
    read = lambda conf: drafter_config_from_serving(  # noqa: E731
        conf, target_architecture="LlamaForCausalLM", target_num_layers=8)
    legacy_only = {k: v for k, v in c.items() if k != "rope_parameters"}
    new_only = {k: v for k, v in c.items() if k not in ("rope_theta", "rope_scaling")}
    assert read(c) == read(legacy_only) == read(new_only) == cfg
    with pytest.raises(ServingFormatError, match="rope_theta=5.*disagrees with rope_parameters.rope_theta=1"):
        read({**c, "rope_parameters": {**c["rope_parameters"], "rope_theta": 1e4}})
    plain = serving_config(tiny_config())
    assert plain["rope_scaling"] is None and plain["rope_parameters"] == {"rope_type": "default",
                                                                          "rope_theta": 10000.0}
    assert read(plain) == tiny_config()


def test_training_checkpoint_config_is_the_sglang_export_config(tmp_path):
    cfg, _ = write_ckpt(tmp_path / "step-0000007")
    written = json.loads((tmp_path / "step-0000007" / "config.json").read_text())
    assert written == serving_config(cfg, engine="sglang", torch_dtype="float32")


def test_check_serving_state_names_every_problem():
    d = tiny_drafter()
    sd = d.serving_state_dict()
    check_serving_state(sd, d.config, "vllm")
    bad = dict(sd)
    bad["model.fc.weight"] = bad.pop("fc.weight")
    bad["t2d"] = bad["t2d"].to(torch.int64)
    bad["norm.weight"] = torch.ones(31)
    with pytest.raises(ServingFormatError) as e:
        check_serving_state(bad, d.config, "vllm")
    msg = str(e.value)
    assert "missing key 'fc.weight'" in msg and "unexpected key 'model.fc.weight'" in msg and "'fc.weight'" in msg
    assert "key 't2d': expected bool, found torch.int64" in msg
    assert "key 'norm.weight': expected shape [32], found [31]" in msg
    with pytest.raises(ServingFormatError, match="key 'fc.weight': expected torch.bfloat16, found torch.float32"):
        check_serving_state(sd, d.config, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- export refusals


def _rename(sd):
    sd["midlayer.mlp.upp_proj.weight"] = sd.pop("midlayer.mlp.up_proj.weight")


def _nan(sd):
    sd["midlayer.self_attn.k_proj.weight"][3, 4] = float("nan")


def _inf(sd):
    sd["lm_head.weight"][0, 0] = float("inf")


@pytest.mark.parametrize(("mutate", "pattern"), [
    (_rename, r"missing key 'midlayer.mlp.up_proj.weight'(.|\n)*unexpected key 'midlayer.mlp.upp_proj.weight'"),
    (lambda sd: sd.pop("d2t"), r"missing key 'd2t': expected int64 \[24\] \(without it"),
    (lambda sd: sd.__setitem__("midlayer.fc_norm.0.weight", torch.ones(20)),
     r"unexpected key 'midlayer.fc_norm.0.weight' \(20,\)"),
    (lambda sd: sd.__setitem__("fc.weight", torch.zeros(32, 61)),
     r"key 'fc.weight': expected shape \[32, 60\], found \[32, 61\]"),
    (_nan, r"key 'midlayer.self_attn.k_proj.weight': 1 of \d+ values are NaN or Inf"),
    (_inf, r"key 'lm_head.weight': 1 of \d+ values are NaN or Inf"),
    (lambda sd: sd.__setitem__("d2t", sd["d2t"].to(torch.int32)), r"key 'd2t': expected int64, found torch.int32"),
], ids=["renamed", "no-d2t", "extra", "shape", "nan", "inf", "d2t-dtype"])
def test_export_refuses_bad_checkpoints_naming_the_key(tmp_path, caplog, mutate, pattern):
    src = tmp_path / "step-0000007"
    write_ckpt(src)
    mutate_weights(src, mutate)
    with pytest.raises(ExportError, match=pattern):
        export(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".tmp-*"))
    # the CLI reports the same message and fails
    assert main([str(src), str(tmp_path / "out"), "--format", "vllm", "-q"]) == 2
    assert any(r.levelname == "ERROR" and "key '" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "out").exists()


def test_half_precision_export_refuses_values_that_overflow(tmp_path):
    src = tmp_path / "step-0000007"
    write_ckpt(src)
    mutate_weights(src, lambda sd: sd["norm.weight"].__setitem__(0, 1e5))  # fine in fp32, inf in fp16
    export(src, tmp_path / "ok", dtype="fp32")
    with pytest.raises(ExportError, match="key 'norm.weight': 1 of 32 values are NaN or Inf"):
        export(src, tmp_path / "out", dtype="fp16")


# ----------------------------------------------------------------------------- writing


def test_export_layout_and_bf16_weights(tmp_path):
    src = tmp_path / "step-0000007"
    cfg, state = write_ckpt(src)
    out = export(src, tmp_path / "out", "sglang", dtype="bf16")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "redraft.json", "README.md"}
    sd = load_file(str(out / "model.safetensors"))
    assert set(sd) == SERVING_KEYS
    for k, v in state.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert sd[k].dtype == want.dtype and torch.equal(sd[k], want), k
    config = json.loads((out / "config.json").read_text())
    assert config == serving_config(cfg, engine="sglang", torch_dtype="bfloat16")
    record = json.loads((out / "redraft.json").read_text())
    assert record["serving_format"] == "sglang" and record["source"] == str(src.resolve())
    assert record["dataset"] == RECORD["dataset"] and record["source_step"] == 7
    assert record["drafter"]["torch_dtype"] == "bfloat16"
    assert record["layer_ids_checked_for"] == {"0.5.10": True, "0.5.23": True}  # the SGLang versions read as trained
    assert "python -m sglang.launch_server" in (out / "README.md").read_text()


def test_with_embedding_reads_the_target(tmp_path):
    src = tmp_path / "step-0000007"
    write_ckpt(src)
    emb = make_target(tmp_path / "target")
    out = export(src, tmp_path / "out", with_embedding=True, target=str(tmp_path / "target"))
    sd = load_file(str(out / "model.safetensors"))
    assert set(sd) == SERVING_KEYS | {"embed_tokens.weight"}
    assert torch.equal(sd["embed_tokens.weight"], emb)
    # importing ignores the shipped embedding (serving and training take the target's)
    _, back = load_drafter_checkpoint(out)
    assert set(back) == SERVING_KEYS
    with pytest.raises(ExportError, match="--with-embedding needs the target's weights"):
        export(src, tmp_path / "out2", with_embedding=True)
    wrong = tmp_path / "wrong_target"
    make_target(wrong, vocab=70)
    with pytest.raises(ExportError, match=r"shape \(70, 32\), drafter wants \(64, 32\)"):
        export(src, tmp_path / "out3", with_embedding=True, target=str(wrong))
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


def test_out_is_atomic_and_needs_force(tmp_path, monkeypatch):
    src = tmp_path / "step-0000007"
    write_ckpt(src)
    out = tmp_path / "out"
    out.mkdir()
    export(src, out)  # an empty OUT is fine
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ExportError, match="exists and is not empty"):
        export(src, out, dtype="bf16")
    with pytest.raises(ExportError, match="would replace the checkpoint being exported"):
        export(src, src, force=True)

    import eval.export as ex

    def dies_after_weights(state, path, metadata=None):
        save_file(state, path, metadata=metadata)
        raise OSError("disk full")

    monkeypatch.setattr(ex, "save_file", dies_after_weights)
    with pytest.raises(OSError, match="disk full"):
        export(src, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(OSError, match="disk full"):
        export(src, out, dtype="bf16", force=True)
    assert (out / "model.safetensors").read_bytes() == before  # the old OUT survives a failed --force
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "step-0000007"]
    monkeypatch.undo()
    export(src, out, dtype="bf16", force=True)
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16


def test_run_folder_follows_latest(tmp_path):
    run = tmp_path / "run"
    write_ckpt(run / "step-0000002", seed=2)
    _, newest = write_ckpt(run / "step-0000004", seed=4)
    (run / "latest").write_text("step-0000002\n")
    out = export(run, tmp_path / "a")
    assert torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"], load_file(
        str(run / "step-0000002" / "model.safetensors"))["fc.weight"])
    (run / "latest").unlink()
    out = export(run, tmp_path / "b")
    assert torch.equal(load_file(str(out / "model.safetensors"))["fc.weight"], newest["fc.weight"])
    with pytest.raises(ExportError, match="not a drafter folder"):
        export(tmp_path, tmp_path / "c")


# ----------------------------------------------------------------------------- launch line


def test_sglang_launch_line(tmp_path, capsys):
    src = tmp_path / "step-0000007"
    write_ckpt(src)
    make_target(tmp_path / "target", auto_map={"AutoConfig": "x.Config"})
    rc = main([str(src), str(tmp_path / "out"), "--format", "sglang", "--target", str(tmp_path / "target"),
               "--tp", "8", "--max-running-requests", "256", "--steps", "5", "-q"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert CAP_NOTE in printed and "48" in CAP_NOTE
    line = next(s for s in printed.splitlines() if s.startswith("python -m sglang.launch_server"))
    args = shlex.split(line)
    flag = lambda name: args[args.index(name) + 1]  # noqa: E731
    assert flag("--model-path") == str(tmp_path / "target")
    assert flag("--speculative-algorithm") == "EAGLE3"
    assert flag("--speculative-draft-model-path") == str((tmp_path / "out").resolve())
    assert (flag("--speculative-num-steps"), flag("--speculative-eagle-topk"),
            flag("--speculative-num-draft-tokens")) == ("5", "1", "6")  # topk 1: steps + 1
    assert (flag("--tp"), flag("--max-running-requests"), flag("--cuda-graph-max-bs")) == ("8", "256", "256")
    assert "--trust-remote-code" in args  # the target config has auto_map


def test_launch_plan_rules():
    with pytest.raises(LaunchError, match="with --topk 1 SGLang forces it to steps \\+ 1 = 4"):
        LaunchPlan(steps=3, topk=1, num_draft_tokens=8).resolved()
    with pytest.raises(LaunchError, match="needs an explicit --num-draft-tokens"):
        LaunchPlan(steps=5, topk=4).resolved()
    line = sglang_command("T", "D", LaunchPlan(steps=5, topk=4, num_draft_tokens=8, cuda_graph_max_bs=64))
    assert "--speculative-eagle-topk 4 --speculative-num-draft-tokens 8" in line
    assert "--max-running-requests 128 --cuda-graph-max-bs 64" in line


def test_vllm_launch_line(tmp_path, capsys):
    src = tmp_path / "step-0000007"
    write_ckpt(src)
    assert main([str(src), str(tmp_path / "out"), "--format", "vllm", "--target", "org/model", "-q"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("vllm serve"))
    args = shlex.split(line)
    assert args[2] == "org/model"
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str((tmp_path / "out").resolve()), "num_speculative_tokens": 3}
    assert args[args.index("--max-num-seqs") + 1] == "128"


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for opt in ("--format", "--with-embedding", "--target", "--dtype", "--steps", "--topk", "--num-draft-tokens",
                "--max-running-requests", "--cuda-graph-max-bs", "--tp", "--target-architecture",
                "--target-num-layers", "--force", "--max-position-embeddings", "--trust-remote-code"):
        assert opt in text
    assert "48" in text


# ----------------------------------------------------------------------------- import and round trip


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def test_round_trip_is_exact(tmp_path, fmt, arch):
    src = tmp_path / "step-0000007"
    cfg, state = write_ckpt(src, target_architecture=arch,
                            rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=5e5)
    out = export(src, tmp_path / "out", fmt, dtype="fp32")
    # through redraft.json (what train --init-from and eval.acceptance read)
    back_cfg, back = load_drafter_checkpoint(out)
    assert back_cfg == cfg
    assert set(back) == set(state)
    for k in state:
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k
    # through config.json alone, as an engine or a third party would read the folder
    config = json.loads((out / "config.json").read_text())
    assert drafter_config_from_serving(config, target_architecture=arch, target_num_layers=8, engine=fmt) == cfg
    # the imported drafter computes exactly what the original does
    a, b = Eagle3Drafter(cfg), Eagle3Drafter(back_cfg)
    a.load_serving_state_dict(state)
    b.load_serving_state_dict(back)
    b.embed_tokens.load_state_dict(a.embed_tokens.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    aux = torch.randn(1, 5, 3 * cfg.target_hidden_size)
    from redraft.core.drafter.ttt_attention import TTTCache

    with torch.no_grad():
        pos = torch.arange(5)[None]
        la = a.compute_logits(a(ids, a.project(aux), pos, TTTCache(), None))
        lb = b.compute_logits(b(ids, b.project(aux), pos, TTTCache(), None))
    assert torch.equal(la, lb)
    # exporting the export again changes nothing
    again = export(out, tmp_path / "again", fmt, dtype="fp32")
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert (again / "config.json").read_text() == (out / "config.json").read_text()


def write_specforge_folder(folder: Path, d: Eagle3Drafter, *, prefix: str = "", ids=(1, 2, 4), **config) -> None:
    """What SpecForge's exporter / a published drafter ships: config.json + model.safetensors (+ embedding)."""
    folder.mkdir(parents=True)
    c = d.config
    sd = {**d.serving_state_dict(), "embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size)}
    if prefix:
        sd = {(k if k in ("lm_head.weight", "d2t", "t2d") else prefix + k.replace("midlayer.", "layers.0.")): v
              for k, v in sd.items()}
    save_file(sd, str(folder / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size, "target_hidden_size":
        c.target_hidden_size, "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True},
        **config,
    }
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("prefix", ["", "model."], ids=["specforge", "sglang-internal-names"])
def test_import_specforge_folder(tmp_path, prefix):
    d = tiny_drafter(seed=3, torch_dtype="float32")
    write_specforge_folder(tmp_path / "sf", d, prefix=prefix)
    cfg, sd = load_drafter_checkpoint(tmp_path / "sf", target_architecture="LlamaForCausalLM", target_num_layers=8)
    assert cfg == d.config
    want = d.serving_state_dict()
    assert set(sd) == set(want) and all(torch.equal(sd[k], want[k]) for k in want)
    # exporting the imported folder gives our layout (embedding dropped, names canonical)
    target = tmp_path / "target"
    make_target(target)
    out = export(tmp_path / "sf", tmp_path / "out", "vllm", target=str(target))
    assert set(load_file(str(out / "model.safetensors"))) == SERVING_KEYS
    assert json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2, 3, 5]
    record = json.loads((out / "redraft.json").read_text())
    assert record["source_format"].startswith("foreign") and record["dataset"] is None
    back_cfg, back = load_drafter_checkpoint(out)
    assert back_cfg == d.config and all(torch.equal(back[k], want[k]) for k in want)


def test_import_deepseek_family_ids_and_missing_target_facts(tmp_path):
    d = tiny_drafter(seed=4, torch_dtype="float32", target_architecture="DeepseekV3ForCausalLM")
    write_specforge_folder(tmp_path / "sf", d, ids=(2, 3, 5))  # input-of-layer ids, as for Kimi [2, 30, 58]
    with pytest.raises(ExportError, match="pass --target TARGET_FOLDER, or --target-architecture"):
        export(tmp_path / "sf", tmp_path / "out")
    out = export(tmp_path / "sf", tmp_path / "out", target_architecture="DeepseekV3ForCausalLM",
                 target_num_layers=8)
    assert json.loads((out / "redraft.json").read_text())["drafter"]["aux_layer_ids"] == [1, 2, 4]
    cfg, _ = load_drafter_checkpoint(out)
    assert cfg == d.config


@pytest.mark.parametrize(("change", "pattern"), [
    ({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"}, "speculators-format"),
    ({"architectures": ["Eagle3DeepseekV2ForCausalLM"]}, "key 'q_lora_rank' is missing"),  # MLA arch, Llama keys
    ({"kv_lora_rank": 512}, "an MLA size in a LlamaForCausalLMEagle3 config"),
    ({"model_type": "deepseek_v3"}, "deepseek_mtp"),
    ({"norm_before_fc": True}, "norm_before_fc=true"),
    ({"norm_before_residual": True}, "norm_before_residual=true"),
    ({"num_hidden_layers": 2}, "num_hidden_layers=2"),
])
def test_import_refuses_other_layouts(tmp_path, change, pattern):
    write_specforge_folder(tmp_path / "sf", tiny_drafter(), **change)
    with pytest.raises(CheckpointError, match=pattern):
        load_drafter_checkpoint(tmp_path / "sf", target_architecture="LlamaForCausalLM", target_num_layers=8)


# ----------------------------------------------------------------------------- from a real training run


def test_export_of_a_trained_run_finds_its_target_through_the_record(tmp_path, capsys):
    """train -> export --with-embedding without --target: the record's dataset manifest names the target."""
    from helpers_train import base_args, make_dataset, run_main
    from helpers_train import make_target as make_tiny_target

    target, vocab = make_tiny_target(tmp_path / "target")
    data = make_dataset(tmp_path / "data", target, vocab, num_samples=16, per_shard=8)
    run = tmp_path / "run"
    run_main(base_args(data, run, max_steps=2, val_max_samples=2))
    assert main([str(run), str(tmp_path / "out"), "--format", "sglang", "--with-embedding", "-q"]) == 0
    out = tmp_path / "out"
    sd = load_file(str(out / "model.safetensors"))
    emb = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(sd["embed_tokens.weight"], emb.to(sd["embed_tokens.weight"].dtype))
    assert f"--model-path {target}" in capsys.readouterr().out
    record = json.loads((out / "redraft.json").read_text())
    assert record["source"] == str((run / "step-0000002").resolve()) and record["dataset"]["path"]
    cfg, back = load_drafter_checkpoint(out)
    ref_cfg, ref = load_drafter_checkpoint(run / "step-0000002")
    assert cfg == ref_cfg and all(torch.equal(back[k], ref[k]) for k in ref)


@pytest.mark.parametrize("how", ["", "-q", "config"])
def test_the_command_line_is_quiet_when_asked(tmp_path, how):
    """`python -m eval.export ... -q` (or `quiet: true` in its --config file) through the runner every command ends by
    (redraft.core.cli.run sets logging up before main): the export's INFO line only when not asked to be quiet, the
    serving command either way."""
    import subprocess
    import sys

    from helpers_paths import ROOT

    src = tmp_path / "step-0000007"
    write_ckpt(src)
    quiet = {"": [], "-q": ["-q"], "config": ["--config", str(tmp_path / "export.yaml")]}[how]
    (tmp_path / "export.yaml").write_text("quiet: true\n")
    res = subprocess.run([sys.executable, "-m", "eval.export", str(src), str(tmp_path / "out"), "--format", "vllm",
                          "--dtype", "fp32", *quiet], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "vllm serve" in res.stdout
    assert any("INFO" in line.split() and ": exported " in line for line in res.stderr.splitlines()) is not bool(how)
