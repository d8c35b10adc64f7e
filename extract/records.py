"""Read chat datasets (JSONL, JSON, Parquet, `datasets` folders) into normalised records.

Every input format becomes a `Record` holding a tuple of `Message`s, so the rest of the
pipeline never sees ShareGPT vs OpenAI differences. Bad records are skipped and counted by
reason (the counts go into the dataset manifest), or raise `BadRecordError` in strict mode,
because silently training on half-parsed conversations is worse than failing loudly.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redraft.core.atomic import atomic_open
from redraft.core.errors import UserError

logger = logging.getLogger(__name__)

SKIP_REASONS = (
    "invalid_json",
    "not_utf8",
    "not_object",
    "unknown_format",
    "unknown_role",
    "non_string_content",
    "no_assistant_turn",
    "empty_conversation",
    "bad_turn_order",
    "bad_generation",
)
ID_FIELDS = ("id", "question_id", "conversation_id")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_LOG_LIMIT = 20  # warnings per reason before we only count
_BOM = b"\xef\xbb\xbf"


FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class Generation:
    """The ids the target generated for one assistant turn: the truth that `content` only decodes.

    Decode -> encode is not the identity, so a regenerated turn is captured from these ids, never
    from its text. `prompt_tokens`/`prompt_sha256` identify the prompt ids it was generated from
    (see `extract.generated.prompt_sha256`), so a later capture can prove it uses the same context.
    """

    output_ids: tuple[int, ...]  # stop token included when the target wrote one
    finish_reason: str  # "stop" (ended with a stop token) or "length" (cut at the token limit)
    prompt_tokens: int
    prompt_sha256: str


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str
    reasoning_content: str | None = None
    generation: Generation | None = None  # set on assistant turns the target wrote (regeneration)


@dataclass(frozen=True)
class Record:
    id: str
    messages: tuple[Message, ...]
    source: str
    category: str | None
    origin: str  # "path:LINE" (1-based) for JSONL, "path:#ROW" (0-based) otherwise


class BadRecordError(UserError):
    """A record that cannot be used; `reason` is one of SKIP_REASONS, `detail` says what was wrong."""

    def __init__(self, origin: str, reason: str, detail: str = "") -> None:
        super().__init__(f"{origin}: {reason}")
        self.origin = origin
        self.reason = reason
        self.detail = detail


@dataclass
class ReadResult:
    records: list[Record]
    skipped: collections.Counter = field(default_factory=collections.Counter)  # reason -> count


class _Bad(Exception):
    """Internal: a record-level problem, turned into a skip or a BadRecordError by the reader."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


# ----------------------------------------------------------------------------- raw rows


@dataclass(frozen=True)
class _Row:
    origin: str
    index: int  # 1-based line for JSONL, 0-based row otherwise (used for fallback ids)
    value: Any = None  # the parsed object, unless `bad` is set
    bad: _Bad | None = None


def _iter_jsonl(path: Path) -> Iterator[_Row]:
    # Read bytes and decode per line, so one bad byte costs one line, not the whole file.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            origin = f"{path}:{lineno}"
            if lineno == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]  # files saved by Windows editors: the BOM is not part of the record
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield _Row(origin, lineno, bad=_Bad("not_utf8", str(e)))
                continue
            try:
                yield _Row(origin, lineno, value=json.loads(text))
            except json.JSONDecodeError as e:
                yield _Row(origin, lineno, bad=_Bad("invalid_json", str(e)))
            except RecursionError:
                yield _Row(origin, lineno, bad=_Bad("invalid_json", "nested too deeply to parse"))


def _json_rows(path: Path) -> list[Any]:
    try:
        text = path.read_bytes().decode("utf-8-sig")  # -sig: a leading BOM is dropped, not a parse error
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 ({e})") from e
    if not text.strip():
        logger.warning("%s: empty file, no records", path)
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from e
    except RecursionError:
        raise ValueError(f"{path}: invalid JSON (nested too deeply to parse)") from None
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        if _detect_format(data) is not None:
            return [data]  # a single record
        lists = [k for k, v in data.items() if isinstance(v, list)]
        if len(lists) == 1:
            return data[lists[0]]
        raise ValueError(
            f"{path}: a JSON object must hold exactly one list of records; found list keys {lists} "
            f"among {sorted(data)[:10]}"
        )
    raise ValueError(f"{path}: expected a JSON array of objects or an object holding one, got {type(data).__name__}")


def _iter_parquet(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _iter_dataset_folder(path: Path) -> Iterator[Any]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds.keys())
        if len(splits) != 1:
            raise ValueError(
                f"{path}: is a DatasetDict with splits {splits}; pass one split's folder (e.g. {path}/{splits[0]})"
            )
        ds = ds[splits[0]]
    yield from ds


def _iter_rows(path: Path) -> Iterator[_Row]:
    if not path.exists():
        raise FileNotFoundError(f"input not found: {path}")
    if path.is_dir():
        if not any((path / n).exists() for n in ("dataset_info.json", "dataset_dict.json", "state.json")):
            raise ValueError(f"{path}: a folder input must be saved with datasets.Dataset.save_to_disk")
        rows: Iterable[Any] = _iter_dataset_folder(path)
    else:
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _iter_jsonl(path)
            return
        if suffix == ".json":
            rows = _json_rows(path)
        elif suffix == ".parquet":
            rows = _iter_parquet(path)
        else:
            raise ValueError(f"{path}: unknown input type {suffix!r}; expected .jsonl, .json, .parquet or a datasets folder")
    for i, value in enumerate(rows):
        yield _Row(f"{path}:#{i}", i, value=value)


# ----------------------------------------------------------------------------- parsing


def _detect_format(obj: dict) -> str | None:
    for key in ("messages", "conversations", "turns", "prompt"):
        if key in obj and obj[key] is not None:
            return key
    return None


def _turn_list(obj: dict, key: str) -> list:
    turns = obj[key]
    if not isinstance(turns, list):
        raise _Bad("unknown_format", f"{key!r} is a {type(turns).__name__}, not a list")
    return turns


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _Bad("non_string_content", f"{where} is {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate (a \\ud800-style JSON escape): the tokenizer would crash on it
        raise _Bad("not_utf8", f"{where}: {e.reason} at character {e.start}") from None
    return value


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_generation(value: Any, where: str) -> Generation:
    if not isinstance(value, dict):
        raise _Bad("bad_generation", f"{where} is a {type(value).__name__}, not an object")
    ids = value.get("output_ids")
    if not isinstance(ids, list) or not ids or not all(_int(t) and t >= 0 for t in ids):
        raise _Bad("bad_generation", f"{where}.output_ids must be a non-empty list of token ids")
    finish = value.get("finish_reason")
    if finish not in FINISH_REASONS:
        raise _Bad("bad_generation", f"{where}.finish_reason {finish!r} is not one of {FINISH_REASONS}")
    n = value.get("prompt_tokens")
    digest = value.get("prompt_sha256")
    if not _int(n) or n < 1:
        raise _Bad("bad_generation", f"{where}.prompt_tokens {n!r} is not a positive integer")
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise _Bad("bad_generation", f"{where}.prompt_sha256 is not a sha256 hex digest")
    return Generation(tuple(ids), finish, n, digest)


def _parse_messages(obj: dict) -> list[Message]:
    out = []
    for i, m in enumerate(_turn_list(obj, "messages")):
        if not isinstance(m, dict):
            raise _Bad("not_object", f"messages[{i}] is a {type(m).__name__}")
        role = _OPENAI_ROLES.get(m.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise _Bad("unknown_role", f"messages[{i}] role {m.get('role')!r}")
        content = _text(m.get("content"), f"messages[{i}].content")
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None:
            reasoning = _text(reasoning, f"messages[{i}].reasoning_content")
        generation = m.get("generation")
        if generation is not None:
            if role != "assistant":
                raise _Bad("bad_generation", f"messages[{i}] is a {role!r} message with generation ids")
            generation = _parse_generation(generation, f"messages[{i}].generation")
        out.append(Message(role, content, reasoning if role == "assistant" else None, generation))
    return out


def _parse_sharegpt(obj: dict) -> list[Message]:
    out = []
    for i, m in enumerate(_turn_list(obj, "conversations")):
        if not isinstance(m, dict):
            raise _Bad("not_object", f"conversations[{i}] is a {type(m).__name__}")
        speaker = m.get("from", m.get("role"))
        role = _SHAREGPT_ROLES.get(speaker.lower()) if isinstance(speaker, str) else None
        if role is None:
            raise _Bad("unknown_role", f"conversations[{i}] from {speaker!r}")
        out.append(Message(role, _text(m.get("value", m.get("content")), f"conversations[{i}].value")))
    return out


def _parse_object(obj: Any, *, require_assistant: bool) -> list[Message]:
    if not isinstance(obj, dict):
        raise _Bad("not_object", f"record is a {type(obj).__name__}")
    kind = _detect_format(obj)
    if kind is None:
        raise _Bad("unknown_format", f"no conversations/messages/prompt/turns among keys {sorted(obj)[:10]}")
    if kind == "messages":
        messages = _parse_messages(obj)
    elif kind == "conversations":
        messages = _parse_sharegpt(obj)
    elif kind == "turns":
        messages = [Message("user", _text(t, f"turns[{i}]")) for i, t in enumerate(_turn_list(obj, "turns"))]
    else:
        messages = [Message("user", _text(obj["prompt"], "prompt"))]
    first = next((m for m in messages if m.role != "system"), None)
    if first is None:
        raise _Bad("empty_conversation", "no user or assistant message")
    if first.role != "user":
        raise _Bad("bad_turn_order", f"first non-system message is {first.role!r}, expected 'user'")
    if require_assistant and not any(m.role == "assistant" for m in messages):
        raise _Bad("no_assistant_turn", "no assistant message")
    return messages


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


# ----------------------------------------------------------------------------- public API


class _SkipLog:
    """Counts skips and rate-limits their warnings per reason."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()

    def add(self, origin: str, bad: _Bad) -> None:
        self.counts[bad.reason] += 1
        if self.counts[bad.reason] <= _LOG_LIMIT:
            logger.warning("%s: skipped record (%s): %s", origin, bad.reason, bad.detail)
        elif self.counts[bad.reason] == _LOG_LIMIT + 1:
            logger.warning("further %r skips are counted but not logged", bad.reason)

    def summary(self) -> None:
        for reason, n in sorted(self.counts.items()):
            if n > _LOG_LIMIT:
                logger.warning("skipped %d records with reason %r in total", n, reason)


def read_records(
    paths: Sequence[str | Path],
    *,
    require_assistant: bool = True,
    strict: bool = False,
    max_records: int | None = None,
    keep: Callable[[Path, Record], bool] | None = None,
) -> ReadResult:
    """Read every path in order into records; bad records are skipped (or raise when strict).

    A record's own "source" field wins over the file stem, so files written by
    `write_records_jsonl` (e.g. regenerated data) keep their original dataset names.
    ``keep(path, record)``: a valid record it refuses is left out and does not count towards
    ``max_records`` (the caller counts why; its id stays taken, so the others' ids do not move).
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    records: list[Record] = []
    skips = _SkipLog()
    seen_ids: set[str] = set()
    for p in paths:
        path = Path(p)
        stem = path.name if path.is_dir() else path.stem
        for row in _iter_rows(path):
            if max_records is not None and len(records) >= max_records:
                break
            try:
                if row.bad is not None:
                    raise row.bad
                messages = _parse_object(row.value, require_assistant=require_assistant)
            except _Bad as bad:
                if strict:
                    logger.error("%s: bad record (%s): %s", row.origin, bad.reason, bad.detail)
                    raise BadRecordError(row.origin, bad.reason, bad.detail) from None
                skips.add(row.origin, bad)
                continue
            obj = row.value
            source = obj.get("source") if isinstance(obj.get("source"), str) and obj.get("source") else stem
            raw_id = next((obj[k] for k in ID_FIELDS if obj.get(k) is not None), None)
            rid = str(raw_id) if raw_id is not None else f"{stem}:{row.index}"
            unique, n = rid, 1
            while unique in seen_ids:
                n += 1
                unique = f"{rid}#{n}"
            seen_ids.add(unique)
            record = Record(unique, tuple(messages), source, _optional_str(obj.get("category")), row.origin)
            if keep is None or keep(path, record):
                records.append(record)
        if max_records is not None and len(records) >= max_records:
            break
    skips.summary()
    return ReadResult(records, skips.counts)


def record_to_json(record: Record) -> dict[str, Any]:
    """The OpenAI-messages form `write_records_jsonl` writes (and `read_records` reads back)."""
    messages = []
    for m in record.messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        if m.generation is not None:
            g = m.generation
            d["generation"] = {"output_ids": list(g.output_ids), "finish_reason": g.finish_reason,
                               "prompt_tokens": g.prompt_tokens, "prompt_sha256": g.prompt_sha256}
        messages.append(d)
    return {"id": record.id, "source": record.source, "category": record.category, "messages": messages}


def write_records_jsonl(path: str | Path, records: Iterable[Record]) -> None:
    """Write records as JSONL atomically: a crash leaves either the old file or none, never half of one."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(record_to_json(r), ensure_ascii=False) + "\n")
