"""matplotlib for the pages' plots: the headless backend, and a figure saved atomically under its final name."""

from __future__ import annotations

from pathlib import Path

from eagle_backbone.io import atomic_path


def pyplot():
    """(matplotlib, pyplot) on the Agg backend: plots are files, never windows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return matplotlib, plt


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """``fig`` laid out, written to ``path`` through a temporary name (the suffix kept: matplotlib picks the
    format by it), and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_path(path, keep_suffix=True) as tmp:
        fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    return Path(path)
