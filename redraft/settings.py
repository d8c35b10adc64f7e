"""``redraft config FILE[#STAGE] [--stage NAME] [--env]``: the settings a stage reads from a config file, as it reads them.

A target's one config (``configs/kimi-k25.yaml``) holds every stage's section; this prints one section with the
aliases resolved, as ``key: value`` lines, or with ``--env`` as ``KEY=VALUE`` lines for a shell script
(``slurm/serve.sh`` reads its ``serve`` section so). Lists and mappings are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from redraft.core import cli as ending
from redraft.core.config import ConfigError
from redraft.core.options import config_section

PROG = "redraft config"


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("config", metavar="FILE[#STAGE]", help="a config file; a target's config needs #STAGE")
    parser.add_argument("--stage", default=None, help="the section a target's config is read at without #STAGE "
                        "(what that stage's command reads; a plain file is read whole)")
    parser.add_argument("--env", action="store_true", help="KEY=VALUE lines (upper-case keys) for a shell script")
    args = parser.parse_args(argv)
    where, mapping = config_section(args.config, args.stage)
    for key, value in mapping.items():
        text = _text(value)
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
