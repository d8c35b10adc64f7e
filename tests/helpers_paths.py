"""Where the tests find the repository and their data files, wherever in tests/ a test lives."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"
FIXTURES = TESTS / "fixtures"
