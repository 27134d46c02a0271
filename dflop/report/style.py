"""What every report plot shares: the Agg backend, colours, saving, and reading artifacts with
one-line errors that name the file and the missing column."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes; must come before pyplot
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from dflop.errors import UserError  # noqa: E402
from dflop.io import atomic_path, read_parquet  # noqa: E402

#: One colour per modality, the same in every plot (docs/design.md modalities, then the pooled "all").
MODALITY_COLOURS = {
    "text": "#8C8C8C",
    "image": "#4C72B0",
    "multi_image": "#55A868",
    "video": "#C44E52",
    "all": "#333333",
}
PLAN_COLOUR = "#4C72B0"
BASELINE_COLOUR = "#DD8452"
WGRAD_COLOUR = "#55A868"  # ZB-H1's W ops (as dflop.sim.gantt draws them)
DPI = 110


def modality_colour(modality: str) -> str:
    """The modality's colour; unknown modalities get matplotlib's default cycle."""
    return MODALITY_COLOURS.get(modality, f"C{sum(map(ord, modality)) % 10}")


def read_table(path: str | Path, what: str, columns: Iterable[str]) -> pd.DataFrame:
    """A Parquet artifact with at least `columns`; one-line UserError naming the file otherwise.

    what: the artifact's name for the message, e.g. "histograms.parquet".
    """
    frame = read_parquet(path, missing_hint=what)
    require_columns(frame, columns, f"{path}")
    return frame


def require_columns(frame: pd.DataFrame, columns: Iterable[str], where: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise UserError(f"{where}: missing column(s) {', '.join(missing)}")


def save_figure(fig: plt.Figure, path: str | Path) -> Path:
    """Write `fig` as PNG to `path` atomically (parent folders created) and close it; returns the path."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=DPI, format="png")
    finally:
        plt.close(fig)
    return path
