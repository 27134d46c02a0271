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

Like the model profiler, it loads on ``co_runners`` processes at once, in lockstep, and keeps the
first one's timings: the training ranks of a node load their samples at the same time, and on
this 2-core VM two loaders at once took 1.4-1.5x as long as one alone (video decoding most).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
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
                        "media_pixels", "load_s")
TIMED_LOADS = 2
BARRIER_TIMEOUT_S = 300  # the co-runners' start (imports) and one sample's loads


def pick_samples(shapes: pd.DataFrame, per_modality: int, seed: int) -> pd.DataFrame:
    """Up to `per_modality` rows of each modality of `shapes` (seeded; all rows of a rarer one), in
    file order: a line fitted on them sees text, images, multi-image posts and videos alike."""
    rng = np.random.default_rng(seed)
    keep = []
    for _, rows in shapes.groupby("modality", sort=True):
        keep.extend(rng.choice(rows.index.to_numpy(), size=min(per_modality, len(rows)), replace=False))
    return shapes.loc[sorted(keep)].reset_index(drop=True)


def time_loads(data: TrainingData, *, repeats: int = TIMED_LOADS, show_progress: bool = True,
               barrier=None) -> np.ndarray:
    """Seconds of one full load (layout, tokens, pixels) of every sample of `data`: the median of
    `repeats` timed loads after one untimed load; with a `barrier`, every process starts each
    sample together."""
    seconds = np.empty(len(data))
    with progress(len(data), "profile_loading", "sample", enabled=show_progress) as bar:
        for i in range(len(data)):
            request = Request(i, layout=True, tokens=True, pixels=True)
            data[request]
            if barrier is not None:
                barrier.wait()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                data[request]
                times.append(time.perf_counter() - start)
            seconds[i] = float(np.median(times))
            bar.update(1)
    return seconds


def _training_data(raw_config: dict, picked: pd.DataFrame) -> TrainingData:
    cfg = Config.from_dict(raw_config)
    return TrainingData(pool_samples(picked, cfg.datasets, cfg.seed), ModelHandle.resolve(cfg.model).sample_rules())


def _co_runner(raw_config: dict, picked: pd.DataFrame, barrier) -> None:
    """A second (third, ...) loader beside the timed one, in step with it (its timings are dropped)."""
    torch.set_num_threads(1)
    time_loads(_training_data(raw_config, picked), show_progress=False, barrier=barrier)


def profile_loading(cfg: Config, shapes_path: str | Path, out_path: str | Path, *, co_runners: int = 1) -> pd.DataFrame:
    """Time the loads of `cfg.data.load_profile_samples` samples per modality of shapes.parquet on
    `co_runners` processes at once and write load_profile.parquet atomically (module docstring)."""
    shapes = read_shapes(shapes_path)
    picked = pick_samples(shapes, cfg.data.load_profile_samples, cfg.seed)
    data = _training_data(dict(cfg.raw), picked)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each training rank runs (torchrun sets OMP_NUM_THREADS=1 per worker)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(co_runners, timeout=BARRIER_TIMEOUT_S) if co_runners > 1 else None
    others = [ctx.Process(target=_co_runner, args=(dict(cfg.raw), picked, barrier), daemon=True)
              for _ in range(co_runners - 1)]
    try:
        for process in others:
            process.start()
        seconds = time_loads(data, barrier=barrier)
    except BaseException as exc:
        if barrier is not None:  # co-runners waiting for this process would wait out their timeout
            barrier.abort()
        if isinstance(exc, threading.BrokenBarrierError):
            codes = [p.exitcode for p in others]
            raise RuntimeError(f"profile_loading: the co-running loaders fell out of step (exit codes {codes}; "
                               f"each waits {BARRIER_TIMEOUT_S} s for the others at every sample)") from None
        raise
    finally:  # not aborted after a normal end: a co-runner still leaving its last wait would see it broken
        torch.set_num_threads(threads)
        for process in others:
            process.join(timeout=BARRIER_TIMEOUT_S)
    failed = [p.exitcode for p in others if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"profile_loading: a co-running loader exited with {failed[0]}")
    table = pd.DataFrame({
        "dataset": picked["dataset"].astype(str), "sample_id": picked["sample_id"].astype(str),
        "modality": picked["modality"].astype(str), "n_tiles": picked["n_tiles"].astype(np.int64),
        "n_frames": picked["n_frames"].astype(np.int64), "n_images": picked["n_images"].astype(np.int64),
        "text_tokens": picked["text_tokens"].astype(np.int64),
        "media_pixels": picked.get("media_pixels", pd.Series(0, index=picked.index)).astype(np.int64),
        "load_s": seconds})
    with atomic_path(out_path) as tmp:
        table.to_parquet(tmp, index=False)
    summary = table.groupby("modality")["load_s"].agg(["size", "median"])
    log.info("load profile of %d samples (%d loading at once) written to %s; median ms per modality: %s",
             len(table), co_runners, out_path,
             ", ".join(f"{m} {1e3 * r['median']:.1f} ({int(r['size'])})" for m, r in summary.iterrows()))
    return table
