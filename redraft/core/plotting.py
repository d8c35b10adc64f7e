"""Figures: every stage's plots (acceptance, serving, benchmark reports) are written through here.

matplotlib is imported lazily (it is slow to import and only plotting commands need it), the
headless Agg backend is used, and the PNG goes through :func:`redraft.core.atomic.atomic_open`, so a
killed run never leaves half an image under the final name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from redraft.core.atomic import atomic_open


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend (no display on clusters or CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def atomic_write_png(fig: Any, path: str | Path, dpi: int = 110) -> None:
    """Save a matplotlib figure as PNG through atomic_open, then close it (also when saving fails)."""
    plt = pyplot()
    try:
        with atomic_open(path, "wb") as f:
            fig.savefig(f, format="png", dpi=dpi)
    finally:
        plt.close(fig)
