"""Export a drafter to a folder SGLang or vLLM loads as is: ``python -m eval.export CKPT OUT --format sglang``.

CKPT is a redraft step folder, a run folder (its ``latest`` is followed), or a foreign SGLang /
SpecForge drafter folder (config.json + model.safetensors), which is imported. OUT gets
``config.json`` (the engine's layer-id convention, see ``redraft.core.drafter.serving_format``),
``model.safetensors`` with exactly the serving table's keys, ``redraft.json`` (provenance and
the DrafterConfig, so ``train --init-from`` and ``eval.acceptance`` read OUT back exactly) and
a short ``README.md``. The weights are checked against the table *before* anything is written,
because SGLang would load a misnamed key as uninitialised memory without a word. OUT is
written under a temporary name and renamed when complete.

Afterwards the serving command is printed, with ``--max-running-requests`` and
``--cuda-graph-max-bs`` explicit: without them SGLang caps speculative serving at 48
concurrent requests. ``--verify-with sglang|vllm`` then loads OUT with that engine's own loader
(installed in this environment; see ``eval.verify_engine``) and fails on anything left unloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from redraft.core import cli as ending
from redraft.core import options
from redraft.core.config import ConfigError
from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.folder import (
    REDRAFT_RECORD,
    WEIGHTS_NAME,
    CheckpointError,
    load_drafter_checkpoint,
    read_record,
    resolve_drafter_folder,
)
from redraft.core.drafter.kinds import build_drafter
from redraft.core.drafter.names import EMBED_KEY
from redraft.core.drafter.rope import engine_rope_deviations
from redraft.core.drafter.serving_format import (
    FORMATS,
    ServingFormatError,
    check_serving_state,
    engine_layer_ids,
    serving_config,
    torch_dtype_of,
)
from redraft.core.errors import UserError
from redraft.core.layers import to_engine_layer_ids, versions_reading
from redraft.core.options import option
from redraft.core.target_weights import text_config, weight_key_candidates
from redraft.engines.launch import (  # noqa: F401
    CAP_NOTE,
    LaunchError,
    LaunchPlan,
    launch_command,
    sglang_command,
    vllm_command,
)

log = logging.getLogger(__name__)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

class ExportError(UserError):
    """An export that cannot be done as asked (bad input folder, OUT in the way, bad serving flags)."""


# ----------------------------------------------------------------------------- inputs


@dataclass
class ExportConfig:
    """Everything one export needs (the CLI maps onto it one to one)."""

    ckpt: str
    out: str
    format: str
    with_embedding: bool = False
    target: str | None = None  # target model folder; default: the training record / dataset manifest
    dtype: str | None = None  # bf16|fp16|fp32; None: what the checkpoint advertises (DrafterConfig.torch_dtype)
    target_architecture: str | None = None  # foreign inputs only (default: from --target's config.json)
    target_num_layers: int | None = None  # foreign inputs only (default: from --target's config.json)
    max_position_embeddings: int | None = None  # None: the DrafterConfig's (the target's context length)
    force: bool = False
    launch: LaunchPlan = field(default_factory=LaunchPlan)
    verify_with: str | None = None  # sglang|vllm: load OUT with that engine installed here (eval.verify_engine)


@dataclass
class ExportResult:
    out: Path
    source: Path
    config: DrafterConfig
    command: str


def resolve_checkpoint(path: str | Path) -> Path:
    """The drafter folder CKPT names: itself, ``CKPT/latest``'s step folder, or the newest ``step-*``."""
    try:
        return resolve_drafter_folder(path)
    except CheckpointError as e:
        raise ExportError(str(e)) from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: unreadable: {e}") from e
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object")
    return data


def _target_facts(target: Path | None) -> dict[str, Any]:
    """architecture, num_layers, context length, trust_remote_code need and raw config of a target folder."""
    if target is None or not (target / "config.json").is_file():
        return {}
    raw = _read_json(target / "config.json")
    text = text_config(raw)  # Kimi-K2.5 nests it
    return {
        "architecture": (raw.get("architectures") or [None])[0],
        "num_layers": text.get("num_hidden_layers"),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "remote_code": "auto_map" in raw,
        "config": raw,
    }


def _from_record(record: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(target path, embedding key) the training run used, via its train config or dataset manifest."""
    path = (record.get("train_config") or {}).get("target_path") or record.get("target_path") or None
    embed_key = record.get("embed_key")
    data = (record.get("dataset") or {}).get("path")
    if data:
        from redraft.core.dataset.format import DatasetError, load_manifest

        try:
            target = load_manifest(Path(data)).get("target") or {}
            path = path or target.get("path")
            embed_key = embed_key or target.get("embed_key")
        except (DatasetError, OSError) as e:
            log.info("dataset %s of the training record is not readable here (%s)", data, e)
    return path, embed_key


def read_target_embedding(cfg: DrafterConfig, target: Path, candidates: list[str], dtype: torch.dtype) -> torch.Tensor:
    """The target's input embedding [V, H] through the drafter's load_target_embedding (shape-checked).

    The drafter is built on the meta device so only the embedding is ever allocated (without rope
    scaling, whose init functions need real tensors; the embedding does not depend on it).
    """
    with torch.device("meta"):
        drafter = build_drafter(replace(cfg, rope_scaling=None))
    weight = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
    drafter.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight, _freeze=True)
    drafter.load_target_embedding(target, candidates)
    return drafter.embed_tokens.weight.detach()


# ----------------------------------------------------------------------------- writing


def _check_out(out: Path, source: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out}: exists and is not empty (pass --force to replace it)")
    o, s = out.resolve(), source.resolve()
    if o == s or o in s.parents:
        raise ExportError(f"{out}: would replace the checkpoint being exported ({source})")


def _readme(fmt: str, source: Path, cfg: DrafterConfig, config: Mapping[str, Any], command: str) -> str:
    ids = engine_layer_ids(config)
    kind = {"eagle3": "EAGLE-3", "eagle3.1": "EAGLE-3.1", "p-eagle": "P-EAGLE", "dflash": "DFlash"}[cfg.method]
    return (
        f"# {kind} drafter ({fmt} format)\n\n"
        f"Exported by `python -m eval.export` from `{source}`.\n\n"
        f"- target: {cfg.target_architecture}, {cfg.target_num_layers} layers, vocab {cfg.vocab_size}, "
        f"context {config['max_position_embeddings']}\n"
        f"- drafter: {config['architectures'][0]} (attention {cfg.attention}), hidden {cfg.hidden_size}, "
        f"draft vocab {cfg.draft_vocab_size}, dtype {config['torch_dtype']}, "
        f"{cfg.kv_cache_bytes_per_token()} bytes of draft KV cache per token in bf16\n"
        f"- aux layers: redraft ids {cfg.aux_layer_ids} (output of decoder layer i) = {fmt} config ids {ids}; "
        "the ids are engine-specific, so serve this folder with the engine it was exported for\n"
        f"- provenance: `{REDRAFT_RECORD}`\n\n"
        f"Serve:\n\n```bash\n{command}\n```\n"
    )


def _write_folder(tmp: Path, state: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                  record: Mapping[str, Any], readme: str) -> None:
    tmp.mkdir(parents=True)
    weights = tmp / WEIGHTS_NAME
    save_file(dict(state), str(weights), metadata={"format": "pt"})
    sha = hashlib.sha256()
    with open(weights, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            sha.update(chunk)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (tmp / REDRAFT_RECORD).write_text(
        json.dumps({**record, "weights_sha256": sha.hexdigest()}, indent=2, sort_keys=True) + "\n"
    )
    (tmp / "README.md").write_text(readme)


def _install(tmp: Path, out: Path) -> None:
    """Rename the finished temp folder to OUT, replacing an existing OUT only after the new one is complete."""
    old = None
    if out.exists():
        old = out.with_name(f".old-{out.name}.{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- export


def _load_source(
    ecfg: ExportConfig, source: Path, target: Path | None, record: Mapping[str, Any]
) -> tuple[DrafterConfig, dict]:
    """(DrafterConfig, weights) of our checkpoint (``record``: its redraft.json) or of a foreign folder ({})."""
    arch, layers = ecfg.target_architecture, ecfg.target_num_layers
    if not record:
        facts = _target_facts(target)
        arch = arch or facts.get("architecture")
        layers = layers or facts.get("num_layers")
        if arch is None or layers is None:
            raise ExportError(
                f"{source}: a foreign drafter folder (no {REDRAFT_RECORD}); its layer ids can only be read for a "
                "known target: pass --target TARGET_FOLDER, or --target-architecture and --target-num-layers"
            )
    try:
        cfg, state = load_drafter_checkpoint(source, target_architecture=arch, target_num_layers=layers)
    except CheckpointError as e:
        raise ExportError(str(e)) from e
    return cfg, state


def _warn_about_the_pairing(cfg: DrafterConfig, facts: Mapping[str, Any]) -> None:
    """vLLM CPU pairs a drafter only with a target of its own attention kind (its MLA and dense attention
    backends share no KV block size); GPU backends serve either pairing."""
    config = facts.get("config")
    if not config:
        return
    target_mla = text_config(config).get("kv_lora_rank") is not None
    if target_mla != (cfg.attention == "mla"):
        log.warning("a %s drafter on a%s target: GPU engines serve the pair, vLLM CPU refuses it (\"No common block "
                    "size\": its MLA and dense attention backends share no KV block size)",
                    cfg.attention, "n MLA" if target_mla else " non-MLA")


def export_checkpoint(ecfg: ExportConfig) -> ExportResult:
    """Check, convert and write one drafter folder; nothing is left at OUT when any step fails."""
    if ecfg.format not in FORMATS:
        raise ExportError(f"--format {ecfg.format!r}: expected one of {FORMATS}")
    try:
        plan = ecfg.launch.resolved()
    except LaunchError as e:
        raise ExportError(str(e)) from None
    source = resolve_checkpoint(ecfg.ckpt)
    out = Path(ecfg.out)
    _check_out(out, source, ecfg.force)

    try:
        record = read_record(source) or {}
    except CheckpointError as e:
        raise ExportError(str(e)) from e
    rec_target, embed_key = _from_record(record) if record else (None, None)
    target_str = ecfg.target or rec_target
    target = Path(target_str) if target_str and Path(target_str).is_dir() else None
    if target_str and target is None:
        log.warning("target folder %s is not present here; it is named in the command only", target_str)
    cfg, state = _load_source(ecfg, source, target, record)

    dtype_name = DTYPES[ecfg.dtype] if ecfg.dtype else cfg.torch_dtype
    dtype = torch_dtype_of(dtype_name)
    updates: dict[str, Any] = {"torch_dtype": dtype_name}
    if ecfg.max_position_embeddings:
        updates["max_position_embeddings"] = int(ecfg.max_position_embeddings)
    cfg = DrafterConfig.from_dict({**cfg.to_dict(), **updates})
    rope_deviation = engine_rope_deviations(cfg).get(ecfg.format)
    if rope_deviation:
        others = [f for f in FORMATS if f != ecfg.format and f not in engine_rope_deviations(cfg)]
        raise ExportError(f"--format {ecfg.format}: {rope_deviation}. The engine would serve the drafter with another "
                          "rope than it trained with (a silent fall in acceptance)"
                          + (f"; --format {others[0]} serves it as trained" if others else ""))
    facts = _target_facts(target)
    context = facts.get("max_position_embeddings")
    if context and int(context) > cfg.max_position_embeddings:
        log.warning(
            "drafter max_position_embeddings %d < the target's %d: SGLang refuses to start unless "
            "--context-length <= %d or SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1; re-export with "
            "--max-position-embeddings %d", cfg.max_position_embeddings, context, cfg.max_position_embeddings, context)

    _warn_about_the_pairing(cfg, facts)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    if ecfg.with_embedding:
        if target is None:
            raise ExportError(
                "--with-embedding needs the target's weights: pass --target TARGET_FOLDER "
                f"(the training record names {rec_target!r})"
            )
        candidates = [embed_key] if embed_key else []
        candidates += [k for k in weight_key_candidates(facts["config"])[0] if k not in candidates]
        try:
            state[EMBED_KEY] = read_target_embedding(cfg, target, candidates, dtype).contiguous()
        except (KeyError, ValueError) as e:
            raise ExportError(f"--with-embedding: {e}") from e
    try:
        check_serving_state(state, cfg, ecfg.format, ecfg.with_embedding, dtype=dtype)
    except ServingFormatError as e:
        raise ExportError(f"{source}: {e}") from e

    config = serving_config(cfg, engine=ecfg.format, torch_dtype=dtype_name)
    plan = replace(plan, trust_remote_code=plan.trust_remote_code or bool(facts.get("remote_code")),
                   method=cfg.method)
    try:
        command = launch_command(ecfg.format, target_str or "<TARGET>", str(out.resolve()), plan)
    except LaunchError as e:
        raise ExportError(str(e)) from None
    checked = versions_reading(engine_layer_ids(config), ecfg.format, cfg.target_architecture, cfg.aux_layer_ids)
    if not all(checked.values()):
        log.warning("%s versions %s capture other layers than the drafter was trained on for ids %s (serve %s)",
                    ecfg.format, [v for v, ok in checked.items() if not ok], engine_layer_ids(config),
                    [v for v, ok in checked.items() if ok])
    export_record = {
        "format": "redraft-export",
        "serving_format": ecfg.format,
        "dtype": dtype_name,
        "with_embedding": ecfg.with_embedding,
        "source": str(source.resolve()),
        "source_format": record.get("format", "foreign (SGLang/SpecForge layout)"),
        "source_step": record.get("step"),
        "dataset": record.get("dataset"),
        "target_path": target_str,
        "engine_layer_ids": engine_layer_ids(config),
        # which engine versions capture the trained layers for these ids (redraft.core.layers: each version's rule)
        "layer_ids_checked_for": checked,
        "command": command,
        "drafter": cfg.to_dict(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}.{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        _write_folder(tmp, state, config, export_record, _readme(ecfg.format, source, cfg, config, command))
        _install(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    ids = to_engine_layer_ids(cfg.aux_layer_ids, ecfg.format, cfg.target_architecture, cfg.target_num_layers)
    log.info("exported %s -> %s (%s format, %s, %d tensors, engine layer ids %s)",
             source, out, ecfg.format, dtype_name, len(state), ids)
    return ExportResult(out=out, source=source, config=cfg, command=command)


# ----------------------------------------------------------------------------- CLI


@dataclass(kw_only=True)
class ExportOptions:
    """The options of python -m eval.export (redraft.core.options); ``export_config`` maps them onto an ExportConfig."""

    ckpt: str = option(help="a redraft step-* folder, a run folder (its 'latest' is followed, else the newest "
                            "step-*), or a foreign SGLang/SpecForge drafter folder (config.json + model.safetensors)",
                       group="inputs", positional=True, metavar="CKPT")
    out: str = option(help="folder to write (written under a temporary name, then renamed)", group="output",
                      positional=True, metavar="OUT")
    format: str = option(help="serving engine: decides the aux layer ids in config.json (they differ between "
                              "engines for Llama-family targets), so serve OUT with this engine only",
                         group="output", choices=FORMATS)
    with_embedding: bool = option(False, "also write embed_tokens.weight read from the target (a standalone HF "
                                         "folder); serving engines take the target's embedding anyway, so the "
                                         "default leaves it out", group="output")
    target: str | None = option(None, "target model folder: the embedding for --with-embedding, the --model-path of "
                                      "the printed command, and the architecture/layer count of foreign inputs "
                                      "(default: the training record's target_path, else the dataset manifest's "
                                      "target.path)", group="inputs", metavar="PATH")
    dtype: str | None = option(None, "float dtype of the written weights (default: the checkpoint's torch_dtype; "
                                     "use fp32 for a bit-exact copy of fp32 training weights)", group="output",
                               choices=sorted(DTYPES))
    max_position_embeddings: int | None = option(None, "override the drafter's max_position_embeddings (default: "
                                                       "the target's context length as recorded at training); "
                                                       "SGLang refuses a drafter shorter than its target",
                                                 group="output", metavar="N")
    target_architecture: str | None = option(None, "target architecture, e.g. KimiK25ForConditionalGeneration or "
                                                   "LlamaForCausalLM: how the config's layer ids are read (default: "
                                                   "from --target's config.json)",
                                             group="foreign inputs (no redraft.json)", metavar="A")
    target_num_layers: int | None = option(None, "target decoder layers, for SGLang's default ids when the config "
                                                 "names none (default: from --target's config.json)",
                                           group="foreign inputs (no redraft.json)", metavar="L")
    steps: int = option(3, "--speculative-num-steps / vLLM num_speculative_tokens", group="printed serving command",
                        metavar="S")
    topk: int = option(1, "--speculative-eagle-topk (1: chain drafting)", group="printed serving command",
                       metavar="K")
    num_draft_tokens: int | None = option(None, "--speculative-num-draft-tokens; with --topk 1 SGLang forces "
                                                "steps + 1 (the default), with --topk > 1 it is required",
                                          group="printed serving command", metavar="N")
    tp: int = option(1, "tensor parallel size (Kimi-K2.5 needs 8)", group="printed serving command", metavar="T")
    max_running_requests: int = option(128, "concurrent requests; always explicit because SGLang otherwise caps "
                                            "speculative serving at 48", group="printed serving command",
                                       metavar="R")
    cuda_graph_max_bs: int | None = option(None, "largest CUDA-graph batch (default: --max-running-requests)",
                                           group="printed serving command", metavar="B")
    trust_remote_code: bool = option(False, "add --trust-remote-code (added anyway when the target's config.json "
                                            "has auto_map)", group="printed serving command")
    force: bool = option(False, "replace an existing non-empty OUT", group="output")
    verify_with: str | None = option(None, "after writing OUT, load it with this engine's own loader (sglang or "
                                           "vllm, installed in this environment) and fail on any parameter left "
                                           "unwritten or key ignored", group="output", choices=FORMATS,
                                     metavar="ENGINE")
    quiet: bool = option(False, "log warnings only", group="output", short="-q")


PROG = "python -m eval.export"
DESCRIPTION = ("Export a drafter checkpoint to a folder SGLang or vLLM loads as is, and print the serving command. "
               "Also imports a foreign SGLang/SpecForge drafter folder.")
EPILOG = ("Example: python -m eval.export runs/demo OUT/drafter-sglang --format sglang --tp 8 "
          "--max-running-requests 256")


def parse_options(argv: Sequence[str] | None) -> ExportOptions:
    """The command line (and its --config YAML) as ExportOptions (redraft.core.options)."""
    return options.parse(ExportOptions, argv, prog=PROG, description=DESCRIPTION, epilog=EPILOG, section="export")


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(ExportOptions, prog=PROG, description=DESCRIPTION, epilog=EPILOG)


def export_config(a: ExportOptions) -> ExportConfig:
    """The parsed options as one export's ExportConfig."""
    plan = LaunchPlan(steps=a.steps, topk=a.topk, num_draft_tokens=a.num_draft_tokens, tp=a.tp,
                      max_running_requests=a.max_running_requests, cuda_graph_max_bs=a.cuda_graph_max_bs,
                      trust_remote_code=a.trust_remote_code)
    return ExportConfig(ckpt=a.ckpt, out=a.out, format=a.format, with_embedding=a.with_embedding, target=a.target,
                        dtype=a.dtype, target_architecture=a.target_architecture,
                        target_num_layers=a.target_num_layers, max_position_embeddings=a.max_position_embeddings,
                        force=a.force, launch=plan, verify_with=a.verify_with)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts = parse_options(argv)
        ecfg = export_config(opts)
    except ConfigError as e:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        log.error("%s", e)
        return 2
    ending.configure_logging(logging.WARNING if opts.quiet else logging.INFO,
                             "%(levelname)s %(name)s: %(message)s")
    try:
        result = export_checkpoint(ecfg)
    except (ExportError, ServingFormatError) as e:  # the input's fault, named by file and key
        log.error("%s", e)
        return 2
    print(f"# serve {result.out} ({ecfg.format}):")
    print(result.command)
    if ecfg.verify_with:
        if ecfg.verify_with != ecfg.format:
            log.warning("--verify-with %s on a %s export: loading is checked, but serve it with %s",
                        ecfg.verify_with, ecfg.format, ecfg.format)
        return verify_in_engine(result.out, ecfg.verify_with)
    return 0


def verify_in_engine(folder: Path, engine: str) -> int:
    """``python -m eval.verify_engine FOLDER --engine ENGINE`` as its own process (an engine's globals stay out of
    this one), its report printed here; its exit code (0 PASS, 1 FAIL, 2 could not run)."""
    proc = subprocess.run([sys.executable, "-m", "eval.verify_engine", str(folder), "--engine", engine],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    print(proc.stdout, end="")
    return proc.returncode


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as redraft.core.cli ends every command (one line and exit 2 on a mistake)."""
    return ending.run(lambda: main(argv), logging.getLogger("eval.export"))


if __name__ == "__main__":
    sys.exit(cli())
