"""Notebook plumbing, not library code: a headless-safe matplotlib and one place figures are saved.

Every figure of notebook ``NN_name`` goes to ``notebooks/figures/NN_name/<figure>.png`` (gitignored),
whether the notebook runs in Jupyter, under nbclient in CI, or as ``python notebooks/NN_name.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import matplotlib

# Headless (CI, ssh, a plain script): Agg renders to files without a display.
if "MPLBACKEND" not in os.environ and "ipykernel" not in sys.modules and not os.environ.get("DISPLAY"):
    matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

FIGURES = Path(os.environ.get("MEGAMOE_NB_FIGURES", Path(__file__).resolve().parent / "figures"))
REPO = Path(__file__).resolve().parent.parent


class Figures:
    """``figs = Figures("01_routing_dispatch")``; ``figs.save(fig, "histogram")`` writes the PNG
    and shows the figure where a display or an inline backend exists."""

    def __init__(self, notebook: str) -> None:
        self.dir = FIGURES / notebook
        self.dir.mkdir(parents=True, exist_ok=True)
        self.saved: list[Path] = []
        plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 110, "axes.grid": True, "grid.alpha": 0.3})

    def save(self, fig, name: str) -> Path:
        path = self.dir / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path)
        self.saved.append(path)
        if matplotlib.get_backend().lower() == "agg":
            plt.close(fig)
        else:
            plt.show()
        print(f"figure: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
        return path


RESULTS = REPO / "bench" / "results"


def cited(key: str = "sweep") -> Path:
    """The results folder or file the README cites for ``key``, from ``bench/results/CITED.json`` (the
    one place that names it), so that a notebook plots the run the README quotes, not the newest one."""
    import json

    names = json.loads((RESULTS / "CITED.json").read_text())
    if key not in names or key == "about":
        raise KeyError(f"bench/results/CITED.json has no {key!r}; it names {sorted(k for k in names if k != 'about')}")
    path = RESULTS / names[key]
    if not path.exists():
        raise FileNotFoundError(f"bench/results/CITED.json names {names[key]!r} for {key!r}, but {path} does not exist")
    return path
