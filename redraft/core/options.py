"""One config system for every command line: a command's options are one dataclass, its --help, YAML and code.

Each field is declared with :func:`option` (help, section, choices); :func:`parse` then reads ``--config FILE.yaml``
(keys are the field names), then the flags (``--max-new-tokens`` or ``--max_new_tokens``), coerces every value to
the field's type the same way from either source, refuses unknown keys by name, and runs the dataclass's
``validate()``. Booleans are bare flags (``--stream``, ``--no-stream``; ``--stream false`` also reads). Lists take
repeated flags or commas. ``--help`` lists the options by section, in the order the dataclass names them.
Whatever the user got wrong (a missing or unknown option, a value of the wrong type) is a ``ConfigError``: one
line naming the key, never a usage block (``redraft.core.cli`` turns it into exit code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from redraft.core.config import ConfigError, hyphenate_flags, read_yaml_mapping

T = TypeVar("T")
MISSING: Any = dataclasses.MISSING
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def option(default: Any = MISSING, help: str = "", *, group: str = "options", choices: Sequence[Any] | None = None,
           metavar: str | None = None, positional: bool = False, short: str | None = None) -> Any:
    """A dataclass field that is a command-line option (``default`` MISSING: required; declare the dataclass
    ``kw_only`` so that required options may follow optional ones)."""
    meta = {"help": help, "group": group, "choices": tuple(choices) if choices else None, "metavar": metavar,
            "positional": positional, "short": short}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unoptional(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def split_commas(values: list[Any]) -> list[Any]:
    """List items, each string item split at commas (``--data a,b --data c`` -> a, b, c)."""
    out: list[Any] = []
    for v in values:
        out.extend(p.strip() for p in v.split(",") if p.strip()) if isinstance(v, str) else out.append(v)
    return out


def coerce(name: str, value: Any, hint: Any, where: str = "") -> Any:
    """``value`` (from YAML or a flag's string) as the field's type; ConfigError naming the key otherwise."""
    try:
        return _convert(value, hint)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where + ': ' if where else ''}{name}={value!r}: {e}") from None


def _convert(value: Any, hint: Any) -> Any:
    hint, optional = _unoptional(hint)
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", ""))):
        return None
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).strip().lower() in _TRUE:
            return True
        if str(value).strip().lower() in _FALSE:
            return False
        raise ValueError("expected a boolean (true/false)")
    if origin is list or hint is list:
        (inner,) = typing.get_args(hint) or (str,)
        return [_convert(v, inner) for v in split_commas(value if isinstance(value, list) else [value])]
    if origin is tuple:
        items = split_commas(value if isinstance(value, (list, tuple)) else [value])
        elems = typing.get_args(hint)
        if len(items) != len(elems):
            raise ValueError(f"expected {len(elems)} comma-separated values")
        return tuple(_convert(v, t) for t, v in zip(elems, items, strict=True))
    if origin is dict or hint is dict:
        if isinstance(value, str):
            value = json.loads(value) if value.strip() else {}
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping (YAML) or a JSON object, got {type(value).__name__}")
        return {str(k): v for k, v in value.items()}
    if isinstance(value, (list, dict)) or (isinstance(value, bool) and hint in (int, float)):
        raise ValueError(f"expected {getattr(hint, '__name__', hint)}")
    if hint is int:
        return _to_int(value)
    return hint(value)


def _to_int(value: Any) -> int:
    """An integer, also written as 1e6 or 4096.0 (YAML and shells do); never a truncated fraction."""
    if isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        try:
            as_float = float(value)
        except ValueError:
            raise ValueError("expected an integer") from None
        if not as_float.is_integer():
            raise ValueError("expected an integer, not a fraction") from None
        return int(as_float)


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one ConfigError line with a pointer to --help (not a usage block)."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        default = getattr(action, "shown_default", None)
        return help if default is None else f"{help} (default: {default})"


def _show(default: Any) -> str | None:
    if default is MISSING:
        return "required"
    if default in ("", None, [], {}):
        return None
    if isinstance(default, (list, tuple)):
        return ",".join(str(v) for v in default)
    return str(default)


def build_parser(cls: type, *, prog: str, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``cls``'s options, grouped by section (defaults stay unset: :func:`parse` layers them)."""
    hints = _hints(cls)
    positionals = " ".join(f.name.upper() for f in dataclasses.fields(cls) if f.metadata.get("positional"))
    usage = f"{prog} {positionals + ' ' if positionals else ''}[--config FILE.yaml] [--OPTION VALUE ...]"
    parser = _Parser(prog=prog, usage=usage, description=description, epilog=epilog, formatter_class=_Formatter,
                     allow_abbrev=False)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "group" not in meta:
            continue
        group = groups.get(meta["group"]) or groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        hint, _ = _unoptional(hints[f.name])
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)  # type: ignore[misc]
        kw: dict[str, Any] = {"help": meta["help"], "default": argparse.SUPPRESS}
        if meta["choices"]:
            kw["choices"] = [str(c) for c in meta["choices"]]
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        if meta.get("positional"):
            many = typing.get_origin(hint) is list
            nargs = ("+" if default is MISSING else "*") if many else (None if default is MISSING else "?")
            action = group.add_argument(f.name, nargs=nargs, **kw)
            action.shown_default = _show(default)  # type: ignore[attr-defined]
            continue
        flags = [*([meta["short"]] if meta.get("short") else []), "--" + f.name.replace("_", "-")]
        if hint is bool:
            action = group.add_argument(*flags, nargs="?", const="true", metavar="BOOL", **kw)
            group.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_const", const="false",
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif typing.get_origin(hint) is list:
            action = group.add_argument(*flags, action="append", **kw)
        else:
            action = group.add_argument(*flags, **kw)
        action.shown_default = _show(default)  # type: ignore[attr-defined]
    group = groups.get("config") or parser.add_argument_group("config")
    group.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE.yaml",
                       help="YAML file whose keys are these options' names (unknown keys are refused), or a "
                            "target's one config (configs/kimi-k25.yaml: this stage's section, or FILE.yaml#STAGE's); "
                            "flags override it")
    return parser


def load_yaml(cls: type, path: str | Path, section: str | None = None) -> dict[str, Any]:
    """A YAML config of ``cls``'s options, coerced; an unknown key is refused naming it and the file.

    ``path`` is a plain options file, or a target's one config (``configs/kimi-k25.yaml``: ``facts`` stated once
    and a ``stages`` mapping with one section per stage), read at ``path#NAME``'s section or else at the
    command's own ``section`` (:func:`config_section`)."""
    where, mapping = config_section(path, section)
    hints = _hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if "group" in f.metadata}
    values: dict[str, Any] = {}
    for key, value in mapping.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(fields))})")
        values[name] = coerce(name, value, hints[name], where)
    return values


def config_section(path: str | Path, section: str | None = None) -> tuple[str, dict[str, Any]]:
    """(where, the options mapping) of ``--config``: a plain file's mapping, or one stage's section of a target's
    config (``FILE#NAME``, else ``section``: the command's own). One file per target holds every stage's settings;
    the facts they share are written once under ``facts`` and referred to with YAML aliases (``*target``)."""
    text = str(path)
    file, _, named = text.partition("#") if "#" in text and not Path(text).is_file() else (text, "", "")
    raw = read_yaml_mapping(Path(file))
    if "stages" not in raw:
        if named:
            raise ConfigError(f"{file}: #{named} names a stage, but the file has no 'stages' mapping")
        return file, raw
    extra = sorted(set(raw) - {"stages", "facts"})
    stages = raw["stages"]
    if extra or not isinstance(stages, dict):
        raise ConfigError(f"{file}: a target's config holds 'facts' and 'stages' only"
                          + (f" (found {', '.join(map(str, extra))})" if extra else ""))
    name = named or section
    if name is None:
        raise ConfigError(f"{file} holds the settings of several stages ({', '.join(stages)}): name one as "
                          f"{file}#STAGE")
    chosen = stages.get(name)
    if not isinstance(chosen, dict):
        raise ConfigError(f"{file}: no stage section {name!r} (sections: {', '.join(stages)})")
    return f"{file}#{name}", chosen


def parse(cls: type[T], argv: Sequence[str] | None, *, prog: str, description: str, epilog: str | None = None,
          validate: bool = True, section: str | None = None) -> T:
    """Defaults, then ``--config`` YAML (a target's config: the ``section`` stage's settings, or ``FILE#NAME``'s),
    then flags; coerced, checked and (unless ``validate`` is False: what a command reads to say where its refusal
    goes) validated. ``-h`` prints the help."""
    argv = hyphenate_flags(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(cls, prog=prog, description=description, epilog=epilog)
    args = vars(parser.parse_args(argv))
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if "group" in f.metadata}
    config = args.pop("config", None)
    values = load_yaml(cls, config, section) if config else {}
    for name, value in args.items():
        values[name] = coerce(name, value, hints[name])
    for name, f in fields.items():
        choices = f.metadata.get("choices")
        if choices and name in values and values[name] not in choices:
            raise ConfigError(f"{name}={values[name]!r}: expected one of {list(choices)}")
    missing = [n for n, f in fields.items() if n not in values and f.default is MISSING
               and f.default_factory is MISSING]  # type: ignore[misc]
    if missing:
        flag = missing[0] if fields[missing[0]].metadata.get("positional") else "--" + missing[0].replace("_", "-")
        raise ConfigError(f"{prog}: {flag} is required (see {prog} --help)")
    instance = cls(**values)
    check = getattr(instance, "validate", None) if validate else None
    if callable(check):
        result = check()
        if isinstance(result, cls):
            instance = result
    return instance


def flag_value(value: Any) -> str:
    """``value`` as a flag takes it (lists comma-joined, mappings as JSON): what :func:`parse` reads back."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def to_argv(instance: Any, cls: type | None = None, *, skip: Sequence[str] = ()) -> list[str]:
    """The command line that :func:`parse` reads back as ``instance`` (for ``cls``'s options, default its own
    class; ``skip`` left out): positionals first, then each option that differs from its default. What a command
    that runs another command passes on, so that no option list is written twice."""
    cls = cls or type(instance)
    positional: list[str] = []
    flags: list[str] = []
    for f in dataclasses.fields(cls):
        if "group" not in f.metadata or f.name in skip:
            continue
        value = getattr(instance, f.name)
        if f.metadata.get("positional"):
            positional += [str(v) for v in value] if isinstance(value, list) else [str(value)]
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)  # type: ignore[misc]
        if default is not MISSING and value == default:
            continue
        flags += ["--" + f.name.replace("_", "-"), flag_value(value)]
    return positional + flags
