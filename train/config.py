"""Every training option in one dataclass, loaded from YAML plus ``--key value`` overrides.

The dataclass is the single source of truth: YAML keys and CLI flags are its field names, and
``--help`` is generated from each field's help text, so an option cannot exist in one place and
be missing from another. Unknown keys are refused because a typo'd option silently falling back
to its default is the most expensive kind of training bug.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redraft.core import options
from redraft.core.config import ConfigError  # one error type for every stage
from redraft.core.options import option


def _section(group: str) -> Any:
    """``option`` for one --help section of train/main.py."""
    def opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
        return option(default, help, group=group, choices=choices)
    return opt


_data, _optim, _drafter, _run = (_section(g) for g in ("data and output", "optimisation", "drafter",
                                                         "checkpoints, evaluation, logging"))


@dataclass(kw_only=True)
class TrainConfig:
    """Options of ``train/main.py`` (YAML keys and ``--flags`` share these names)."""

    # --- data and output
    data: str = _data("", "dataset folder written by `python -m extract` (holds manifest.json)")
    out: str = _data("", "output folder: step-XXXXXXX checkpoints, `latest`, metrics.jsonl")
    seed: int = _data(0, "seed for drafter init, data order and the train/val split")
    val_fraction: float = _data(0.02, "fraction of samples held out for validation (by a hash of the sample id)")
    val_max_samples: int = _data(512, "cap on held-out samples (the ones with the smallest hash are kept)")
    max_length: int = _data(0, "truncate samples to this many tokens (0: keep the dataset's lengths)")
    tokens_per_batch: int = _data(
        8192, "length-bucketed micro-batches hold up to this many padded tokens per rank (0: no token cap)"
    )
    micro_batch_size: int = _data(0, "cap on samples per micro-batch per rank (0: no cap; tokens_per_batch decides)")
    mega_batch_samples: int = _data(
        512, "samples shuffled together then sorted by length to form batches (bigger: less padding)"
    )
    num_workers: int = _data(0, "DataLoader worker processes per rank")
    data_order: str = _data(
        "global",
        "global (the whole dataset shuffled per epoch; a held-out split by id) or stream (shards in index order, "
        "stream_group_shards at a time shuffled together: the order a --stream run trains in, also on a finished "
        "dataset; the draft vocabulary from the first group's tokens; no held-out split; with max_steps 0 the "
        "schedule's length is estimated from the first group)",
        choices=("global", "stream"),
    )
    stream: bool = _data(
        False, "train on the shards of `data` as extraction lands them (extract --window-bytes/--window-shards on "
        "the same folder), waiting for each group; ends when every planned shard is trained; implies "
        "data_order=stream"
    )
    stream_group_shards: int = _data(4, "data_order=stream: shards shuffled together (the shuffle buffer)")
    stream_keep: bool = _data(
        False, "--stream: keep the shards once trained (for later epochs) instead of deleting them behind each "
        "checkpoint"
    )
    stream_poll_s: float = _data(2.0, "--stream: seconds between looks for newly landed shards")
    stream_peer_timeout: float = _data(
        900.0, "--stream: seconds an extraction rank's heartbeat (heartbeats/extract-rank-R.json) may stand still "
        "before the trainer stops waiting for shards and exits 1 (far above a restart of extraction; an extraction "
        "not started yet is waited for without bound, and one that ended says why in extract_end/)"
    )
    teacher: str = _data(
        "auto",
        "teacher signal: topk (stored top-k logprobs), last_hidden (re-apply the target lm_head), "
        "auto (topk when stored, else last_hidden)",
        choices=("auto", "topk", "last_hidden"),
    )
    teacher_chunk_tokens: int = _data(1024, "last_hidden teacher: tokens per lm_head chunk (bounds memory)")
    target_path: str = _data("", "target model folder (embedding / lm_head weights); default: manifest target.path")

    # --- optimisation
    lr: float = _optim(1e-4, "peak learning rate (AdamW)")
    min_lr_ratio: float = _optim(0.0, "cosine floor as a fraction of lr")
    warmup_ratio: float = _optim(0.015, "linear warmup length as a fraction of the total optimizer steps")
    weight_decay: float = _optim(0.0, "AdamW weight decay")
    betas: tuple[float, float] = _optim((0.9, 0.95), "AdamW betas, e.g. `--betas 0.9,0.95`")
    adam_eps: float = _optim(1e-8, "AdamW epsilon")
    max_grad_norm: float = _optim(0.5, "gradient clipping norm (DeepSpeed reads it into its config)")
    max_steps: int = _optim(0, "optimizer steps to run (0: num_epochs over the train split)")
    num_epochs: int = _optim(1, "epochs over the train split when max_steps is 0")
    stop_at_step: int = _optim(
        0, "save and exit at this step without changing the schedule (time-limited jobs; resume later; 0: off)"
    )
    grad_accum: int = _optim(1, "micro-batches per optimizer step")
    ttt_steps: int = _optim(7, "training-time test (TTT) unroll length K: draft steps trained per position")
    ttt_decay: float = _optim(0.8, "loss weight of TTT step k is decay**k")
    dtype: str = _optim(
        "bf16",
        "compute dtype: bf16 (autocast, or DeepSpeed bf16 with fp32 master weights) or fp32",
        choices=("bf16", "fp32"),
    )

    # --- drafter
    draft_vocab_size: int = _drafter(32000, "draft vocabulary size (most frequent loss-masked target tokens)")
    init_from: str = _drafter(
        "", "warm-start from this drafter folder (SGLang/SpecForge layout or a redraft checkpoint); a resumed run "
        "restores its own checkpoint instead"
    )
    warm_start_vocab: str = _drafter(
        "rebuild",
        "with init_from: rebuild (the draft vocabulary from this data as a scratch run does, with draft_vocab_size "
        "tokens; old lm_head rows move to the tokens both vocabularies share, new tokens get the scratch init) or "
        "keep (the old drafter's vocabulary and lm_head as they are; needs the same draft_vocab_size)",
        choices=("rebuild", "keep"),
    )
    drafter_attention: str = _drafter(
        "gqa",
        "drafter attention: gqa (Llama-style, served as LlamaForCausalLMEagle3) or mla (DeepSeek multi-head latent "
        "attention, served as Eagle3DeepseekV2ForCausalLM; sizes from an MLA target such as Kimi-K2.5, else "
        "DeepSeek-V3's); with init_from it must be the init drafter's kind",
        choices=("gqa", "mla"),
    )
    drafter_method: str = _drafter(
        "eagle3",
        "drafter method: eagle3; eagle3.1 (an RMSNorm per aux layer before fc, and each step passes the "
        "post-norm state on: the engines' fc_norm and norm_output, both written into config.json); or p-eagle "
        "(parallel drafting, vLLM only, attention gqa: drafts 2..K in the pass of draft 1, from slots that read "
        "mask_token_id and a learned mask_hidden); or dflash (vLLM's DFlashDraftModel, attention gqa: dflash_layers "
        "Qwen3-style layers read the target's states as keys and values and draft a block of ttt_steps tokens in "
        "one bidirectional pass); with init_from it must be the init drafter's method",
        choices=("eagle3", "eagle3.1", "p-eagle", "dflash"),
    )
    mask_token_id: int | None = _drafter(
        None, "p-eagle and dflash: the token id every drafting slot embeds (default: the target's last vocab id; any "
        "id serves, its embedding is the target's frozen row and the drafter learns around it)")
    dflash_layers: int | None = _drafter(None, "dflash only: decoder layers in the block drafter (default 1)")
    attention_impl: str = _drafter(
        "eager",
        "the TTT attention kernel: eager (blocked, hand-written backward; the CPU default and the reference), sdpa "
        "(one causal torch SDPA call per step, no mask tensor: the fused kernels; batches are right-padded) or flex "
        "(FlexAttention with the TTT block mask, compiled: the fused GPU path; CUDA only). Same math, held equal in "
        "tests; each linear in memory in the sample length",
        choices=("eager", "sdpa", "flex"),
    )
    activation_checkpointing: bool = _drafter(
        False, "recompute each TTT step's activations in the backward instead of keeping them: a step keeps only its "
        "input state and its keys/values (long samples: far less memory per token, about one more forward)")
    sequence_parallel: int = _drafter(
        1, "ranks that share each sample along its length (Ulysses: T / N rows per rank, attention split by kv head "
        "between two all-to-alls); must divide the number of processes and the drafter's kv heads; tokens_per_batch "
        "is then the group's micro-batch")
    hidden_size: int | None = _drafter(None, "drafter hidden size (default: the target's)")
    num_attention_heads: int | None = _drafter(None, "drafter attention heads (default: the target's)")
    num_key_value_heads: int | None = _drafter(None, "drafter KV heads (default: the target's)")
    head_dim: int | None = _drafter(None, "drafter head dim (default: the target's, or hidden/heads)")
    intermediate_size: int | None = _drafter(None, "drafter MLP size (default: the target's dense MLP size)")
    max_position_embeddings: int | None = _drafter(None, "drafter max positions (default: the target's)")
    rope_theta: float | None = _drafter(None, "drafter RoPE base (default: the target's)")
    q_lora_rank: int | None = _drafter(None, "MLA drafter: rank of the q down-projection (default: the target's, else 1536)")
    kv_lora_rank: int | None = _drafter(
        None, "MLA drafter: rank of the kv latent (default: the target's, else 512; the engines' MLA kernels serve 512)"
    )
    qk_nope_head_dim: int | None = _drafter(None, "MLA drafter: per-head q/k dims without rope (default: the target's, else 128)")
    qk_rope_head_dim: int | None = _drafter(
        None, "MLA drafter: per-head q/k rope dims, one rope key shared by all heads (default: the target's, else 64)"
    )
    v_head_dim: int | None = _drafter(None, "MLA drafter: per-head value dims (default: the target's, else 128)")

    # --- checkpoints, evaluation, logging
    save_every: int = _run(500, "save a checkpoint every N optimizer steps (and always at the end; 0: end only)")
    keep_last: int = _run(3, "keep only the newest N checkpoints (0: keep all)")
    resume: str = _run("none", "none | auto (newest complete checkpoint under out/) | a checkpoint folder")
    eval_every: int = _run(500, "validate on the held-out split every N steps (and at the end; 0: end only)")
    log_every: int = _run(10, "write a metrics.jsonl row every N optimizer steps")
    report_to: str = _run("none", "also log to wandb (respects WANDB_MODE)", choices=("none", "wandb"))
    wandb_project: str = _run("redraft", "wandb project")
    run_name: str = _run("", "wandb run name (default: the out folder's name)")
    log_sample_ids: bool = _run(False, "each rank appends the sample ids it trains on to out/sample_ids/rank-R.jsonl")

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
                    "stream_group_shards", "sequence_parallel")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("stream_poll_s", "stream_peer_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_steps <= 0 and self.num_epochs <= 0:
            raise ConfigError("set max_steps > 0 or num_epochs > 0")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.sequence_parallel > 1 and self.stream:
            raise ConfigError(f"sequence_parallel={self.sequence_parallel} trains a finished dataset; --stream is not "
                              "supported with it (extract first, or train the stream with sequence_parallel 1)")
        self._check_drafter_attention()
        self._check_drafter_method()
        if self.resume not in ("none", "auto") and not Path(self.resume).is_dir():
            raise ConfigError(f"resume={self.resume!r}: expected none, auto or an existing checkpoint folder")

    def _check_drafter_attention(self) -> None:
        """Sizes of the other attention kind are refused by key, before any process group or model exists."""
        from redraft.core.drafter.config import MLA_FIELDS

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

    def _check_drafter_method(self) -> None:
        """A method with keys of another, or one no engine serves with this attention, is refused by key."""
        from redraft.core.drafter.config import PARALLEL_ATTENTION

        if self.mask_token_id is not None and self.drafter_method not in ("p-eagle", "dflash"):
            raise ConfigError(f"mask_token_id={self.mask_token_id} is a p-eagle/dflash setting but drafter_method is "
                              f"{self.drafter_method}; set drafter_method: p-eagle or dflash, or drop the key")
        if self.dflash_layers is not None and self.drafter_method != "dflash":
            raise ConfigError(f"dflash_layers={self.dflash_layers} is a dflash setting but drafter_method is "
                              f"{self.drafter_method}; set drafter_method: dflash, or drop the key")
        if self.sequence_parallel > 1 and self.drafter_method == "dflash":
            raise ConfigError(f"sequence_parallel={self.sequence_parallel}: dflash drafts a block per row from the rows "
                              "around it and trains on one rank per sample; use sequence_parallel 1")
        if self.dflash_layers is not None and self.dflash_layers < 1:
            raise ConfigError(f"dflash_layers must be >= 1, got {self.dflash_layers}")
        if self.drafter_method == "dflash" and self.drafter_attention != "gqa":
            raise ConfigError(f"drafter_method=dflash with drafter_attention={self.drafter_attention}: vLLM 0.32's "
                              "DFlashDraftModel is a Qwen3 (GQA) stack; use drafter_attention: gqa")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ConfigError(f"mask_token_id must be a token id >= 0, got {self.mask_token_id}")
        if self.drafter_method == "p-eagle" and self.drafter_attention not in PARALLEL_ATTENTION:
            raise ConfigError(f"drafter_method=p-eagle with drafter_attention={self.drafter_attention}: vLLM 0.32 drafts "
                              "in parallel only with Llama/Qwen3 EAGLE-3 drafters (its MLA drafter has no mask_hidden) "
                              "and SGLang 0.5.23 not at all; use drafter_attention: gqa")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
PROG = "train/main.py"
DESCRIPTION = ("Train an EAGLE-3 drafter on a redraft dataset. Options come from --config YAML (keys are the "
               "option names), then --option-name value flags (the underscore spelling is accepted too).")


def build_parser() -> argparse.ArgumentParser:
    """The ``--help`` of train/main.py, by section (redraft.core.options)."""
    return options.build_parser(TrainConfig, prog=PROG, description=DESCRIPTION)


def load_config(yaml_path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """YAML file (keys = field names) then flags; every value is type-checked and validated (redraft.core.options)."""
    argv = (["--config", str(yaml_path)] if yaml_path else []) + list(overrides or [])
    return options.parse(TrainConfig, argv, prog=PROG, description=DESCRIPTION, section="train")


def parse_cli(argv: list[str]) -> TrainConfig:
    """``[--config X.yaml] [--key value ...]`` -> TrainConfig; ``-h/--help`` prints every option and exits."""
    rest: list[str] = []
    skip = False
    for tok in argv:  # torch.distributed.launch's --local_rank: the rank comes from the environment anyway
        if skip:
            skip = False
        elif tok.startswith(("--local_rank", "--local-rank")):
            skip = "=" not in tok
        else:
            rest.append(tok)
    return options.parse(TrainConfig, rest, prog=PROG, description=DESCRIPTION, section="train")
