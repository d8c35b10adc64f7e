"""Which attention backend redraft asks vLLM CPU for: its reference MLA kernels for a float32 MLA model.

vLLM 0.32 picks its AMX MLA kernels on any CPU with AMX tiles, and they refuse float32 weights; the real load
that this guards is tests/unit/test_kimi_mini.py::test_vllm_loads_it_and_decodes_as_transformers.
"""

from __future__ import annotations

import json

from redraft.engines.vllm_driver import cpu_attention_backend, uses_mla


def _model(tmp_path, name, **config):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_float32_mla_target_or_drafter_on_cpu_gets_the_reference_kernels(tmp_path):
    mla = _model(tmp_path, "kimi", architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=512)
    llama = _model(tmp_path, "llama", architectures=["LlamaForCausalLM"], kv_lora_rank=None)
    wrapped = _model(tmp_path, "kimi-k25", architectures=["KimiK25ForConditionalGeneration"],
                     text_config={"kv_lora_rank": 512})  # Kimi-K2.5's own config nests the decoder's
    assert uses_mla(mla) and uses_mla(wrapped)
    assert not uses_mla(llama) and not uses_mla(None) and not uses_mla(str(tmp_path / "none"))
    assert cpu_attention_backend("float32", mla, on_cpu=True) == "CPU_MLA"  # a target or a drafter
    assert cpu_attention_backend("float32", llama, on_cpu=True) is None
    assert cpu_attention_backend("float32", None, on_cpu=True) is None
    assert cpu_attention_backend("bfloat16", mla, on_cpu=True) is None  # AMX takes bf16
    assert cpu_attention_backend("float32", mla, on_cpu=False) is None  # a GPU: vLLM's own choice
