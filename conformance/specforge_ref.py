"""SpecForge 0.2.0's own EAGLE-3 drafter code on given weights and inputs: the lane's numerics reference.

    SF_VENV/bin/python -m conformance.specforge_ref CKPT INPUTS.safetensors OUT.safetensors [--ttt K]
        [--layout raw|aligned] [--save-step-logits] [--threads N]
    SF_VENV/bin/python -m conformance.specforge_ref --check-import

Run from the repository root by the python of the venv ``conformance/make_venv.sh specforge`` builds;
``conformance/check_specforge.py`` compares our drafter with what this writes. Everything that
computes a number is SpecForge's: ``AutoDraftModelConfig.from_file`` + ``AutoDraftModel.from_config``
build ``LlamaForCausalLMEagle3`` (fp32, sdpa); step 0 runs its methods in training order
(``project_hidden_states``, ``embed_input_ids``, ``backbone``, ``compute_logits``); the TTT unroll is
``Eagle3TrainStrategy.forward_loss`` around ``OnlineEagle3Model(length=K)``, fed a ``TrainBatch``
as offline training feeds it. Per-step tensors are recorded by wrapping those methods on the
instances (the wrappers return what they were given back unchanged).

Inputs (INPUTS.safetensors): ``input_ids`` [B,T] int64, ``aux_hidden_states`` [B,T,3H] (low, mid,
high target layers), ``embed_weight`` [V,H] (the frozen target embedding: the checkpoint has none),
``loss_mask`` [B,T] 0/1, ``teacher_logprobs`` [B,T,V] (needed for the TTT; logits work as well),
optional ``attention_mask`` [B,T] (1 = real token, right padding only) and ``position_ids``.

Layouts: ``raw`` (default) is SpecForge's offline data path: each sample cut to its real length
goes through ``normalize_offline_sample`` (the last real token's loss mask zeroed), the batch is
zero right-padded by ``pad_and_concatenate_features``, and the strategy applies
``TargetHead.preprocess`` (ids and teacher shifted left by one). The "target head" here is the
identity, because the teacher is given over the full vocabulary already. ``aligned`` hands the
tensors to ``OnlineEagle3Model`` as they are.

Outputs (OUT.safetensors, fp32 unless noted; metadata: versions, layout, K, self-checks):
``logits_step0`` [B,T,Vd] (direct step 0, every position), ``fc_out`` [B,T,H], ``hidden_step0``,
the aligned ``input_ids_aligned`` / ``loss_mask_aligned`` / ``attention_mask`` / ``position_ids``;
with a teacher and K >= 1: ``ttt_ploss``, ``ttt_acc``, ``ttt_acceptance_rate``, ``ttt_weight`` [K],
``ttt_total_loss`` [], and per step and position [K,B,T] ``ttt_input_ids``, ``ttt_loss_mask``,
``ttt_position_mask``, ``ttt_target_token_ids``, ``ttt_pred_target_ids``, ``ttt_loss_per_position``;
with ``--save-step-logits`` also ``ttt_logits`` [K,B,T,Vd], ``ttt_target_p``, ``ttt_hidden``.

Stubs, and why (nothing SpecForge computes goes through them):
- ``triton``: ``specforge/core/loss.py`` imports ``triton`` and ``triton.language`` at module level
  for its GPU kernel ``LogSoftmaxLoss``. A stand-in (``jit``, ``next_power_of_2``,
  ``language.constexpr``) sits in ``sys.modules`` only while that one module is imported, then is
  removed and torch's cached "is triton there" answers are cleared. With a real triton, no stub.
- ``LogSoftmaxLoss`` is swapped for SpecForge's own eager reference in the same file,
  ``specforge.core.loss._compute_loss`` (the same quantity for a 0/1 mask; no kernel launches).
- ``torch.compile`` is disabled (``TORCHDYNAMO_DISABLE=1``, ``torch._dynamo.config.disable``): the
  compiled helpers (RMSNorm, RoPE, the target distribution, the loss) run eagerly, same maths,
  instead of JIT-compiling C++ on a CPU.
Exit: 0 written; 2 bad input or SpecForge not importable; 3 a self-check over 1e-5.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from redraft.core import cli as ending

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # before torch is imported anywhere

import torch  # noqa: E402

SPECFORGE_VERSION = "0.2.0"
DECAY = 0.8  # Eagle3TrainStrategy's default ploss_decay
SELF_CHECK_TOL = 1e-5
EMBED_PREFIXES = ("embed_tokens.", "model.embed_tokens.")


class InputError(ValueError):
    """Bad checkpoint or inputs: named by file and key (exit 2)."""


# ----------------------------------------------------------------------------- importing SpecForge


def _triton_stand_in() -> dict[str, types.ModuleType]:
    """The attributes specforge/core/loss.py touches at import time, and nothing else."""
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    language.constexpr = type("constexpr", (), {})  # only used as an annotation
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    triton.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    triton.language = language
    return {"triton": triton, "triton.language": language}


@contextlib.contextmanager
def _triton_for_one_import() -> Iterator[bool]:
    """Yields whether a stand-in was needed; afterwards torch again sees no triton."""
    try:
        importlib.import_module("triton")
        yield False
        return
    except ImportError:
        pass
    stubs = _triton_stand_in()
    sys.modules.update(stubs)
    try:
        yield True
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
        with contextlib.suppress(Exception):
            import torch.utils._triton as tt

            for fn in (getattr(tt, "has_triton", None), getattr(tt, "has_triton_package", None)):
                if fn is not None and hasattr(fn, "cache_clear"):
                    fn.cache_clear()


class _EagerLogSoftmaxLoss:
    """Stands in for the kernel's autograd Function: SpecForge's own reference ``_compute_loss``."""

    compute: Callable[..., torch.Tensor]

    @classmethod
    def apply(cls, logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
        return cls.compute(logits, target_p, position_mask)


def import_specforge() -> dict[str, Any]:
    """SpecForge's classes this reference runs, plus which stubs were used."""
    import torch._dynamo

    torch._dynamo.config.disable = True
    warnings.filterwarnings("ignore", message=".*flash_attn.*")
    try:
        with _triton_for_one_import() as stubbed:
            loss = importlib.import_module("specforge.core.loss")
        eagle3 = importlib.import_module("specforge.algorithms.eagle3.model")
        data = importlib.import_module("specforge.algorithms.eagle3.data")
        collation = importlib.import_module("specforge.algorithms.common.collation")
        strategies = importlib.import_module("specforge.training.strategies.base")
        contracts = importlib.import_module("specforge.runtime.contracts")
        target_head = importlib.import_module("specforge.modeling.target.target_head")
        auto = importlib.import_module("specforge.modeling.auto")
    except Exception as e:  # noqa: BLE001 - not installed, or moved in another version
        raise InputError(f"SpecForge is not importable here ({sys.executable}): {type(e).__name__}: {e}") from e
    _EagerLogSoftmaxLoss.compute = staticmethod(loss._compute_loss)
    eagle3.LogSoftmaxLoss = _EagerLogSoftmaxLoss
    import importlib.metadata as md

    return {
        "version": md.version("specforge"), "torch": torch.__version__, "transformers": md.version("transformers"),
        "stubs": ["triton (import of specforge.core.loss only)"] if stubbed else [],
        "OnlineEagle3Model": eagle3.OnlineEagle3Model, "normalize": data.normalize_offline_sample,
        "pad": collation.pad_and_concatenate_features, "Strategy": strategies.Eagle3TrainStrategy,
        "TrainBatch": contracts.TrainBatch, "TargetHead": target_head.TargetHead,
        "AutoDraftModel": auto.AutoDraftModel, "AutoDraftModelConfig": auto.AutoDraftModelConfig,
    }


# ----------------------------------------------------------------------------- the drafter


def load_drafter(sf: dict[str, Any], ckpt: Path, embed: torch.Tensor) -> torch.nn.Module:
    """SpecForge's drafter from CKPT/config.json, with CKPT's weights; strict like SpecForge's exporter."""
    from safetensors.torch import load_file

    cfg_file, weights = ckpt / "config.json", ckpt / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.is_file():
            raise InputError(f"{f}: no such file")
    with contextlib.redirect_stdout(sys.stderr):  # from_file prints about tie_word_embeddings
        config = sf["AutoDraftModelConfig"].from_file(str(cfg_file))
    model = sf["AutoDraftModel"].from_config(config, attention_backend="sdpa", torch_dtype=torch.float32)
    state = load_file(str(weights))
    own = model.state_dict()
    for key, t in state.items():
        if key not in own:
            raise InputError(f"{weights}: key {key!r} is not a parameter of SpecForge's {type(model).__name__}")
        if tuple(t.shape) != tuple(own[key].shape):
            raise InputError(f"{weights}: key {key!r} has shape {tuple(t.shape)}, SpecForge expects "
                             f"{tuple(own[key].shape)}")
    missing = [k for k in own if k not in state and not k.startswith(EMBED_PREFIXES)]
    if missing:
        raise InputError(f"{weights}: missing keys {missing}")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)
    if tuple(embed.shape) != tuple(model.embed_tokens.weight.shape):
        raise InputError(f"embed_weight has shape {tuple(embed.shape)}, the drafter's embedding is "
                         f"{tuple(model.embed_tokens.weight.shape)}")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed.float())
    return model.eval()


def step0(model: torch.nn.Module, ids: torch.Tensor, aux: torch.Tensor, attention_mask: torch.Tensor,
          position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One draft step through the drafter's own methods, in the order training calls them."""
    b, t = ids.shape
    with torch.no_grad():
        fc_out = model.project_hidden_states(aux)
        mask = model.prepare_decoder_attention_mask(attention_mask=attention_mask, hidden_states=fc_out,
                                                    batch_size=b, seq_length=t, past_key_values_length=0)
        hidden = model.backbone(input_embeds=model.embed_input_ids(ids).to(fc_out.dtype), hidden_states=fc_out,
                                cache_hidden=[[], []], attention_mask=mask, position_ids=position_ids,
                                past_key_values=None, use_cache=True)
        logits = model.compute_logits(hidden)
    return {"fc_out": fc_out, "hidden_step0": hidden, "logits_step0": logits}


# ----------------------------------------------------------------------------- the TTT unroll


class Recorder:
    """Wraps methods on instances to keep what each TTT step saw and produced (values untouched)."""

    def __init__(self) -> None:
        self.seen: dict[str, list[torch.Tensor]] = {}

    def keep(self, name: str, t: torch.Tensor) -> None:
        self.seen.setdefault(name, []).append(t.detach().clone())

    def wrap(self, obj: Any, method: str, before: Callable[..., None] | None = None,
             after: Callable[[Any], None] | None = None) -> None:
        original = getattr(obj, method)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if before:
                before(*args, **kwargs)
            out = original(*args, **kwargs)
            if after:
                after(out)
            return out

        setattr(obj, method, wrapped)

    def stacked(self, name: str) -> torch.Tensor:
        return torch.stack(self.seen[name])


def identity_head(sf: dict[str, Any]) -> torch.nn.Module:
    """SpecForge's TargetHead with its own ``preprocess`` (the shift) and an identity projection."""

    class IdentityTargetHead(sf["TargetHead"]):
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return hidden_states

    return IdentityTargetHead()


def raw_batch(sf: dict[str, Any], x: dict[str, torch.Tensor], real: torch.Tensor) -> dict[str, torch.Tensor]:
    """SpecForge's offline path per sample (normalise, then zero right-padding to the batch length)."""
    b, t = x["input_ids"].shape
    samples = []
    for i in range(b):
        n = int(real[i].sum())
        raw = {"aux_hidden_state": x["aux_hidden_states"][i: i + 1, :n], "hidden_state": x["teacher_logprobs"][i: i + 1, :n],
               "input_ids": x["input_ids"][i, :n], "loss_mask": x["loss_mask"][i, :n].long()}
        samples.append(sf["normalize"](raw, max_len=t))
    keys = ("input_ids", "attention_mask", "loss_mask", "target", "hidden_state")
    batch = sf["pad"](samples, sequence_axes={k: 1 for k in keys}, required_keys=keys)
    if batch["input_ids"].shape[1] != t:  # every sample shorter than T: pad to T like the caller's tensors
        batch = {k: torch.nn.functional.pad(v, (0, 0, 0, t - v.shape[1]) if v.dim() == 3 else (0, t - v.shape[1]))
                 for k, v in batch.items()}
    return batch


def run_ttt(sf: dict[str, Any], model: torch.nn.Module, x: dict[str, torch.Tensor], k: int, layout: str,
            real: torch.Tensor, position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """SpecForge's strategy forward over K steps, with every step's tensors recorded."""
    online = sf["OnlineEagle3Model"](model, length=k, attention_backend="sdpa")
    rec = Recorder()
    rec.wrap(model, "embed_input_ids", before=lambda ids: rec.keep("input_ids", ids))
    rec.wrap(model, "backbone", after=lambda out: rec.keep("hidden", out))
    rec.wrap(model, "compute_logits", after=lambda out: rec.keep("logits", out))

    def on_step(**kw: Any) -> None:
        for name in ("target_p", "target_token_ids", "position_mask", "loss_mask"):
            rec.keep(name, kw[name])

    rec.wrap(online, "_acc_and_loss", before=on_step)
    if layout == "raw":
        tensors = raw_batch(sf, x, real)
        head, meta = identity_head(sf), {"target_repr": "hidden_state"}
    else:
        tensors = {"input_ids": x["input_ids"], "attention_mask": real.long(), "loss_mask": x["loss_mask"].long()[..., None],
                   "target": x["teacher_logprobs"], "hidden_state": x["aux_hidden_states"]}
        head, meta = None, {}
    if position_ids is not None:
        tensors["position_ids"] = position_ids
    strategy = sf["Strategy"](online, target_head=head, ploss_decay=DECAY)
    batch = sf["TrainBatch"](sample_ids=[str(i) for i in range(x["input_ids"].shape[0])], strategy="eagle3",
                             tensors=tensors, metadata=meta)
    with torch.no_grad():
        out = strategy.forward_loss(batch)
    logits = rec.stacked("logits")
    target_p = rec.stacked("target_p")
    pmask = rec.stacked("position_mask").reshape(logits.shape[:3]).float()
    per_pos = -(pmask[..., None] * target_p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
    pred = logits.argmax(-1)
    res = {
        "ttt_ploss": torch.stack([p.float() for p in out.metrics["plosses"]]),
        "ttt_acc": torch.stack([a.float() for a in out.metrics["acces"]]),
        "ttt_acc_correct": torch.stack([c.float() for c in out.metrics["acc_corrects"]]),
        "ttt_acc_denom": torch.stack([d.float() for d in out.metrics["acc_denoms"]]),
        "ttt_acceptance_rate": torch.stack([a.float().reshape(()) for a in out.metrics["acceptance_rates"]]),
        "ttt_weight": torch.tensor([DECAY**i for i in range(k)]),
        "ttt_total_loss": out.loss.detach().float().reshape(()),
        "ttt_input_ids": rec.stacked("input_ids").long(),
        "ttt_loss_mask": rec.stacked("loss_mask").reshape(logits.shape[:3]).float(),
        "ttt_position_mask": pmask,
        "ttt_target_token_ids": rec.stacked("target_token_ids").long(),
        "ttt_pred_target_ids": (pred + model.d2t[pred]).long(),
        "ttt_loss_per_position": per_pos,
        "ttt_logits": logits.float(), "ttt_target_p": target_p.float(), "ttt_hidden": rec.stacked("hidden").float(),
    }
    return res


# ----------------------------------------------------------------------------- main


def read_inputs(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise InputError(f"{path}: no such file")
    x = load_file(str(path))
    for key in ("input_ids", "aux_hidden_states", "embed_weight", "loss_mask"):
        if key not in x:
            raise InputError(f"{path}: key {key!r} missing (have {sorted(x)})")
    b, t = x["input_ids"].shape
    for key, want in (("aux_hidden_states", (b, t)), ("loss_mask", (b, t)), ("teacher_logprobs", (b, t)),
                      ("attention_mask", (b, t)), ("position_ids", (b, t))):
        if key in x and tuple(x[key].shape[:2]) != want:
            raise InputError(f"{path}: key {key!r} has shape {tuple(x[key].shape)}, expected [{b}, {t}, ...]")
    x["input_ids"] = x["input_ids"].long()
    x["aux_hidden_states"] = x["aux_hidden_states"].float()
    if "teacher_logprobs" in x:
        x["teacher_logprobs"] = x["teacher_logprobs"].float()
    return x


def reference(a: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    sf = import_specforge()
    if sf["version"] != SPECFORGE_VERSION:
        print(f"[specforge_ref] WARNING: specforge {sf['version']}; the conventions were read from "
              f"{SPECFORGE_VERSION}", file=sys.stderr)
    x = read_inputs(Path(a.inputs))
    model = load_drafter(sf, Path(a.ckpt), x["embed_weight"])
    b, t = x["input_ids"].shape
    real = x.get("attention_mask", torch.ones(b, t, dtype=torch.int64)).long()
    position_ids = x.get("position_ids")
    out: dict[str, torch.Tensor] = {}
    checks: dict[str, float] = {}
    ttt = None
    if "teacher_logprobs" in x and a.ttt >= 1:
        ttt = run_ttt(sf, model, x, a.ttt, a.layout, real, position_ids)
        ids_aligned, lm_aligned = ttt["ttt_input_ids"][0].clone(), ttt["ttt_loss_mask"][0].clone()
    elif a.layout == "raw":  # step 0 alone: the same alignment as the TTT path, without a teacher
        ids_aligned = torch.cat([x["input_ids"][:, 1:], torch.zeros(b, 1, dtype=torch.int64)], dim=1)
        lm_aligned = x["loss_mask"].float()
    else:
        ids_aligned, lm_aligned = x["input_ids"], x["loss_mask"].float()
    attention = real  # the raw path's normaliser marks real tokens 1 and its padding adds zeros: the same
    positions = position_ids if position_ids is not None else torch.arange(t).repeat(b, 1)
    aux = x["aux_hidden_states"] * attention[..., None] if a.layout == "raw" else x["aux_hidden_states"]
    out.update(step0(model, ids_aligned, aux, attention, positions))
    out.update({"input_ids_aligned": ids_aligned, "loss_mask_aligned": lm_aligned, "attention_mask": attention,
                "position_ids": positions})
    if ttt is not None:
        checks["direct step 0 vs TTT step 0 (max |dlogits|)"] = float(
            (ttt["ttt_logits"][0] - out["logits_step0"]).abs().max())
        checks["mean per-position loss vs ttt_ploss (max |d|)"] = float(
            (ttt["ttt_loss_per_position"].mean(dim=(1, 2)) - ttt["ttt_ploss"]).abs().max())
        keep = ttt if a.save_step_logits else {k: v for k, v in ttt.items()
                                                if k not in ("ttt_logits", "ttt_target_p", "ttt_hidden")}
        out.update(keep)
    meta = {"specforge": sf["version"], "torch": sf["torch"], "transformers": sf["transformers"],
            "stubs": json.dumps(sf["stubs"]), "layout": a.layout, "ttt": str(a.ttt if ttt is not None else 0),
            "checks": json.dumps(checks)}
    save_file({k: v.contiguous() for k, v in out.items()}, str(a.out), metadata=meta)
    worst = max(checks.values(), default=0.0)
    print(f"[specforge_ref] {a.out}: B={b} T={t} K={a.ttt if ttt is not None else 0} layout={a.layout}; "
          f"self-checks {json.dumps(checks)}")
    if worst > SELF_CHECK_TOL:
        print(f"[specforge_ref] a self-check is over {SELF_CHECK_TOL}: {worst:.2e}", file=sys.stderr)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.specforge_ref", description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", nargs="?", help="drafter folder in SpecForge's layout (config.json, model.safetensors)")
    p.add_argument("inputs", nargs="?", help="INPUTS.safetensors")
    p.add_argument("out", nargs="?", help="OUT.safetensors")
    p.add_argument("--ttt", type=int, default=7, help="TTT steps K (default 7, SpecForge's training.ttt_length)")
    p.add_argument("--layout", choices=("raw", "aligned"), default="raw")
    p.add_argument("--save-step-logits", action="store_true", help="also write every step's logits, target, hidden")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: deterministic sums)")
    p.add_argument("--check-import", action="store_true", help="import SpecForge with the stubs, print versions")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, a.threads))
    try:
        if a.check_import:
            sf = import_specforge()
            print(f"[make_venv] specforge {sf['version']} | torch {sf['torch']} | transformers {sf['transformers']} | "
                  f"stubs: {', '.join(sf['stubs']) or 'none'} | dynamo disabled: {torch._dynamo.config.disable}")
            return 0
        if not (a.ckpt and a.inputs and a.out):
            p.error("CKPT, INPUTS and OUT are required (or --check-import)")
        return reference(a)
    except InputError as e:
        print(f"[specforge_ref] ERROR: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("conformance.specforge_ref")))
