"""``redraft config FILE[#STAGE] [--stage NAME] [--env]``: the settings a stage reads from a config file, as it reads them.

A target's one config (``configs/kimi-k25.yaml``) holds every stage's section; this prints one section with the
aliases resolved, as ``key: value`` lines, or with ``--env`` as ``KEY=VALUE`` lines for a shell script
(``slurm/serve.sh`` reads its ``serve`` section so). Values are written as a flag takes them (lists
comma-joined, mappings as JSON: ``redraft.core.options.flag_value``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from redraft.core import cli as ending
from redraft.core import options
from redraft.core.config import ConfigError
from redraft.core.options import config_section, flag_value, option

PROG = "redraft config"


@dataclass(kw_only=True)
class SettingsOptions:
    """The options of redraft config (redraft.core.options)."""

    file: str = option(help="a config file; a target's config is read at #STAGE (or --stage)", group="inputs",
                       positional=True, metavar="FILE[#STAGE]")
    stage: str | None = option(None, help="the section a target's config is read at without #STAGE (what that "
                                          "stage's command reads; a plain file is read whole)")
    env: bool = option(False, help="KEY=VALUE lines (upper-case keys) for a shell script")


def main(argv: Sequence[str] | None = None) -> int:
    args = options.parse(SettingsOptions, argv, prog=PROG, description=__doc__.split("\n\n")[0])
    where, mapping = config_section(args.file, args.stage)
    for key, value in mapping.items():
        text = flag_value(value)
        if args.env:
            if "\n" in text:
                raise ConfigError(f"{where}: {key} spans lines; a shell setting cannot hold it")
            print(f"{str(key).upper().replace('-', '_')}={text}")
        else:
            print(f"{key}: {text}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    return ending.run(lambda: main(argv), logging.getLogger("redraft.config"))


if __name__ == "__main__":
    sys.exit(cli())
