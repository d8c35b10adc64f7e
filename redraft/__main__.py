"""``python -m redraft``: the ``redraft`` command."""

import sys

from redraft.cli import main

sys.exit(main())
