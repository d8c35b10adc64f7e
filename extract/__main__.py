"""`python -m extract`: the extraction stage's command line (see `--help`)."""

from __future__ import annotations

import logging
import sys

from core.config import ConfigError
from core.dataset.format import DatasetError
from core.engines.driver_protocol import EngineError
from extract.config import parse_args
from extract.records import BadRecordError

log = logging.getLogger("extract")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = parse_args(argv)
        from extract.pipeline import run_extraction  # heavy imports after argument checks

        summary = run_extraction(cfg)
    except (ConfigError, BadRecordError, DatasetError) as e:  # one line naming the option, record or file
        log.error("%s", e)
        return 2
    except FileNotFoundError as e:
        log.error("%s", e)
        return 2
    except EngineError as e:  # the engine failed (its log's first traceback is in the message), or is missing
        log.error("%s", e)
        return 1
    except ValueError as e:  # a target or engine setting refused before the engine starts, by key or layer
        log.error("%s", e)
        return 2
    except OSError as e:  # disk full, quota, I/O error: shards written so far are complete and kept
        log.error("write failed: %s; complete shards are kept: free space and rerun the same command to resume", e)
        return 1
    log.info("%s", summary.line())
    return 0


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as core.cli ends every command (one line and exit 2 on a mistake)."""
    from core import cli as ending

    return ending.run(lambda: main(argv), logging.getLogger("extract"), ())


if __name__ == "__main__":
    sys.exit(cli())
