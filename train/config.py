"""Every training option in one dataclass, loaded from YAML plus ``--key value`` overrides.

The dataclass is the single source of truth: YAML keys and CLI flags are its field names, and
``--help`` is generated from each field's help text, so an option cannot exist in one place and
be missing from another. Unknown keys are refused because a typo'd option silently falling back
to its default is the most expensive kind of training bug.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.config import ConfigError, read_yaml_mapping  # one error type and YAML reader for every stage


def _f(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Options of ``train/main.py`` (YAML keys and ``--flags`` share these names)."""

    # --- data and output
    data: str = _f("", "dataset folder written by `python -m extract` (holds manifest.json)")
    out: str = _f("", "output folder: step-XXXXXXX checkpoints, `latest`, metrics.jsonl")
    seed: int = _f(0, "seed for drafter init, data order and the train/val split")
    val_fraction: float = _f(0.02, "fraction of samples held out for validation (by a hash of the sample id)")
    val_max_samples: int = _f(512, "cap on held-out samples (the ones with the smallest hash are kept)")
    max_length: int = _f(0, "truncate samples to this many tokens (0: keep the dataset's lengths)")
    tokens_per_batch: int = _f(
        8192, "length-bucketed micro-batches hold up to this many padded tokens per rank (0: no token cap)"
    )
    micro_batch_size: int = _f(0, "cap on samples per micro-batch per rank (0: no cap; tokens_per_batch decides)")
    mega_batch_samples: int = _f(
        512, "samples shuffled together then sorted by length to form batches (bigger: less padding)"
    )
    num_workers: int = _f(0, "DataLoader worker processes per rank")
    data_order: str = _f(
        "global",
        "global (the whole dataset shuffled per epoch; a held-out split by id) or stream (shards in index order, "
        "stream_group_shards at a time shuffled together: the order a --stream run trains in, also on a finished "
        "dataset; the draft vocabulary from the first group's tokens; no held-out split; with max_steps 0 the "
        "schedule's length is estimated from the first group)",
        choices=("global", "stream"),
    )
    stream: bool = _f(
        False, "train on the shards of `data` as extraction lands them (extract --window-bytes/--window-shards on "
        "the same folder), waiting for each group; ends when every planned shard is trained; implies "
        "data_order=stream"
    )
    stream_group_shards: int = _f(4, "data_order=stream: shards shuffled together (the shuffle buffer)")
    stream_keep: bool = _f(
        False, "--stream: keep the shards once trained (for later epochs) instead of deleting them behind each "
        "checkpoint"
    )
    stream_poll_s: float = _f(2.0, "--stream: seconds between looks for newly landed shards")
    teacher: str = _f(
        "auto",
        "teacher signal: topk (stored top-k logprobs), last_hidden (re-apply the target lm_head), "
        "auto (topk when stored, else last_hidden)",
        choices=("auto", "topk", "last_hidden"),
    )
    teacher_chunk_tokens: int = _f(1024, "last_hidden teacher: tokens per lm_head chunk (bounds memory)")
    target_path: str = _f("", "target model folder (embedding / lm_head weights); default: manifest target.path")

    # --- optimisation
    lr: float = _f(1e-4, "peak learning rate (AdamW)")
    min_lr_ratio: float = _f(0.0, "cosine floor as a fraction of lr")
    warmup_ratio: float = _f(0.015, "linear warmup length as a fraction of the total optimizer steps")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    betas: tuple[float, float] = _f((0.9, 0.95), "AdamW betas, e.g. `--betas 0.9,0.95`")
    adam_eps: float = _f(1e-8, "AdamW epsilon")
    max_grad_norm: float = _f(0.5, "gradient clipping norm (DeepSpeed reads it into its config)")
    max_steps: int = _f(0, "optimizer steps to run (0: num_epochs over the train split)")
    num_epochs: int = _f(1, "epochs over the train split when max_steps is 0")
    stop_at_step: int = _f(
        0, "save and exit at this step without changing the schedule (time-limited jobs; resume later; 0: off)"
    )
    grad_accum: int = _f(1, "micro-batches per optimizer step")
    ttt_steps: int = _f(7, "training-time test (TTT) unroll length K: draft steps trained per position")
    ttt_decay: float = _f(0.8, "loss weight of TTT step k is decay**k")
    dtype: str = _f(
        "bf16",
        "compute dtype: bf16 (autocast, or DeepSpeed bf16 with fp32 master weights) or fp32",
        choices=("bf16", "fp32"),
    )

    # --- drafter
    draft_vocab_size: int = _f(32000, "draft vocabulary size (most frequent loss-masked target tokens)")
    init_from: str = _f(
        "", "warm-start from this drafter folder (SGLang/SpecForge layout or a redraft checkpoint); a resumed run "
        "restores its own checkpoint instead"
    )
    warm_start_vocab: str = _f(
        "rebuild",
        "with init_from: rebuild (the draft vocabulary from this data as a scratch run does, with draft_vocab_size "
        "tokens; old lm_head rows move to the tokens both vocabularies share, new tokens get the scratch init) or "
        "keep (the old drafter's vocabulary and lm_head as they are; needs the same draft_vocab_size)",
        choices=("rebuild", "keep"),
    )
    drafter_attention: str = _f(
        "gqa",
        "drafter attention: gqa (Llama-style, served as LlamaForCausalLMEagle3) or mla (DeepSeek multi-head latent "
        "attention, served as Eagle3DeepseekV2ForCausalLM; sizes from an MLA target such as Kimi-K2.5, else "
        "DeepSeek-V3's); with init_from it must be the init drafter's kind",
        choices=("gqa", "mla"),
    )
    attention_impl: str = _f(
        "eager",
        "the TTT attention kernel: eager (blocked, hand-written backward; the CPU default and the reference), sdpa "
        "(torch SDPA with the TTT mask as a boolean tensor) or flex (FlexAttention with the TTT block mask, "
        "compiled: the fused GPU path; CUDA only). Same math, held equal in tests",
        choices=("eager", "sdpa", "flex"),
    )
    hidden_size: int | None = _f(None, "drafter hidden size (default: the target's)")
    num_attention_heads: int | None = _f(None, "drafter attention heads (default: the target's)")
    num_key_value_heads: int | None = _f(None, "drafter KV heads (default: the target's)")
    head_dim: int | None = _f(None, "drafter head dim (default: the target's, or hidden/heads)")
    intermediate_size: int | None = _f(None, "drafter MLP size (default: the target's dense MLP size)")
    max_position_embeddings: int | None = _f(None, "drafter max positions (default: the target's)")
    rope_theta: float | None = _f(None, "drafter RoPE base (default: the target's)")
    q_lora_rank: int | None = _f(None, "MLA drafter: rank of the q down-projection (default: the target's, else 1536)")
    kv_lora_rank: int | None = _f(
        None, "MLA drafter: rank of the kv latent (default: the target's, else 512; the engines' MLA kernels serve 512)"
    )
    qk_nope_head_dim: int | None = _f(None, "MLA drafter: per-head q/k dims without rope (default: the target's, else 128)")
    qk_rope_head_dim: int | None = _f(
        None, "MLA drafter: per-head q/k rope dims, one rope key shared by all heads (default: the target's, else 64)"
    )
    v_head_dim: int | None = _f(None, "MLA drafter: per-head value dims (default: the target's, else 128)")

    # --- checkpoints, evaluation, logging
    save_every: int = _f(500, "save a checkpoint every N optimizer steps (and always at the end; 0: end only)")
    keep_last: int = _f(3, "keep only the newest N checkpoints (0: keep all)")
    resume: str = _f("none", "none | auto (newest complete checkpoint under out/) | a checkpoint folder")
    eval_every: int = _f(500, "validate on the held-out split every N steps (and at the end; 0: end only)")
    log_every: int = _f(10, "write a metrics.jsonl row every N optimizer steps")
    report_to: str = _f("none", "also log to wandb (respects WANDB_MODE)", choices=("none", "wandb"))
    wandb_project: str = _f("redraft", "wandb project")
    run_name: str = _f("", "wandb run name (default: the out folder's name)")
    log_sample_ids: bool = _f(False, "each rank appends the sample ids it trains on to out/sample_ids/rank-R.jsonl")

    def validate(self) -> None:
        """Reject impossible settings before any process group or model exists."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f"{f.name}={getattr(self, f.name)!r} is not one of {choices}")
        if self.attention_impl == "flex":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("attention_impl=flex: FlexAttention trains on CUDA only (no backward on a CPU); "
                                  "use eager (the default) or sdpa here")
        if not self.data:
            raise ConfigError("data is required (dataset folder with manifest.json): pass --data DIR")
        if not self.out:
            raise ConfigError("out is required (output folder): pass --out DIR")
        if self.tokens_per_batch <= 0 and self.micro_batch_size <= 0:
            raise ConfigError("set tokens_per_batch > 0 or micro_batch_size > 0 (both are 0: batches unbounded)")
        if self.stream:
            self.data_order = "stream"
        positive = ("grad_accum", "ttt_steps", "draft_vocab_size", "log_every", "mega_batch_samples",
                    "stream_group_shards")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps <= 0 and self.num_epochs <= 0:
            raise ConfigError("set max_steps > 0 or num_epochs > 0")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        self._check_drafter_attention()
        if self.resume not in ("none", "auto") and not Path(self.resume).is_dir():
            raise ConfigError(f"resume={self.resume!r}: expected none, auto or an existing checkpoint folder")

    def _check_drafter_attention(self) -> None:
        """Sizes of the other attention kind are refused by key, before any process group or model exists."""
        from core.drafter.config import MLA_FIELDS

        if self.drafter_attention == "gqa":
            given = [name for name in MLA_FIELDS if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"{given[0]}={getattr(self, given[0])} is an MLA size but drafter_attention is gqa; "
                                  "set drafter_attention: mla, or drop the key")
        else:
            given = [name for name in ("num_key_value_heads", "head_dim") if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"{given[0]}={getattr(self, given[0])} is a GQA size but drafter_attention is mla "
                                  f"(an MLA drafter's keys are set by {', '.join(MLA_FIELDS)}); drop the key")
        for name in MLA_FIELDS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


_HINTS = typing.get_type_hints(TrainConfig)
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}: expected a boolean (true/false), got {value!r}")


def coerce(key: str, value: Any) -> Any:
    """Turn a YAML value or a CLI string into the field's declared type, or say why not."""
    if key not in FIELDS:
        raise ConfigError(f"unknown option {key!r}; valid options: {', '.join(FIELDS)}")
    hint = _HINTS[key]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
            return None
        hint = next(a for a in args if a is not type(None))
    try:
        if hint is bool:
            return _parse_bool(key, value)
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if hint is str:
            if isinstance(value, (dict, list)):
                raise ValueError(value)
            return str(value)
        if typing.get_origin(hint) is tuple:
            items = value.split(",") if isinstance(value, str) else list(value)
            elem = typing.get_args(hint)
            if len(items) != len(elem):
                raise ValueError(value)
            return tuple(t(x) for t, x in zip(elem, items, strict=True))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: cannot parse {value!r} as {hint}") from e
    raise ConfigError(f"{key}: unsupported field type {hint}")


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``['--max-steps', '10', '--lr=1e-3', '--log_sample_ids']`` -> {field: raw value}.

    Dashes and underscores are interchangeable; a flag followed by another flag (or nothing) means true.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(overrides):
        tok = overrides[i]
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(f"expected --key value, got {tok!r} (at argument {i + 1})")
        key, eq, val = tok[2:].partition("=")
        key = key.replace("-", "_")
        if key not in FIELDS:
            raise ConfigError(f"unknown option --{tok[2:].partition('=')[0]}; valid options: {', '.join(FIELDS)}")
        if not eq:
            nxt = overrides[i + 1] if i + 1 < len(overrides) else None
            if nxt is None or (nxt.startswith("--") and len(nxt) > 2):
                val = "true"
            else:
                val = nxt
                i += 1
        out[key] = val
        i += 1
    return out


def load_config(yaml_path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """YAML file (keys = field names) then CLI overrides; every value is type-checked and validated."""
    values: dict[str, Any] = {}
    if yaml_path:
        path = Path(yaml_path)
        raw = read_yaml_mapping(path)
        for key, val in raw.items():
            if key not in FIELDS:
                raise ConfigError(f"{path}: unknown key {key!r}; valid keys: {', '.join(FIELDS)}")
            values[key] = coerce(key, val)
    for key, val in parse_overrides(list(overrides or [])).items():
        values[key] = coerce(key, val)
    cfg = TrainConfig(**values)
    cfg.validate()
    return cfg


def build_parser() -> argparse.ArgumentParser:
    """The ``--help`` text, generated from the dataclass (parsing itself is :func:`load_config`)."""
    p = argparse.ArgumentParser(
        prog="train/main.py",
        description="Train an EAGLE-3 drafter on a redraft dataset. Options come from --config YAML, then "
        "--key-name value overrides (the underscore spelling is accepted too).",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", default=None, help="YAML file whose keys are the options below")
    for name, f in FIELDS.items():
        flags = [f"--{name.replace('_', '-')}"]  # the underscore spelling is accepted too (parse_overrides)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kwargs: dict[str, Any] = {"default": default, "help": f.metadata["help"], "metavar": name.upper()}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
            kwargs.pop("metavar")
        p.add_argument(*flags, **kwargs)
    return p


def parse_cli(argv: list[str]) -> TrainConfig:
    """``[--config X.yaml] [--key value ...]`` -> TrainConfig; ``-h/--help`` prints every option and exits."""
    parser = build_parser()
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        raise SystemExit(0)
    rest: list[str] = []
    config_path = None
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--config":
            if i + 1 >= len(argv):
                parser.error("--config needs a file")
            config_path = argv[i + 1]
            i += 2
            continue
        if tok.startswith("--config="):
            config_path = tok.split("=", 1)[1]
        elif tok.startswith("--local_rank") or tok.startswith("--local-rank"):
            # torch.distributed.launch compatibility; the rank comes from the environment anyway
            if "=" not in tok:
                i += 1
        else:
            rest.append(tok)
        i += 1
    try:
        return load_config(config_path, rest)
    except ConfigError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
