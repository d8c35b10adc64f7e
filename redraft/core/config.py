"""What every command line shares: one error type for bad options, YAML config files, flag spelling.

Every stage reads ``--config FILE.yaml`` whose keys are its options' names, refuses unknown keys by
name (a misspelt key silently changes what runs), and spells flags with hyphens
(``--max-new-tokens``); the underscore spelling (``--max_new_tokens``) is accepted everywhere too.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from redraft.core.errors import UserError


class ConfigError(UserError):
    """A bad option value or an unknown key; the message names the key and the file."""


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


class ByteSize(int):
    """A size in bytes that a flag or YAML value may spell with a unit: ``4GiB``, ``512M``, ``1.5G``, ``1024``.

    Decimal units (k, M, G, T) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of 1024.
    """

    def __new__(cls, value: Any) -> ByteSize:
        if isinstance(value, bool):
            raise ValueError(f"not a size in bytes: {value!r}")
        if isinstance(value, int):
            return super().__new__(cls, value)
        match = _SIZE.fullmatch(str(value))
        if match is None:
            raise ValueError(f"not a size in bytes: {value!r} (examples: 4GiB, 512MiB, 2G, 1000000)")
        number, unit = match.groups()
        return super().__new__(cls, int(float(number) * _SIZE_UNITS[(unit or "").lower()]))


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML file of option: value pairs; errors name the file."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of option: value")
    return raw


def hyphenate_flags(argv: Sequence[str]) -> list[str]:
    """``--max_new_tokens 8`` -> ``--max-new-tokens 8`` (values, and anything after ``--``, untouched)."""
    out: list[str] = []
    rest = False
    for tok in argv:
        if rest or not tok.startswith("--") or tok == "--":
            rest = rest or tok == "--"
            out.append(tok)
            continue
        name, eq, value = tok[2:].partition("=")
        out.append("--" + name.replace("_", "-") + eq + value)
    return out


def parse_hyphenated(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args`` that also accepts the underscore spelling of every flag."""
    return parser.parse_args(hyphenate_flags(sys.argv[1:] if argv is None else argv))
