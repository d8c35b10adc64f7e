"""The built-in targets and data: names a user can pass instead of a folder (``--target smollm2-135m-instruct``,
``--target kimi-k25-mini``, ``--data mtbench``), where they are cached, and the recipe kimi-k25-mini is built
from. Every stage may read it; it imports only ``core`` (tests/unit/test_layering.py)."""
