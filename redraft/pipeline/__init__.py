"""Commands that run several stages for a user, each stage as its own process (``python -m STAGE``), meeting
only in the files they write. The stages never run each other; this package is the one place that chains
them (tests/unit/test_layering.py holds both)."""
