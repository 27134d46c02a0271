"""Shape histograms per dataset and modality, from histograms.parquet (docs/design.md).

A sample's cost grows with its tiles (vision encoder) and tokens (LLM); these are the
distributions the planner and the online scheduler balance. One row of panels per dataset (and a
pooled row when there are several): samples per modality, then tiles, vision tokens, text tokens
and sequence length per sample as bars stacked by modality over the data profiler's bins (unit
bins for small counts, powers of two for tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from dflop.errors import UserError
from dflop.report.style import modality_colour, read_table, save_figure

HISTOGRAM_COLUMNS = ("dataset", "modality", "feature", "bin_lo", "bin_hi", "count", "frac")
ALL = "all"  # the profiler's name for a pooled dataset or modality
#: Features drawn, with their axis label.
FEATURES = {
    "n_tiles": "tiles per sample",
    "vision_tokens": "vision tokens per sample",
    "text_tokens": "text tokens per sample",
    "seq_len": "sequence length (tokens)",
}
_MODALITY_ORDER = ("text", "image", "multi_image", "video")


@dataclass(frozen=True)
class FeatureHistogram:
    """Sample counts of one feature of one dataset, split by modality.

    bin_lo, bin_hi: [n_bins] integer bin edges (a bin holds lo <= value < hi), empty bins at both
    ends trimmed; counts: [n_modalities, n_bins] samples; modalities in plotting order.
    """

    dataset: str
    feature: str
    modalities: tuple[str, ...]
    bin_lo: np.ndarray
    bin_hi: np.ndarray
    counts: np.ndarray

    def labels(self) -> list[str]:
        """'3' for a unit bin, '256–511' (an en dash) for a wider one."""
        return [str(lo) if hi - lo == 1 else f"{lo}\u2013{hi - 1}" for lo, hi in zip(self.bin_lo, self.bin_hi)]


def datasets_of(hist: pd.DataFrame) -> list[str]:
    """Datasets to draw: each one, preceded by the pooled 'all' when there are several."""
    names = sorted(set(hist["dataset"]) - {ALL})
    return [ALL, *names] if len(names) > 1 else names


def modality_counts(hist: pd.DataFrame, dataset: str) -> pd.Series:
    """Samples per modality of `dataset` ('all': pooled over datasets), in plotting order."""
    rows = _per_modality_rows(hist, dataset)
    first = rows["feature"].iloc[0] if len(rows) else None
    counts = rows[rows["feature"] == first].groupby("modality")["count"].sum()
    return counts.reindex(_ordered(counts.index)).astype(np.int64)


def feature_histogram(hist: pd.DataFrame, dataset: str, feature: str) -> FeatureHistogram:
    """Counts of `feature` per modality and bin for `dataset` ('all': pooled over datasets)."""
    rows = _per_modality_rows(hist, dataset)
    rows = rows[rows["feature"] == feature]
    if rows.empty:
        raise UserError(f"histograms.parquet: no rows for dataset {dataset!r}, feature {feature!r}")
    table = rows.pivot_table(index="modality", columns=["bin_lo", "bin_hi"], values="count", aggfunc="sum",
                             fill_value=0)
    table = table.reindex(_ordered(table.index)).sort_index(axis=1)
    counts = table.to_numpy(dtype=np.int64)
    nonzero = np.flatnonzero(counts.sum(axis=0))
    keep = slice(nonzero[0], nonzero[-1] + 1) if len(nonzero) else slice(0, 1)
    edges = np.asarray(table.columns.tolist(), dtype=np.int64)
    return FeatureHistogram(dataset, feature, tuple(table.index), edges[keep, 0], edges[keep, 1], counts[:, keep])


def draw_shape_histograms(hist: pd.DataFrame) -> plt.Figure:
    """The figure (module docstring) for a histograms.parquet table."""
    datasets = datasets_of(hist)
    if not datasets:
        raise UserError("histograms.parquet: no datasets")
    n_rows, n_cols = len(datasets), 1 + len(FEATURES)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(3.4 * n_cols, 1.0 + 3.0 * n_rows), squeeze=False,
                             gridspec_kw={"width_ratios": [0.7] + [1.0] * len(FEATURES)}, layout="constrained")
    seen: dict[str, object] = {}
    for r, dataset in enumerate(datasets):
        mix = modality_counts(hist, dataset)
        ax = axes[r, 0]
        ax.bar(range(len(mix)), mix.to_numpy(), color=[modality_colour(m) for m in mix.index])
        ax.set_xticks(range(len(mix)), [m.replace("_", "-") for m in mix.index], rotation=30, ha="right")
        ax.set_ylabel(f"{'all datasets' if dataset == ALL else dataset}\nsamples", fontsize=10)
        ax.set_title(f"{int(mix.sum())} samples by modality", fontsize=9)
        for c, (feature, label) in enumerate(FEATURES.items(), start=1):
            h = feature_histogram(hist, dataset, feature)
            ax = axes[r, c]
            bottom = np.zeros(h.counts.shape[1])
            for modality, counts in zip(h.modalities, h.counts):
                bars = ax.bar(np.arange(len(counts)), counts, bottom=bottom, width=0.9,
                              color=modality_colour(modality), label=modality)
                seen.setdefault(modality, bars)
                bottom += counts
            _bin_ticks(ax, h.labels())
            ax.set_xlabel(label, fontsize=9)
            ax.set_ylabel("samples", fontsize=9)
    order = _ordered(seen)
    fig.legend([seen[m] for m in order], [m.replace("_", "-") for m in order], title="modality",
               loc="outside upper right", ncol=len(order), fontsize=9)
    fig.suptitle("Sample shapes per dataset and modality (histograms.parquet, samples with status ok)",
                 x=0.01, ha="left", fontsize=12)
    return fig


def plot_shape_histograms(*, histograms: str | Path, out_png: str | Path) -> Path:
    """Read histograms.parquet, draw the shape histograms, write `out_png`; returns its path."""
    hist = read_table(histograms, "histograms.parquet", HISTOGRAM_COLUMNS)
    if hist.empty:
        raise UserError(f"{histograms}: no rows")
    return save_figure(draw_shape_histograms(hist), out_png)


def _per_modality_rows(hist: pd.DataFrame, dataset: str) -> pd.DataFrame:
    """Rows split by modality (never the pooled modality) of one dataset, or of all datasets."""
    rows = hist[hist["modality"] != ALL]
    if dataset == ALL:
        return rows[rows["dataset"] != ALL]
    return rows[rows["dataset"] == dataset]


def _ordered(modalities) -> list[str]:
    present = list(modalities)
    return [m for m in _MODALITY_ORDER if m in present] + sorted(m for m in present if m not in _MODALITY_ORDER)


def _bin_ticks(ax, labels: list[str]) -> None:
    """Every bin labelled when few, else about a dozen evenly spaced labels."""
    step = max(1, math.ceil(len(labels) / 12))
    ticks = list(range(0, len(labels), step))
    ranges = any("\u2013" in x for x in labels)
    ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=45 if ranges else 0, ha="right" if ranges else "center",
                  fontsize=8)
    ax.set_xlim(-0.6, len(labels) - 0.4)
