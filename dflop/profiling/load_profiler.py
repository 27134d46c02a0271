"""Loader profiler: how long the host takes to load one training sample, by its shape.

The trainer's loader (`dflop.runtime.loading.StepLoader`) reads, decodes, tiles and tokenises the
next step's samples in a background thread. On a GPU cluster that hides behind the step; on a CPU
cluster it runs on the very cores that compute, so a step pays its samples' loads. (The demo's
stage compute measured 2x its co-running module profile with the loader beside it, and 1.0-1.1x
with the loader run between steps.) This times the trainer's own code path,
`dflop.data.training.TrainingData` with pixels and tokens, on a seeded subsample of shapes.parquet
taken per modality, one thread, median of two loads after an untimed first pass (imports, codecs,
page cache), and writes load_profile.parquet (`LOAD_PROFILE_COLUMNS`); `dflop fit --loading` fits
the per-sample `dflop.costmodel.model.LoadLine` from it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from dflop.config import Config
from dflop.data.training import Request, TrainingData, pool_samples
from dflop.io import atomic_path
from dflop.models.handle import ModelHandle
from dflop.progress import progress
from dflop.shapes import read_shapes

log = logging.getLogger(__name__)

LOAD_PROFILE_COLUMNS = ("dataset", "sample_id", "modality", "n_tiles", "n_frames", "n_images", "text_tokens",
                        "load_s")
TIMED_LOADS = 2


def pick_samples(shapes: pd.DataFrame, per_modality: int, seed: int) -> pd.DataFrame:
    """Up to `per_modality` rows of each modality of `shapes` (seeded; all rows of a rarer one), in
    file order: a line fitted on them sees text, images, multi-image posts and videos alike."""
    rng = np.random.default_rng(seed)
    keep = []
    for _, rows in shapes.groupby("modality", sort=True):
        keep.extend(rng.choice(rows.index.to_numpy(), size=min(per_modality, len(rows)), replace=False))
    return shapes.loc[sorted(keep)].reset_index(drop=True)


def time_loads(data: TrainingData, *, repeats: int = TIMED_LOADS, show_progress: bool = True) -> np.ndarray:
    """Seconds of one full load (layout, tokens, pixels) of every sample of `data`: the median of
    `repeats` timed loads after one untimed load."""
    seconds = np.empty(len(data))
    with progress(len(data), "profile_loading", "sample", enabled=show_progress) as bar:
        for i in range(len(data)):
            request = Request(i, layout=True, tokens=True, pixels=True)
            data[request]
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                data[request]
                times.append(time.perf_counter() - start)
            seconds[i] = float(np.median(times))
            bar.update(1)
    return seconds


def profile_loading(cfg: Config, shapes_path: str | Path, out_path: str | Path) -> pd.DataFrame:
    """Time the loads of `cfg.data.load_profile_samples` samples per modality of shapes.parquet and
    write load_profile.parquet atomically (module docstring)."""
    shapes = read_shapes(shapes_path)
    picked = pick_samples(shapes, cfg.data.load_profile_samples, cfg.seed)
    data = TrainingData(pool_samples(picked, cfg.datasets, cfg.seed), ModelHandle.resolve(cfg.model).sample_rules())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each training rank runs (torchrun sets OMP_NUM_THREADS=1 per worker)
    try:
        seconds = time_loads(data)
    finally:
        torch.set_num_threads(threads)
    table = pd.DataFrame({
        "dataset": picked["dataset"].astype(str), "sample_id": picked["sample_id"].astype(str),
        "modality": picked["modality"].astype(str), "n_tiles": picked["n_tiles"].astype(np.int64),
        "n_frames": picked["n_frames"].astype(np.int64), "n_images": picked["n_images"].astype(np.int64),
        "text_tokens": picked["text_tokens"].astype(np.int64), "load_s": seconds})
    with atomic_path(out_path) as tmp:
        table.to_parquet(tmp, index=False)
    summary = table.groupby("modality")["load_s"].agg(["size", "median"])
    log.info("load profile of %d samples written to %s; median ms per modality: %s", len(table), out_path,
             ", ".join(f"{m} {1e3 * r['median']:.1f} ({int(r['size'])})" for m, r in summary.iterrows()))
    return table
