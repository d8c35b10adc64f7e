"""The extraction stage, top to bottom: read → plan shards → (regenerate) → tokenize → capture → shard → manifest.

Work is cut into shards of consecutive input records, bounded in bytes and in records and decided
before anything is captured (`extract.shard_plan`); rank r of W owns shards s ≡ r mod W. Each shard
is computed from scratch in a fixed batch order and written as its samples arrive (each batch is
encoded and spilled to disk at once, `redraft.core.dataset.writer.ShardWriter`), then assembled and renamed,
so memory does not grow with the shard, a shard at its final name is complete, the files do not
depend on the world size, and a killed run rerun with the same command produces the same bytes.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from extract.backends.base import GenerationConfig, TargetBackend, TeacherSpec
from extract.chat import (
    TokenizedSample,
    chat_template_hash,
    sha256_json,
    tokenize_conversation,
    tokenizer_hash,
)
from extract.config import ExtractConfig
from extract.decontaminate import REASON as EVAL_OVERLAP
from extract.decontaminate import Decontamination, refuse_contradiction, self_check_covers
from extract.generated import (
    ExactnessCounts,
    GeneratedSample,
    check_generated,
    generated_samples,
    has_generation,
)
from extract.progress import Heartbeat
from extract.records import Record, read_records, write_records_jsonl
from extract.regen_engines import Regenerator, make_regenerator
from extract.regenerate import regenerate_records
from extract.run_state import (
    REGEN_DIR,
    REGEN_NAME,
    check_path,
    concat_regenerated,
    expected_checksums,
    plan_shards,
    rank_lock,
    read_checks,
    remove_stale_temps,
    shard_is_done,
)
from extract.self_prompts import SelfPromptsResult, synthesise
from extract.shard_plan import feature_widths, regenerated_bytes_bound, sample_bytes
from extract.timing import StageClock, describe, span
from redraft.catalog.builtin import SELF_DATA, resolve_data, resolve_target
from redraft.core.atomic import atomic_write_text
from redraft.core.batching import pack_batches
from redraft.core.config import ConfigError
from redraft.core.dataset.format import (
    SampleFeatures,
    ShardInfo,
    bytes_per_token,
    dataset_header,
    features_are_finite,
    shard_relpath,
)
from redraft.core.dataset.liveness import trainer_check
from redraft.core.dataset.window import (
    HEADER_NAME,
    StreamClosed,
    is_consumed,
    wait_for_room,
    window_fit_problem,
    write_seal,
    write_window,
)
from redraft.core.dataset.writer import ShardWriter, finalize_dataset
from redraft.core.target_weights import text_config

log = logging.getLogger(__name__)



@dataclass
class ExtractSummary:
    """What one run of this rank did (and the dataset totals when it finalised)."""

    rank: int
    world_size: int
    shards_total: int
    shards_written: int = 0
    shards_reused: int = 0
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)
    generated: ExactnessCounts = field(default_factory=ExactnessCounts)  # samples captured from generated ids
    bytes_written: int = 0
    seconds: float = 0.0
    # Where the seconds went (extract.timing): exclusive parts that add up to `seconds`.
    parts: dict[str, float] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    decontamination: str | None = None  # what --decontaminate dropped (Decontamination.describe)
    stream_closed: bool = False  # the streaming trainer finished before every shard was extracted
    stream_complete: bool = False  # every shard streamed (some consumed by the trainer: no manifest)

    def line(self) -> str:
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        bpt = self.bytes_written / self.tokens if self.tokens else 0.0
        rate = self.tokens / self.seconds if self.seconds else 0.0
        done = ("manifest written" if self.manifest else "every shard streamed" if self.stream_complete
                else "stopped: the streaming trainer needs no more shards" if self.stream_closed
                else "waiting for other ranks")
        decon = f"{self.decontamination}; " if self.decontamination else ""
        g = self.generated
        exact = (f"{g.samples} samples from generated ids ({g.mismatched_samples} not stored as generated, "
                 f"{g.cut_samples} holding a reply cut at the token limit); ") if g.samples else ""
        return (
            f"rank {self.rank}/{self.world_size}: {self.shards_written} shards written, {self.shards_reused} reused "
            f"of {self.shards_total}; {self.samples} samples, {self.tokens} tokens ({self.loss_tokens} loss tokens), "
            f"{self.truncated} truncated; {exact}{decon}skipped: {skipped}; {bpt:,.0f} bytes/token; {self.seconds:.1f} s "
            f"({rate:,.0f} tok/s; {describe(self.parts)}); {done}"
        )


def _file_fingerprint(path: Path) -> dict[str, Any]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return {"path": str(path), "files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    return {"path": str(path), "bytes": path.stat().st_size}


def make_plan(
    cfg: ExtractConfig, inputs: Sequence[Path], num_records: int, skipped: Counter, bytes_per_token: int,
    self_prompts: SelfPromptsResult | None = None, decontamination: Decontamination | None = None,
) -> dict[str, Any]:
    """Everything that decides the bytes of the shards; a rerun must agree with it.

    The shard boundaries themselves (`shard_starts`) are added by :func:`plan_shards`.
    """
    return {
        "target": cfg.target,
        "backend": cfg.backend,
        "inputs": [_file_fingerprint(p) for p in inputs],
        "max_samples": cfg.max_samples,
        "num_records": num_records,
        "skipped_at_parse": dict(sorted(skipped.items())),
        "samples_per_shard": cfg.samples_per_shard,
        "shard_bytes": int(cfg.shard_bytes),
        "bytes_per_token": bytes_per_token,
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "teacher": list(cfg.teacher),
        "topk": cfg.topk,
        "hidden_dtype": cfg.hidden_dtype,
        "max_length": cfg.max_length,
        "batch_tokens": cfg.batch_tokens,
        "dtype": cfg.dtype,
        "generation": _generation(cfg).to_manifest() if cfg.regenerate else None,
        "max_user_turns": cfg.max_user_turns if cfg.regenerate else None,
        # Regenerated turns are kept as the generated ids (extract.generated); a folder regenerated as
        # text by an older version must not be resumed into.
        "regenerated_as": "token_ids" if cfg.regenerate else None,
        # Which engine wrote the replies; absent for the default (hf), so folders started before the
        # option existed still resume.
        **({"regen_backend": cfg.regen_backend} if cfg.regenerate and cfg.regen_backend != "hf" else {}),
        # The prompts the target wrote (their file is among the inputs); absent when unused.
        **({"self_prompts": {"recipe_sha256": sha256_json(self_prompts.report["recipe"]),
                             "counts": self_prompts.report["counts"]}} if self_prompts is not None else {}),
        # Which evaluation prompts records were checked against, and how; absent when off, so folders
        # started before the option existed still resume.
        **({"decontamination": decontamination.plan()} if decontamination is not None else {}),
    }


def record_sizes(cfg: ExtractConfig, tokenizer: Callable[[], Any], records: Sequence[Record], bpt: int) -> list[int]:
    """Bytes each record will cost in its shard: exact from its samples' tokens, or, when it is yet to be
    regenerated, the most it can cost (see extract.shard_plan)."""
    if cfg.regenerate:
        return [regenerated_bytes_bound(r, max_length=cfg.max_length, max_user_turns=cfg.max_user_turns,
                                        bytes_per_token=bpt) for r in records]
    tok = tokenizer()
    with span("tokenize"):
        return [sum(sample_bytes(len(it.input_ids), bpt) for it in _items(cfg, tok, [r]) if any(it.loss_mask))
                for r in records]


def _generation(cfg: ExtractConfig, shard: int = 0) -> GenerationConfig:
    return GenerationConfig(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed * 1_000_003 + shard,
        batch_size=cfg.gen_batch_size,
    )


def _device(cfg: ExtractConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_backend(cfg: ExtractConfig, target_path: Path) -> TargetBackend:
    """Build the configured backend; SGLang is imported only here, and only when asked for."""
    aux = cfg.aux_layer_ids or None
    if cfg.backend == "hf":
        from extract.backends.hf import HFTarget

        return HFTarget(
            str(target_path), name=cfg.target, aux_layer_ids=aux, dtype=cfg.dtype, device=_device(cfg),
            trust_remote_code=cfg.trust_remote_code, chunk_tokens=cfg.capture_chunk_tokens,
        )
    if cfg.backend == "vllm":
        from extract.backends.vllm import VLLMTarget

        return VLLMTarget(
            str(target_path), name=cfg.target, aux_layer_ids=aux, dtype=cfg.dtype, max_length=cfg.max_length,
            python=cfg.engine_python or None, kv_cache_bytes=int(cfg.kv_cache_gb * (1 << 30)),
            capture_dir=cfg.capture_dir or None, teacher_device=_device(cfg),
            trust_remote_code=cfg.trust_remote_code, engine_args=cfg.engine_args,
        )
    from extract.backends.sglang import SGLangTarget

    return SGLangTarget(
        str(target_path), name=cfg.target, aux_layer_ids=aux, tp_size=cfg.tp_size, ep_size=cfg.ep_size,
        dtype=cfg.dtype, max_length=cfg.max_length, trust_remote_code=cfg.trust_remote_code,
        engine_kwargs=cfg.engine_args, python=cfg.engine_python or None, capture_dir=cfg.capture_dir or None,
    )


def load_tokenizer(cfg: ExtractConfig, target_path: Path) -> Any:
    """The target's tokenizer alone (both backends load the same one), for planning shards before the model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_path), local_files_only=True,
                                         trust_remote_code=cfg.trust_remote_code)


def _bytes_per_token(cfg: ExtractConfig, hidden_size: int, num_aux: int) -> int:
    return int(bytes_per_token(hidden_size, num_aux, cfg.hidden_dtype, cfg.teacher, cfg.topk))


def make_header(cfg: ExtractConfig, backend: TargetBackend, parse_skipped: Counter,
                self_prompts: SelfPromptsResult | None = None,
                decontamination: Decontamination | None = None) -> dict[str, Any]:
    """The manifest fields that describe the target and the run (the store adds the shards)."""
    info = backend.info
    return dataset_header(
        asdict(info), hidden_size=info.hidden_size, num_layers=info.num_layers, vocab_size=info.vocab_size,
        aux_layer_ids=info.aux_layer_ids, tokenizer_hash=tokenizer_hash(backend.tokenizer),
        chat_template_hash=chat_template_hash(backend.tokenizer), teacher=cfg.teacher,
        topk=cfg.topk if "topk" in cfg.teacher else None, hidden_dtype=cfg.hidden_dtype, max_length=cfg.max_length,
        backend=cfg.backend,
        generation={**_generation(cfg).to_manifest(), "backend": cfg.regen_backend} if cfg.regenerate else None,
        regenerated=REGEN_NAME if cfg.regenerate else None, skipped=parse_skipped,
        self_prompts=self_prompts.report if self_prompts is not None else None,
        decontamination=decontamination.manifest() if decontamination is not None else None,
    )


def _regenerated_shard(
    cfg: ExtractConfig, out: Path, shard: int, records: list[Record], backend: TargetBackend,
    regenerator: Regenerator | None = None,
) -> list[Record]:
    path = out / REGEN_DIR / f"shard-{shard:06d}.jsonl"
    if path.exists():
        again = read_records([path], require_assistant=False).records
        if len(again) == len(records):
            return [replace(orig, messages=new.messages) for orig, new in zip(records, again, strict=True)]
        log.warning("%s: %d records, expected %d; regenerating", path, len(again), len(records))
    new = regenerate_records(backend, records, _generation(cfg, shard), max_length=cfg.max_length,
                             max_user_turns=cfg.max_user_turns, regenerator=regenerator)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_records_jsonl(path, new)
    return new


@dataclass
class _Item:
    """One capture sequence of a shard: from the record's text, or from the ids the target generated."""

    record: Record
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool
    generated: GeneratedSample | None = None


def _items(cfg: ExtractConfig, tokenizer: Any, records: list[Record]) -> list[_Item]:
    items = []
    for r in records:
        if has_generation(r):
            for g in generated_samples(tokenizer, r, cfg.max_length):
                items.append(_Item(r, g.sample_id, g.input_ids, g.loss_mask, g.truncated, g))
        else:
            tok: TokenizedSample = tokenize_conversation(tokenizer, r.messages, cfg.max_length)
            items.append(_Item(r, r.id, tok.input_ids, tok.loss_mask, tok.truncated))
    return items


@dataclass
class ShardResult:
    """One written shard: what the manifest needs, the skip counts and the check of its generated samples."""

    info: ShardInfo
    skipped: Counter
    checked: ExactnessCounts
    truncated: int


def extract_shard(
    cfg: ExtractConfig, out: Path, shard: int, records: list[Record], backend: TargetBackend, progress: tqdm,
    regenerator: Regenerator | None = None,
) -> ShardResult:
    """Capture one shard's samples and write it as they arrive.

    Each captured batch is validated, encoded to the storage dtype and spilled to disk before the next
    batch's features are computed, so memory holds one batch's features (and, with a backend that overlaps,
    the next batch's engine states) whatever the shard's size; the file keeps
    input order (samples are captured longest first). The check of the samples built from generated ids
    is written before the shard is renamed into place, so a shard at its final name always has one.
    """
    if cfg.regenerate:
        with span("regenerate"), Heartbeat(f"regenerate shard {shard} ({len(records)} conversations)", unit="replies"):
            records = _regenerated_shard(cfg, out, shard, records, backend, regenerator)
    skipped: Counter = Counter()
    with span("tokenize"):
        items = _items(cfg, backend.tokenizer, records)
    # Progress counts records (a conversation may give several samples): done with its last sample.
    left = Counter(id(it.record) for it in items)

    def done(i: int) -> None:
        left[id(items[i].record)] -= 1
        progress.update(int(left[id(items[i].record)] == 0))

    keep = [i for i, it in enumerate(items) if any(it.loss_mask)]
    if len(keep) < len(items):
        skipped["no_loss_tokens"] += len(items) - len(keep)
    for i in sorted(set(range(len(items))) - set(keep)):
        done(i)
    teacher = TeacherSpec(kinds=tuple(cfg.teacher), topk=cfg.topk, chunk_tokens=cfg.chunk_tokens)
    problems: dict[int, str | None] = {}  # item index -> check of a sample built from generated ids
    truncated = 0
    batches = [[keep[j] for j in b] for b in pack_batches([len(items[i].input_ids) for i in keep], cfg.batch_tokens)]
    # The backend may capture the next batch while this loop writes the current one (extract.backends.vllm).
    stream = backend.capture_batches(([items[i].input_ids for i in idx] for idx in batches), teacher)
    with ShardWriter(out, shard, hidden_dtype=cfg.hidden_dtype, num_aux=len(backend.info.aux_layer_ids)) as writer, \
            Heartbeat(f"capture shard {shard}", total=len(keep), unit="samples") as beat, closing(stream):
        for idx in batches:
            with span("capture"):
                captured = next(stream)
            with span("write"):
                for i, cap in zip(idx, captured, strict=True):
                    it = items[i]
                    sample = _sample(it, cap)
                    if features_are_finite(sample):
                        writer.add(sample, position=i)
                        truncated += it.truncated
                        if it.generated is not None:
                            problems[i] = check_generated(sample.input_ids.tolist(), sample.loss_mask.tolist(),
                                                          it.generated.turns, sample.truncated)
                    else:
                        log.warning("sample %s (%s): captured features are not finite; skipped", it.sample_id,
                                    it.record.origin)
                        skipped["non_finite"] += 1
                    done(i)
                # Let go of this batch's features before the next capture allocates its own.
                del captured, cap, sample
            batch_tokens = sum(len(items[i].input_ids) for i in idx)
            progress.tokens += batch_tokens
            beat.advance(len(idx), batch_tokens)
            progress.set_postfix(tok_s=f"{progress.tokens / max(progress.format_dict['elapsed'], 1e-9):.0f}",
                                 refresh=False)
        with span("write"):
            checked = _check_shard(shard, [(items[i], problems[i]) for i in keep if i in problems])
            # The check goes to disk before the shard: a shard at its final name always has one.
            if checked.samples or cfg.regenerate:
                atomic_write_text(check_path(out, shard), json.dumps(checked.to_json(), sort_keys=True) + "\n")
            else:
                check_path(out, shard).unlink(missing_ok=True)
            info = writer.finish(skipped)
    return ShardResult(info, skipped, checked, truncated)


def _sample(it: _Item, cap: Any) -> SampleFeatures:
    rec = it.record
    return SampleFeatures(
        sample_id=it.sample_id,
        source=rec.source,
        category=rec.category,
        input_ids=torch.tensor(it.input_ids, dtype=torch.int64),
        loss_mask=torch.tensor(it.loss_mask, dtype=torch.uint8),
        aux_hidden=cap.aux_hidden,
        topk_ids=cap.topk_ids,
        topk_logprobs=cap.topk_logprobs,
        last_hidden=cap.last_hidden,
        truncated=it.truncated,
    )


def _check_shard(shard: int, checked: list[tuple[_Item, str | None]]) -> ExactnessCounts:
    """Count the checks of the samples built from generated ids (made as each went to the store), in input order."""
    counts = ExactnessCounts()
    for it, problem in checked:
        assert it.generated is not None
        turns = it.generated.turns
        counts.add(it.sample_id, len(turns), any(g.finish_reason == "length" for g in turns), problem)
        if problem is not None and counts.mismatched_samples <= 5:
            log.warning("shard %d, sample %s (%s): not stored as generated: %s", shard, it.sample_id,
                        it.record.origin, problem)
    return counts


class _Engines:
    """The target backend and the regenerator, each loaded when first needed and closed once.

    `--data self` needs them before the records exist (to write the prompts); the same ones then
    regenerate and capture, so a vLLM engine or the hf model is loaded once per run.
    """

    def __init__(self, cfg: ExtractConfig, target_path: Path) -> None:
        self.cfg, self.target_path = cfg, target_path
        self._backend: TargetBackend | None = None
        self._regenerator: Regenerator | None = None
        self._tokenizer: Any = None

    @property
    def loaded(self) -> bool:
        return self._backend is not None

    def backend(self) -> TargetBackend:
        if self._backend is None:
            self._backend = load_backend(self.cfg, self.target_path)
        return self._backend

    def tokenizer(self) -> Any:
        if self._backend is not None:
            return self._backend.tokenizer
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.cfg, self.target_path)
        return self._tokenizer

    def regenerator(self) -> Regenerator:
        if self._regenerator is None:
            backend = self.backend() if self.cfg.regen_backend == "hf" else None
            self._regenerator = make_regenerator(self.cfg, backend, self.target_path)
        return self._regenerator

    def close(self) -> None:
        regenerator, self._regenerator = self._regenerator, None
        backend, self._backend = self._backend, None
        try:
            if regenerator is not None:
                regenerator.close()
        finally:
            if backend is not None:
                backend.close()


def self_prompts(cfg: ExtractConfig, out: Path, engines: _Engines) -> SelfPromptsResult:
    """The prompts of `--data self`, written by the first rank that gets here (the others wait, then reuse them)."""
    lock_dir = out / ".locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / "self-prompts.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            return synthesise(cfg, out, engines.tokenizer(), engines.regenerator)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def refuse_beyond_context(cfg: ExtractConfig, target_path: Path) -> Path:
    """A ``max_length`` past the target's context would store positions the target never serves (and engines
    refuse them after minutes of start-up): refused by name before any work. Returns ``target_path``."""
    try:
        config = text_config(json.loads((target_path / "config.json").read_text()))
    except (OSError, ValueError):
        return target_path  # the backend names a missing or broken config.json itself
    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and cfg.max_length > limit:
        raise ConfigError(f"max_length={cfg.max_length} is beyond the target's context: {target_path / 'config.json'} "
                          f"has max_position_embeddings={limit}")
    return target_path


def run_extraction(cfg: ExtractConfig) -> ExtractSummary:
    """Do this rank's shards, then assemble the manifest if every rank is done."""
    start = time.perf_counter()
    with StageClock() as clock:
        return _run(cfg, clock, start)


def _run(cfg: ExtractConfig, clock: StageClock, start: float) -> ExtractSummary:
    given = {d: resolve_data(d) for d in cfg.data if d != SELF_DATA}
    refuse_contradiction(given, cfg.decontaminate)  # before any work: it would drop every record of an input
    decon = Decontamination.build(cfg.decontaminate, cfg.eval_overlap) if cfg.decontaminate else None
    out = Path(cfg.out)
    engines: _Engines | None = None
    written: SelfPromptsResult | None = None
    if SELF_DATA in cfg.data:  # the target writes these prompts before anything is read
        engines = _Engines(cfg, refuse_beyond_context(cfg, resolve_target(cfg.target)))
        try:
            out.mkdir(parents=True, exist_ok=True)
            with span("self_prompts"):
                written = self_prompts(cfg, out, engines)
        except BaseException:
            engines.close()
            raise
    inputs = [written.path if d == SELF_DATA and written is not None else given[d] for d in cfg.data]
    if decon is not None and written is not None:
        decon.self_dropped = int(written.report["counts"]["dropped"].get(EVAL_OVERLAP, 0))
        if self_check_covers(cfg):
            decon.exempt = (written.path,)
        else:
            log.info("the self-written prompts were checked against %s at overlap %s while sampling; "
                     "checking them against --decontaminate %s too", cfg.self_decontaminate,
                     cfg.self_eval_overlap, cfg.decontaminate)
    try:
        with span("read"):
            parsed = read_records(inputs, require_assistant=not cfg.regenerate, strict=cfg.strict,
                                  max_records=cfg.max_samples or None, keep=decon.keep if decon else None)
        records = parsed.records
        if decon is not None:
            if decon.dropped:
                parsed.skipped[EVAL_OVERLAP] += decon.dropped
            log.info("%s", decon.describe())
            if decon.checked and decon.dropped == decon.checked:
                log.warning("decontamination dropped every record: are the inputs the evaluation set?")
        log.info("read %d records from %d input(s); skipped %s", len(records), len(inputs),
                 dict(parsed.skipped) or "none")
        if not records:
            raise ConfigError(no_records_problem(cfg, parsed.skipped))
        target_path = refuse_beyond_context(cfg, resolve_target(cfg.target))
        if cfg.backend == "sglang":  # what SGLang would refuse after minutes of start-up, before anything is written
            from extract.backends.sglang import preflight

            preflight(target_path, aux_layer_ids=cfg.aux_layer_ids or None, trust_remote_code=cfg.trust_remote_code,
                      engine_kwargs=cfg.engine_args, python=cfg.engine_python or None)
        engines = engines or _Engines(cfg, target_path)
        out.mkdir(parents=True, exist_ok=True)
        summary = _extract(cfg, out, target_path, inputs, parsed, engines, written, clock, start, decon)
        summary.skipped.update(parsed.skipped)  # records left out when read, beside the samples left out in shards
        summary.decontamination = decon.describe() if decon is not None else None
        return summary
    finally:
        if engines is not None:
            engines.close()


def no_records_problem(cfg: ExtractConfig, skipped: Counter) -> str:
    """Why an extraction has nothing to extract, by the reasons its records were left out."""
    counts = ", ".join(f"{reason}: {n}" for reason, n in sorted(skipped.items())) or "the inputs hold no record"
    hint = ""
    if skipped.get("no_assistant_turn"):
        hint = ("; prompt-only records (no assistant turn) need --regenerate, so that the target answers them")
    elif skipped.get(EVAL_OVERLAP):
        hint = "; decontamination dropped them (are the inputs the evaluation set?)"
    return f"data {', '.join(cfg.data)}: no record to extract, so no sample would be written ({counts}){hint}"


def _extract(cfg: ExtractConfig, out: Path, target_path: Path, inputs: list[Path], parsed: Any, engines: _Engines,
             written: SelfPromptsResult | None, clock: StageClock, start: float,
             decon: Decontamination | None = None) -> ExtractSummary:
    records = parsed.records
    with rank_lock(out, cfg.rank):
        with span("plan"):
            hidden, num_aux = feature_widths(target_path, cfg.aux_layer_ids, cfg.trust_remote_code)
            bpt = _bytes_per_token(cfg, hidden, num_aux)
            plan = make_plan(cfg, inputs, len(records), parsed.skipped, bpt, written, decon)
            starts = plan_shards(out, plan, lambda: record_sizes(cfg, lambda: load_tokenizer(cfg, target_path),
                                                                 records, bpt),
                                 accept=lambda full: _accept_window(cfg, out, full))
            num_shards = len(starts) - 1
            summary = ExtractSummary(rank=cfg.rank, world_size=cfg.world_size, shards_total=num_shards)
            expected = expected_checksums(out)
            mine = [s for s in range(num_shards) if s % cfg.world_size == cfg.rank]
            remove_stale_temps(out, mine)
            todo = [s for s in mine if not shard_is_done(out, s, expected)]
            summary.shards_reused = len(mine) - len(todo)
        header_path = out / HEADER_NAME
        backend: TargetBackend | None = None
        regenerator: Regenerator | None = None
        if todo or not header_path.exists():
            with span("load"):
                backend = engines.backend()
                info = backend.info
                if _bytes_per_token(cfg, info.hidden_size, len(info.aux_layer_ids)) != bpt:
                    raise ConfigError(f"{cfg.target}: the loaded target has hidden size {info.hidden_size} and "
                                      f"{len(info.aux_layer_ids)} aux layers, its config.json said {hidden} and "
                                      f"{num_aux}")
                atomic_write_text(header_path, json.dumps(make_header(cfg, backend, parsed.skipped, written, decon),
                                                          indent=2, sort_keys=True) + "\n")
                if cfg.regenerate and todo:
                    regenerator = engines.regenerator()
        if cfg.streaming:
            seal_landed_shards(out, [s for s in mine if s not in todo])
        total = sum(starts[s + 1] - starts[s] for s in todo)
        trainer = trainer_check(out, cfg.stream_peer_timeout) if cfg.streaming else None
        try:
            with tqdm(total=total, unit="sample", desc=f"extract rank {cfg.rank}", disable=None) as progress:
                progress.tokens = 0  # running count for the tokens/s readout
                for s in todo:
                    assert backend is not None
                    if cfg.streaming:
                        try:
                            with span("window"):
                                wait_for_room(out, cfg.window_bytes, cfg.window_shards, cfg.stream_group_shards,
                                              peer=trainer)
                        except StreamClosed as e:
                            log.info("%s: stopping before shard %d", e, s)
                            summary.stream_closed = True
                            break
                    done = extract_shard(cfg, out, s, records[starts[s] : starts[s + 1]], backend, progress,
                                         regenerator)
                    if cfg.streaming:
                        write_seal(out, s, done.info)  # the shard has landed: the trainer may read it
                    summary.shards_written += 1
                    summary.samples += done.info.num_samples
                    summary.tokens += done.info.num_tokens
                    summary.loss_tokens += done.info.num_loss_tokens
                    summary.truncated += done.truncated
                    summary.skipped.update(done.skipped)
                    summary.generated.merge(done.checked)
                    summary.bytes_written += (out / done.info.path).stat().st_size
        finally:
            with span("close"):
                engines.close()  # before the manifest: the engines' memory is not needed for it

        if cfg.finalize and all((out / shard_relpath(s)).exists() for s in range(num_shards)):
            with span("finalize"):
                header = json.loads(header_path.read_text())
                header["regeneration"] = read_checks(out, num_shards)
                if cfg.regenerate:
                    concat_regenerated(out, num_shards)
                summary.manifest = finalize_dataset(out, num_shards=num_shards, header=header,
                                                    vocab_size=header["vocab_size"])
        elif cfg.streaming and all((out / shard_relpath(s)).exists() or is_consumed(out, s) for s in range(num_shards)):
            summary.stream_complete = True
            log.info("streamed into %s: every shard landed, some consumed (deleted) by the trainer, so no manifest; "
                     "train/main.py --stream knows the set is complete from plan.json and the seals", out)
    summary.parts = clock.stop()
    summary.seconds = time.perf_counter() - start
    return summary


def _accept_window(cfg: ExtractConfig, out: Path, plan: dict[str, Any]) -> None:
    """A streaming window must hold the trainer's group plus one shard of the plan's largest (refused before
    plan.json is written); the window's settings go beside the plan (window.json), for the trainer to check."""
    if not cfg.streaming:
        return
    largest = int(plan.get("largest_shard_bytes") or 0) if plan.get("shard_bytes_exact") else 0
    problem = window_fit_problem(cfg.window_bytes, cfg.window_shards, largest, cfg.stream_group_shards)
    if problem:
        raise ConfigError(problem)
    write_window(out, {"window_bytes": cfg.window_bytes, "window_shards": cfg.window_shards,
                       "stream_group_shards": cfg.stream_group_shards})


def seal_landed_shards(out: Path, shards: Sequence[int]) -> None:
    """Seal the shards a killed run left complete but unsealed (killed between the rename and the seal)."""
    from redraft.core.dataset.window import consumed_path, seal_path
    from redraft.core.dataset.writer import read_shard_info

    for s in shards:
        if not seal_path(out, s).exists() and not consumed_path(out, s).exists():
            info = read_shard_info(out, s)
            if info is not None:
                write_seal(out, s, info)
