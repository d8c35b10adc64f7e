"""Extraction options: one dataclass that feeds `--help`, `--config FILE.yaml` and the code.

Every option is a field with its help text in the field metadata, so the CLI, the YAML
files under configs/ and the code cannot drift apart. Unknown YAML keys are refused by
name rather than ignored, because a misspelt key silently changes what gets extracted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redraft.catalog.builtin import SELF_DATA
from redraft.core import options
from redraft.core.config import ByteSize, ConfigError
from redraft.core.options import option, split_commas


def _section(group: str) -> Any:
    """``option`` for one --help section of python -m extract."""
    def opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
        return option(default, help, group=group, choices=choices)
    return opt


_io = _section("inputs and output")
_eng = _section("target engine and capture")
_store = _section("teacher and storage")
_rec = _section("records")
_regen = _section("regeneration (--regenerate)")
_self = _section("self-written prompts (--data self)")
_comp = _section("compute")
_ranks = _section("ranks")
_stream = _section("streaming (train/main.py --stream on the same folder)")


@dataclass
class ExtractConfig:
    target: str = _io("", "Target model: a built-in name (smollm2-135m-instruct; kimi-k25-mini, Kimi-K2.5's "
                           "architecture in miniature, built on first use) or a local Hugging Face folder.")
    data: list[str] = _io(
        [],
        "Input data: JSONL/JSON/Parquet files, datasets folders, or built-in names (mtbench, chitchat, chitchat-long: "
        "long chats of joined chitchat transcripts, and self: "
        "user prompts the target writes itself, see --self-*, needs --regenerate). "
        "Repeat the flag or separate with commas.",
    )
    out: str = _io("", "Output dataset folder (shards, manifest.json, token counts).")
    backend: str = _eng("hf", "Target backend: hf (transformers, runs anywhere), vllm (vLLM's hidden-state "
                              "extraction: in-process where vllm is installed, else the vLLM CPU venv of `make "
                              "vllm-cpu-venv`) or sglang (SGLang's aux capture, TP/EP on GPUs: this python's SGLang, "
                              "else the SGLang CPU venv of `make sglang-cpu-venv`).", choices=("hf", "vllm", "sglang"))
    engine_args: dict[str, Any] = _eng(
        {}, "--backend sglang|vllm: further engine settings, as a YAML mapping or a JSON object on the command "
            "line: sglang.Engine (ServerArgs) fields such as mem_fraction_static, max_prefill_tokens, "
            "context_length, attention_backend, enable_deterministic_inference; or vllm.LLM arguments such as "
            "gpu_memory_utilization, tensor_parallel_size. A setting that would break capture is refused by name.")
    engine_python: str = _eng("", "--backend vllm|sglang: interpreter that has the engine (default: this one if it "
                                  "has it, else $VLLM_CPU_VENV or ~/.cache/redraft/vllm-cpu, $SGLANG_CPU_VENV or "
                                  "~/.cache/redraft/sglang-cpu).")
    kv_cache_gb: float = _eng(2.0, "--backend vllm: KV-cache memory in GiB (bounds how many prompts the engine "
                                   "prefills at once; the captured states live there until written).")
    capture_dir: str = _eng("", "--backend vllm|sglang: folder the engine writes each request's hidden states to before "
                                "they are read and removed (one capture batch at a time); a RAM disk such as "
                                "/dev/shm is fastest. Empty: a fresh temporary folder.")
    capture_chunk_tokens: int = _eng(8192, "--backend hf: a sample longer than this is captured in chunks of this "
                                           "many tokens through the target's KV cache (the same states as one pass; "
                                           "activation memory bounded by the chunk, not the sample). 0: one pass.")
    aux_layer_ids: list[int] = _eng(
        [],
        "Decoder layers to capture, as 'output of layer i' (0-based). Empty: the EAGLE-3 low/mid/high "
        "default [1, L//2-1, L-4].",
    )
    teacher: list[str] = _store(["topk"], "Teacher to store: topk, last_hidden, or both (comma-separated).")
    topk: int = _store(64, "How many top log-probabilities to keep per position (teacher topk).")
    hidden_dtype: str = _store("bf16", "Storage dtype of hidden states: bf16, or fp8 (e4m3, per-token scales).",
                             choices=("bf16", "fp8"))
    max_length: int = _store(2048, "Truncate tokenized conversations to this many tokens (counted in the summary).")
    samples_per_shard: int = _store(256, "Most input records (conversations) per shard. A shard is the unit of work, "
                                       "resume and regeneration (its prompts are regenerated together).")
    shard_bytes: ByteSize = _store(ByteSize(4 << 30), "Most feature bytes per shard, 4GiB by default (units: GiB, MiB, G, M). "
                                                    "Records are assigned to shards before any capture: by their "
                                                    "exact size, or, when regenerating, by the largest they can get "
                                                    "(max_length tokens per user turn). Memory does not grow with it.")
    batch_tokens: int = _store(8192, "Upper bound on padded tokens in one forward batch.")
    max_samples: int = _rec(0, "Use only the first N valid input records (0: all).")
    strict: bool = _rec(False, "Stop at the first bad input record (exit code 2, nothing written) instead of skipping it.")
    decontaminate: list[str] = _rec(
        [], "Evaluation inputs (built-in names such as mtbench, or files) whose user turns no training record may "
            "be close to: a drafter trained on its evaluation prompts reports a gain it would not have on fresh "
            "traffic. Every input record with a user turn that overlaps one (--eval-overlap) is dropped and "
            "counted as skipped eval_overlap; the manifest's decontamination says how many. Empty: no check "
            "(--data self has its own, --self-decontaminate).")
    eval_overlap: float = _rec(0.5, "--decontaminate: drop a record when a user turn's word 3-gram Jaccard "
                                    "similarity to an evaluation prompt, or share of the smaller 3-gram set "
                                    "(3+ shared), reaches this (the same test as --self-eval-overlap).")
    regenerate: bool = _regen(False, "Let the target write the assistant turns itself, turn by turn, before capture; "
                                   "its replies are stored as the token ids it generated (regenerated.jsonl keeps "
                                   "them next to the text).")
    max_user_turns: int = _regen(0, "Regeneration: answer only the first N user turns of each conversation (0: all).")
    temperature: float = _regen(0.0, "Regeneration temperature (0: greedy).")
    top_p: float = _regen(1.0, "Regeneration nucleus sampling threshold.")
    max_new_tokens: int = _regen(256, "Regeneration: most new tokens per assistant turn; a reply cut here is "
                                    "stored as cut (no end-of-turn) and flagged truncated.")
    gen_batch_size: int = _regen(8, "Regeneration with --regen-backend hf: prompts per generate call.")
    regen_backend: str = _regen(
        "hf", "Regeneration engine: hf (the capture backend's own generate, --gen-batch-size prompts per call), "
              "vllm (vLLM from the prompt ids, every prompt of a turn at once; in-process where vllm is installed, "
              "else the vLLM CPU venv of `make vllm-cpu-venv`), or server (a running SGLang or vLLM server at "
              "--regen-url).", choices=("hf", "vllm", "server"))
    regen_url: str = _regen("", "Regeneration with --regen-backend server: the server's base URL, e.g. "
                              "http://HOST:30000 (SGLang /generate or vLLM /v1/completions, told apart by asking).")
    regen_server_api: str = _regen("auto", "Regeneration server API: auto (ask the server), sglang or vllm.",
                                 choices=("auto", "sglang", "vllm"))
    regen_concurrency: int = _regen(64, "Regeneration with --regen-backend server: requests in flight at most.")
    regen_engine_python: str = _regen("", "Regeneration with --regen-backend vllm: interpreter that has vllm "
                                        "(default: this one if it has vllm, else $VLLM_CPU_VENV or "
                                        "~/.cache/redraft/vllm-cpu).")
    regen_kv_cache_gb: float = _regen(2.0, "Regeneration with --regen-backend vllm: KV-cache memory in GiB (bounds "
                                         "how many prompts the engine runs at once).")
    regen_gpu_memory_utilization: float = _regen(
        0.0, "Regeneration with --regen-backend vllm on a GPU: the share of the device vLLM may take (0: vLLM's "
             "default 0.9, which does not fit next to an hf capture backend on the same GPU).")
    seed: int = _regen(0, "Seed for sampled regeneration (each shard derives its own, so reruns reproduce) and "
                        "for the prompts of --data self (each prompt derives its own).")
    self_prompts: int = _self(1000, "--data self: how many user prompts the target writes, counted after the "
                                   "filters (dedup, degenerate text, closeness to the evaluation prompts).")
    self_max_samples: int = _self(0, "--data self: stop sampling after this many prompts even when fewer than "
                                    "--self-prompts survived (0: 4 x --self-prompts).")
    self_categories: list[str] = _self(
        [], "--data self: steer the prompts towards these MT-bench categories, cycled, through a system message "
            "of ours (writing, roleplay, reasoning, math, coding, extraction, stem, humanities, or mtbench for "
            "all eight). Empty: no hint, the template's own default system prompt.")
    self_temperature: float = _self(1.0, "--data self: sampling temperature of the prompts (must be > 0: every "
                                        "prompt starts from the same ids).")
    self_top_p: float = _self(0.95, "--data self: nucleus sampling threshold of the prompts.")
    self_max_new_tokens: int = _self(256, "--data self: most tokens of one prompt; a prompt without an end-of-turn "
                                         "by then is dropped as cut.")
    self_language: str = _self("en", "--data self: keep only English prompts (en: Latin script and English "
                                     "function words) or any language (any).", choices=("en", "any"))
    self_near_duplicate: float = _self(0.7, "--data self: drop a prompt whose word 3-gram Jaccard similarity "
                                           "to an earlier kept one reaches this.")
    self_eval_overlap: float = _self(0.5, "--data self: drop a prompt whose word 3-gram Jaccard similarity to an "
                                         "evaluation prompt, or share of the smaller 3-gram set (3+ shared), "
                                         "reaches this.")
    self_decontaminate: list[str] = _self(["mtbench"], "--data self: evaluation inputs (built-in names or files) "
                                                      "whose user turns no kept prompt may be close to.")
    dtype: str = _comp("float32", "Target compute dtype: float32 or bfloat16.", choices=("float32", "bfloat16"))
    device: str = _comp("auto", "Device for the hf backend, and for --backend vllm's teacher (final norm + lm_head): auto, cpu or cuda.")
    trust_remote_code: bool = _comp(False, "Allow the target folder's own Python code to run (off unless you trust it).")
    tp_size: int = _comp(1, "sglang backend: tensor-parallel size.")
    ep_size: int = _comp(1, "sglang backend: expert-parallel size.")
    chunk_tokens: int = _comp(512, "Teacher logits are computed for at most this many tokens at a time.")
    rank: int = _ranks(-1, "This process's rank (-1: from SLURM_PROCID/SLURM_ARRAY_TASK_ID/RANK, else 0).")
    world_size: int = _ranks(0, "Number of ranks (0: from SLURM_NTASKS/SLURM_ARRAY_TASK_COUNT/WORLD_SIZE, else 1).")
    finalize: bool = _ranks(True, "Assemble manifest.json when every shard exists (any rank may do it).")
    window_bytes: ByteSize = _stream(ByteSize(0), "Streaming (train/main.py --stream on the same folder): start a shard "
                                               "only when it fits: the landed shards still in the folder plus the "
                                               "largest shard so far within this many bytes (units as --shard-bytes; "
                                               "0: no byte limit). Each shard gets a seal the trainer checks. Peak "
                                               "disk: the window plus one shard per rank.")
    window_shards: int = _stream(0, "Streaming: start a shard only while fewer landed shards than this are in the "
                                 "folder (0: no count limit). Either limit turns streaming on.")
    stream_group_shards: int = _stream(4, "Streaming: the trainer's stream_group_shards (shards it shuffles together); "
                                       "the window must hold that many shards plus one, else both sides would wait "
                                       "on each other, so a smaller window is refused.")
    stream_peer_timeout: float = _stream(900.0, "Streaming: seconds the trainer's heartbeat (heartbeats/train.json) "
                                         "may stand still before extraction, waiting for room, stops waiting and "
                                         "exits 1 (far above a restart of the trainer with --resume auto; a trainer "
                                         "not started yet is waited for without bound).")

    @property
    def streaming(self) -> bool:
        """Writing into a bounded window for a streaming trainer (seals, waits for room)."""
        return bool(self.window_bytes or self.window_shards)

    def validate(self) -> ExtractConfig:
        """Normalise list options and check values; raises ConfigError naming the key."""
        self.data = split_commas(self.data)
        self.teacher = split_commas(self.teacher)
        if not self.target:
            raise ConfigError("target: required (a built-in name or a local model folder)")
        if not self.data:
            raise ConfigError("data: required (at least one input file, folder or built-in name)")
        if not self.out:
            raise ConfigError("out: required (the output dataset folder)")
        bad = [t for t in self.teacher if t not in ("topk", "last_hidden")]
        if bad or not self.teacher:
            raise ConfigError(f"teacher: expected topk and/or last_hidden, got {self.teacher}")
        for name in ("topk", "max_length", "samples_per_shard", "shard_bytes", "batch_tokens", "max_new_tokens",
                     "gen_batch_size", "chunk_tokens", "tp_size", "ep_size", "regen_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f"{f.name}: expected one of {list(choices)}, got {getattr(self, f.name)!r}")
        if not 0.0 <= self.regen_gpu_memory_utilization <= 1.0:
            raise ConfigError(f"regen_gpu_memory_utilization: must be in [0, 1], got {self.regen_gpu_memory_utilization}")
        if self.kv_cache_gb <= 0:
            raise ConfigError(f"kv_cache_gb: must be > 0, got {self.kv_cache_gb}")
        if self.engine_args and self.backend == "hf":
            raise ConfigError("engine_args: only --backend sglang or vllm start an engine; --backend hf takes none")
        if self.window_bytes < 0 or self.window_shards < 0:
            raise ConfigError("window_bytes / window_shards: must be >= 0 (0: no limit of that kind)")
        if self.stream_group_shards < 1:
            raise ConfigError(f"stream_group_shards: must be >= 1, got {self.stream_group_shards}")
        if self.stream_peer_timeout <= 0:
            raise ConfigError(f"stream_peer_timeout: must be > 0 seconds, got {self.stream_peer_timeout}")
        from redraft.core.dataset.window import window_fit_problem

        if self.streaming and (problem := window_fit_problem(0, self.window_shards, 0, self.stream_group_shards)):
            raise ConfigError(problem)
        if self.regen_kv_cache_gb <= 0:
            raise ConfigError(f"regen_kv_cache_gb: must be > 0, got {self.regen_kv_cache_gb}")
        self.self_categories = split_commas(self.self_categories)
        self.self_decontaminate = split_commas(self.self_decontaminate)
        self.decontaminate = split_commas(self.decontaminate)
        if SELF_DATA in self.decontaminate:
            raise ConfigError(f"decontaminate: {SELF_DATA!r} is not an evaluation input (name mtbench or a file)")
        if SELF_DATA in self.data:
            if not self.regenerate:
                raise ConfigError(f"data: {SELF_DATA} writes user prompts only; add --regenerate so the target "
                                  f"answers them")
            if self.data.count(SELF_DATA) > 1:
                raise ConfigError(f"data: {SELF_DATA} is named more than once")
        for name in ("self_prompts", "self_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.self_max_samples < 0:
            raise ConfigError(f"self_max_samples: must be >= 0, got {self.self_max_samples}")
        if self.self_temperature <= 0:
            raise ConfigError(f"self_temperature: must be > 0 (every prompt starts from the same ids), "
                              f"got {self.self_temperature}")
        if not 0.0 < self.self_top_p <= 1.0:
            raise ConfigError(f"self_top_p: must be in (0, 1], got {self.self_top_p}")
        for name in ("self_near_duplicate", "self_eval_overlap", "eval_overlap"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}: must be in (0, 1], got {getattr(self, name)}")
        if self.regenerate and self.regen_backend == "server" and not self.regen_url:
            raise ConfigError("regen_url: required with regen_backend server (the server's base URL, "
                              "e.g. http://HOST:30000)")
        self.rank, self.world_size = resolve_rank(self.rank, self.world_size)
        return self


def resolve_rank(rank: int, world_size: int) -> tuple[int, int]:
    """Rank and world size from the flags, else Slurm (array jobs or srun tasks), else torchrun, else 0/1."""
    env = os.environ
    if world_size <= 0:
        for key in ("SLURM_ARRAY_TASK_COUNT", "SLURM_NTASKS", "WORLD_SIZE"):
            if env.get(key):
                world_size = int(env[key])
                break
        else:
            world_size = 1
    if rank < 0:
        if env.get("SLURM_ARRAY_TASK_COUNT") and env.get("SLURM_ARRAY_TASK_ID"):
            rank = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        else:
            for key in ("SLURM_PROCID", "RANK"):
                if env.get(key):
                    rank = int(env[key])
                    break
            else:
                rank = 0
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank: {rank} is outside 0..{world_size - 1} (world_size {world_size})")
    return rank, world_size


PROG = "python -m extract"
DESCRIPTION = ("Run the serving target over chat data and store its captured auxiliary hidden states and teacher "
               "distribution as sharded, checksummed, resumable safetensors datasets. Rerunning the same command "
               "resumes: complete shards are kept, the rest is redone.")


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config; unknown keys are an error naming the key and the file."""
    return options.load_yaml(ExtractConfig, path, "extract")


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(ExtractConfig, prog=PROG, description=DESCRIPTION)


def parse_args(argv: list[str] | None = None, *, validate: bool = True) -> ExtractConfig:
    """CLI flags over an optional YAML file over the defaults (redraft.core.options); ``validate=False``: as written, for
    saying where a refused run's end goes."""
    return options.parse(ExtractConfig, argv, prog=PROG, description=DESCRIPTION, validate=validate, section="extract")
