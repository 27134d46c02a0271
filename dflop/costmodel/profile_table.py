"""Read and check `model_profile.parquet`, and reduce its repeats to one row per shape.

The profile (docs/design.md) has one row per measurement: ``module, tp, batch, seq_len, n_layers,
fwd_ms, bwd_ms, act_bytes, param_bytes, peak_bytes, device, dtype, repeat`` (extra columns are
ignored), and optionally the layer modules' recompute targets ``bwd_ms:<mode>`` /
``act_bytes:<mode>`` (`OPTIONAL_TARGETS`; NaN where not measured: other modules, and repeats past
the mode's fewer runs), ``transient_bytes`` (every module) and ``transient_bytes:<mode>`` (layer
modules), and ``tied_bytes`` (the LM head's bytes that are the token embedding's; absent in older
profiles: 0). Layer modules may be profiled as a stack of ``n_layers`` layers; costs are divided by
``n_layers`` here so every fitted layer cost is per layer, except the transients: a stack runs one
layer at a time.

A profile from before the profiler measured transients has no ``transient_bytes`` column; where
its ``peak_bytes`` (the CUDA allocator's peak above what was allocated before the run) are
measured, the transient is derived as ``peak_bytes - act_bytes - grad_bytes``, at least 0 (mode
none only). That is a lower bound of what the profiler now measures: those runs began without
gradients, so the peak of a module whose gradients come after it (the LM head: the loss's backward,
then the weight's gradient) did not hold them, and the saved inputs made before the run count in
``act_bytes`` but not in the peak.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from dflop.costmodel.features import LAYER_MODULES, MODULE_FEATURES, ShapeKind
from dflop.costmodel.model import OPTIONAL_TARGETS, TARGETS, TRANSIENT
from dflop.profiling.columns import LINK_MODULES, TRANSIENT_TARGETS
from dflop.errors import UserError
from dflop.finite import Numbers, check_columns
from dflop.io import read_parquet

log = logging.getLogger(__name__)

# Numbers some rows lack (NaN): CUDA peaks on CPU, gradient bytes, optimizer and link timings.
MEASURED_IF_PRESENT = ("peak_bytes", "grad_bytes", "optim_bytes", "optim_ms", "optim_call_ms", "bytes")
REQUIRED_COLUMNS = (
    "module", "tp", "batch", "seq_len", "n_layers", "fwd_ms", "bwd_ms", "act_bytes", "param_bytes",
    "device", "dtype",
)
NUMERIC_COLUMNS = ("tp", "batch", "seq_len", "n_layers", "repeat", "fwd_ms", "bwd_ms", "act_bytes", "param_bytes",
                   "tied_bytes")


@dataclass(frozen=True)
class ProfileSummary:
    """Per-shape medians of a profile and where it came from.

    shapes: one row per (module, tp, batch, seq_len) with columns module, tp, batch, seq_len,
        fwd_ms, bwd_ms, act_bytes, param_bytes (per layer for layer modules), tied_bytes, n_repeats, and the
        `OPTIONAL_TARGETS` the profile has (median of the measured repeats; NaN for a shape
        without any).
    step_costs: the step's costs outside the modules (`dflop.profiling.step_costs`), one row per
        measured point: ``kind`` (optimizer | optimizer_call | allreduce | p2p), ``ranks``,
        ``bytes``, ``ms`` (medians; optimizer: a module's parameter bytes on one rank and its AdamW
        step, with its ``module``, ``tp`` and ``n_layers``, NaN on the other kinds; optimizer_call:
        that step over one one-element parameter, 4 bytes); None for a profile without them.
    """

    shapes: pd.DataFrame
    device: str
    dtype: str
    preset: str | None
    n_rows: int
    step_costs: pd.DataFrame | None = None


def read_profile(path: str | Path) -> ProfileSummary:
    """Load and check a model profile; every problem is one line naming the file and row."""
    table = read_parquet(path, missing_hint="run `dflop profile-model` first")
    return summarize_profile(table, source=str(path))


def summarize_profile(table: pd.DataFrame, *, source: str = "model profile") -> ProfileSummary:
    """Check a profile table and reduce it to per-shape medians (see `ProfileSummary`)."""
    missing = [c for c in REQUIRED_COLUMNS if c not in table.columns]
    if missing:
        raise UserError(f"{source}: missing column(s) {', '.join(missing)}")
    if table.empty:
        raise UserError(f"{source}: no rows")
    device = _single_value(table, "device", source)
    dtype = _single_value(table, "dtype", source)
    preset = _single_value(table, "preset", source) if "preset" in table.columns else None

    # Numbers and no infinity in every row first (link rows have NaN shapes), before any arithmetic;
    # _check_values then holds the module rows to their ranges.
    anywhere = {c: Numbers(None, missing_ok=True) for c in (*NUMERIC_COLUMNS, *OPTIONAL_TARGETS)}
    check_columns(table, source, {**anywhere, **{c: Numbers(0, missing_ok=True) for c in MEASURED_IF_PRESENT}},
                  _row_name(table))
    named = table["module"].map(lambda v: isinstance(v, str)).to_numpy(dtype=bool)
    if not named.all():
        i = int(np.flatnonzero(~named)[0])
        raise UserError(f"{source}: row {table.index[i]} has module={table['module'].iloc[i]!r} "
                        "(must be a module name)")
    step_costs = _step_costs(table, source)
    unknown = sorted(set(table["module"]) - set(MODULE_FEATURES) - set(LINK_MODULES))
    if unknown:
        log.warning("%s: ignoring module(s) without a cost model: %s", source, ", ".join(unknown))
    table = table[table["module"].isin(list(MODULE_FEATURES))]
    if table.empty:
        raise UserError(f"{source}: no known modules; expected some of {', '.join(MODULE_FEATURES)}")
    if "tied_bytes" not in table.columns:
        table = table.assign(tied_bytes=0.0)
    _check_values(table, source, [c for c in OPTIONAL_TARGETS if c in table.columns])
    if TRANSIENT not in table.columns:
        table = _derived_transients(table)  # from checked numbers: finite or NaN (not measured)
    optional = [c for c in OPTIONAL_TARGETS if c in table.columns]

    per_layer = table.copy()
    stacked = per_layer["module"].isin(list(LAYER_MODULES))
    transients = set(TRANSIENT_TARGETS.values())
    for column in (*TARGETS, *(c for c in optional if c not in transients), "param_bytes"):
        per_layer[column] = per_layer[column].astype(np.float64)
        per_layer.loc[stacked, column] = per_layer.loc[stacked, column] / per_layer.loc[stacked, "n_layers"]

    keys = ["module", "tp", "batch", "seq_len"]
    grouped = per_layer.groupby(keys, sort=True)
    shapes = grouped[[*TARGETS, *optional, "param_bytes", "tied_bytes"]].median()  # skips NaN
    shapes["n_repeats"] = grouped.size()
    shapes = shapes.reset_index()
    for column in ("tp", "batch", "seq_len"):
        shapes[column] = shapes[column].astype(np.int64)
    _check_tile_size(shapes, source)
    _warn_varying_params(shapes, source)
    return ProfileSummary(shapes=shapes, device=device, dtype=dtype, preset=preset, n_rows=len(table),
                          step_costs=step_costs)


def _derived_transients(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with ``transient_bytes`` derived from a profile's CUDA peaks (module docstring), NaN
    where no peak was measured (a CPU profile: none, and its model then has no transients)."""
    if "peak_bytes" not in table.columns:
        return table
    grads = table["grad_bytes"] if "grad_bytes" in table.columns else table["param_bytes"]
    derived = pd.to_numeric(table["peak_bytes"], errors="coerce") - table["act_bytes"] - grads
    return table.assign(**{TRANSIENT: derived.clip(lower=0.0)})


def _step_costs(table: pd.DataFrame, source: str) -> pd.DataFrame | None:
    """Medians of the optimizer and link measurements (`ProfileSummary.step_costs`)."""
    parts = []
    if "optim_ms" in table.columns:
        modules = table[table["module"].isin(list(MODULE_FEATURES)) & table["optim_ms"].notna()
                        & (table["param_bytes"] > 0)]
        optim = modules.groupby(["module", "tp"])[["param_bytes", "optim_ms", "n_layers"]].median().reset_index()
        parts.append(pd.DataFrame({"kind": "optimizer", "ranks": 1, "bytes": optim["param_bytes"],
                                   "ms": optim["optim_ms"], "module": optim["module"], "tp": optim["tp"],
                                   "n_layers": optim["n_layers"]}))
        if "optim_call_ms" in table.columns and table["optim_call_ms"].notna().any():
            parts.append(pd.DataFrame({"kind": ["optimizer_call"], "ranks": [1], "bytes": [4.0],
                                       "ms": [float(table["optim_call_ms"].median())]}))
    if "bytes" in table.columns:
        links = table[table["module"].isin(list(LINK_MODULES))]
        links = links.groupby(["module", "batch", "bytes"])["fwd_ms"].median().reset_index()
        parts.append(pd.DataFrame({"kind": links["module"], "ranks": links["batch"], "bytes": links["bytes"],
                                   "ms": links["fwd_ms"]}))
    rows = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    if rows.empty:
        return None
    bad = ~np.isfinite(rows[["ranks", "bytes", "ms"]].to_numpy(dtype=np.float64)).all(axis=1) | (rows["ms"] < 0)
    if bad.any():
        row = rows[bad].iloc[0]
        raise UserError(f"{source}: {row['kind']} measurement at {row['bytes']} bytes over {row['ranks']} ranks "
                        f"is {row['ms']} ms (must be a finite number >= 0)")
    return rows.astype({"ranks": np.int64, "bytes": np.float64, "ms": np.float64})


def _single_value(table: pd.DataFrame, column: str, source: str) -> str:
    values = sorted(str(v) for v in table[column].dropna().unique())
    if len(values) != 1:
        found = ", ".join(values) if values else "none"
        raise UserError(f"{source}: column {column!r} must hold one value per profile, found: {found}")
    return values[0]


def _check_values(table: pd.DataFrame, source: str, optional: list[str]) -> None:
    """Required numbers finite, numeric and in range; optional targets may be missing (NaN), not
    infinite or negative. n_layers only counts on layer modules."""
    counts = {c: Numbers(1, whole=True) for c in ("tp", "batch", "seq_len")}
    counts["repeat"] = Numbers(0, whole=True)
    costs = {c: Numbers(0) for c in (*TARGETS, "param_bytes", "tied_bytes")}
    check_columns(table, source, {**counts, **costs, **{c: Numbers(0, missing_ok=True) for c in optional}},
                  _row_name(table))
    layers = table[table["module"].isin(list(LAYER_MODULES))]
    check_columns(layers, source, {"n_layers": Numbers(1, whole=True)}, _row_name(layers))


def _row_name(table: pd.DataFrame):
    """A row of the profile as errors name it: its position in the file and its shape."""
    def name(i: int) -> str:
        row = table.iloc[i]
        return (f"row {table.index[i]} (module={row['module']} tp={row['tp']} batch={row['batch']} "
                f"seq_len={row['seq_len']})")
    return name


def _check_tile_size(shapes: pd.DataFrame, source: str) -> None:
    """Tile modules model cost per tile, which is only meaningful for one tile size per model."""
    for (module, tp), group in shapes.groupby(["module", "tp"]):
        if MODULE_FEATURES[module][0] is ShapeKind.TILES and group["seq_len"].nunique() > 1:
            sizes = ", ".join(str(s) for s in sorted(group["seq_len"].unique()))
            raise UserError(
                f"{source}: {module} at tp={tp} profiled with several patches per tile ({sizes}); "
                "the cost model assumes one tile size per vision tower"
            )


def _warn_varying_params(shapes: pd.DataFrame, source: str) -> None:
    for (module, tp), group in shapes.groupby(["module", "tp"]):
        values = group["param_bytes"].to_numpy()
        if values.max() > values.min() * 1.001:
            log.warning("%s: param_bytes of %s at tp=%s varies with the shape (%g..%g); using the median",
                        source, module, tp, values.min(), values.max())
