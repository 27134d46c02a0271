"""shapes.parquet, the data profiler's output that every later stage reads: its schema and its
one reader.

One row per sample (docs/design.md): ``sample_id`` (stable across runs), ``dataset``, ``modality``
(text|image|multi_image|video), ``n_images``, ``n_frames``, ``n_tiles`` (inputs the vision encoder
processes), ``vision_tokens`` (tokens spliced into the LLM sequence), ``text_tokens``, ``seq_len``
(= text_tokens + vision_tokens), ``media_pixels`` (pixels the training loader decodes: each image's
width x height, and every frame of the video file, since the sampled frames are reached by decoding
the ones before them; what a sample's load costs, `dflop.costmodel.model.LoadLine`) and ``status``
(``ok`` or ``skipped:<reason>``). The planner, the trainer and the benchmarks use the ``ok`` rows in
file order: `read_shapes`. A file written before ``media_pixels`` existed still reads (its loads
are then priced without it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from dflop.errors import UserError
from dflop.finite import Numbers, check_columns
from dflop.io import read_parquet

SHAPES_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("modality", pa.string()),
        ("n_images", pa.int32()),
        ("n_frames", pa.int32()),
        ("n_tiles", pa.int32()),
        ("vision_tokens", pa.int64()),
        ("text_tokens", pa.int64()),
        ("seq_len", pa.int64()),
        ("media_pixels", pa.int64()),
        ("status", pa.string()),
    ]
)
SHAPE_COLUMNS = tuple(SHAPES_SCHEMA.names)
OPTIONAL_COLUMNS = ("media_pixels",)  # added later: a file without it still reads
OK = "ok"
# What every use of a row needs, and the smallest value each numeric column may take.
NEEDED = ("sample_id", "n_tiles", "seq_len")
MINIMUM = {"n_images": 0, "n_frames": 0, "n_tiles": 0, "vision_tokens": 0, "text_tokens": 0, "seq_len": 1,
           "media_pixels": 0}


def check_shapes(shapes: pd.DataFrame, where: str = "shapes", *, columns=NEEDED) -> None:
    """One-line UserError naming the column or the sample unless `shapes` has `columns` and whole,
    finite, non-negative sizes (seq_len >= 1) of a numeric dtype in every numeric column it has."""
    missing = [c for c in columns if c not in shapes.columns]
    if missing:
        raise UserError(f"{where}: missing column(s) {', '.join(missing)} (expected shapes.parquet columns "
                        f"{', '.join(SHAPE_COLUMNS)}; not a shapes.parquet?)")
    check_columns(shapes, where, {column: Numbers(minimum, whole=True) for column, minimum in MINIMUM.items()},
                  lambda i: f"sample {shapes['sample_id'].iloc[i]!r}")


def usable(shapes: pd.DataFrame, where: str = "shapes", *, columns=NEEDED) -> pd.DataFrame:
    """The ``ok`` rows of a shapes table, in file order, checked (`check_shapes`), index 0..n-1."""
    if "status" in shapes.columns:
        shapes = shapes[shapes["status"] == OK]
    if shapes.empty:
        raise UserError(f"{where}: no sample with status '{OK}'")
    check_shapes(shapes, where, columns=columns)
    return shapes.reset_index(drop=True)


def numpy_backed(shapes: pd.DataFrame) -> pd.DataFrame:
    """`shapes` with its string columns held as Python objects. With pandas' Arrow-backed strings,
    taking a global batch's rows is a pyarrow take per column that gives up the GIL and waits to
    re-take it from rank 0's scheduler thread (DEVELOPERS.md), on the step's critical path on
    CPU."""
    strings = {c: object for c in shapes.columns if pd.api.types.is_string_dtype(shapes[c].dtype)
               and shapes[c].dtype != object}
    return shapes.astype(strings) if strings else shapes


def check_unique_ids(shapes: pd.DataFrame, where: str = "shapes") -> None:
    """One-line UserError naming the first (dataset, sample_id) on two rows. The trainer finds a
    row's sample by that pair, so a repeated one would load another record than the one planned."""
    if not {"dataset", "sample_id"} <= set(shapes.columns):
        return  # `usable` names the missing column
    repeats = np.flatnonzero(shapes.duplicated(["dataset", "sample_id"]).to_numpy())
    if repeats.size:
        second = int(repeats[0])
        dataset, sample_id = shapes["dataset"].iloc[second], shapes["sample_id"].iloc[second]
        first = int(np.flatnonzero(((shapes["dataset"] == dataset) & (shapes["sample_id"] == sample_id)).to_numpy())[0])
        raise UserError(f"{where}: sample {dataset}/{sample_id} is on rows {first} and {second}; each "
                        "(dataset, sample_id) must be on one row (re-run profile_data)")


def read_shapes(path: str | Path) -> pd.DataFrame:
    """The usable rows of shapes.parquet (`usable`, every schema column required, ids unique:
    `check_unique_ids`); one-line errors for a missing, unreadable or foreign file."""
    table = read_parquet(path, missing_hint="no shapes file: run `dflop profile-data` first")
    check_unique_ids(table, str(path))
    return usable(table, str(path), columns=[c for c in SHAPE_COLUMNS if c not in OPTIONAL_COLUMNS])
