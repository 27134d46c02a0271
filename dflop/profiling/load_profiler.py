"""Loader profiler: how long the host takes to load one training sample, by its shape.

The trainer's loader (`dflop.runtime.loading.StepLoader`) reads, decodes, tiles and tokenises the
next step's samples in a background thread. On a GPU cluster that hides behind the step; on a CPU
cluster it runs on the very cores that compute, so a step pays its samples' loads (found with
`benchmarks/step_parts/`: the demo's stage compute slowed with the loader beside it). This times the trainer's own code path,
`dflop.data.training.TrainingData` with pixels and tokens, on a seeded subsample of shapes.parquet
taken per modality, one thread, and writes load_profile.parquet (`LOAD_PROFILE_COLUMNS`); `dflop fit
--loading` fits the per-sample `dflop.costmodel.model.LoadLine` from it.

A sample's time is the mean of its loads over interleaved passes (`time_loads`) that together take
at least ``data.load_profile_seconds``. The CPU machines this charges loads on change speed for
seconds at a time (`benchmarks/bench_machine_phases.py`): a profile of a few seconds reads one or
two phases of the machine, a level error that every step's predicted loads inherit; a longer one
varies less from profile to profile (`benchmarks/bench_load_line.py --profiles`). The mean over the passes is what a run of steps pays
(the median would keep the common, faster phase).

Like the model profiler, it loads on ``co_runners`` processes at once, in lockstep, and keeps the
first one's timings: the training ranks of a node load their samples at the same time, and on a
machine of few cores two loaders at once take longer than one alone.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import sys
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
MIN_PASSES = 2  # timed passes over the samples, at least (and the count a zero time budget gives)
MAX_PASSES = 16
BARRIER_TIMEOUT_S = 300  # the co-runners' start (imports) and untimed pass, and one sample's loads


def pick_samples(shapes: pd.DataFrame, per_modality: int, seed: int) -> pd.DataFrame:
    """Up to `per_modality` rows of each modality of `shapes` (seeded; all rows of a rarer one), in
    file order: a line fitted on them sees text, images, multi-image posts and videos alike."""
    rng = np.random.default_rng(seed)
    keep = []
    for _, rows in shapes.groupby("modality", sort=True):
        keep.extend(rng.choice(rows.index.to_numpy(), size=min(per_modality, len(rows)), replace=False))
    return shapes.loc[sorted(keep)].reset_index(drop=True)


def time_loads(data: TrainingData, *, seconds: float = 0.0, show_progress: bool = True, barrier=None,
               shared_passes=None, leads: bool = True, clock=time.perf_counter) -> np.ndarray:
    """Seconds of one full load (layout, tokens, pixels) of every sample of `data`: the mean over
    timed passes through all samples, after one untimed pass (imports, codecs, page cache).

    There are `MIN_PASSES` timed passes, or as many as fill `seconds` of timed loading at the
    first pass's pace (at most `MAX_PASSES`): each sample's loads then lie far apart, so they
    sample the machine's slow and fast phases as the steps of a training run do. With a `barrier`,
    every process starts each sample together, and the pass count is the leading process's (`leads`),
    handed to the others in `shared_passes` (a ``multiprocessing.Value``).
    """
    requests = [Request(i, layout=True, tokens=True, pixels=True) for i in range(len(data))]
    for request in requests:
        data[request]
    totals = np.zeros(len(data))
    passes, done = MIN_PASSES, 0
    with progress(None, "profile_loading", "sample-load", enabled=show_progress) as bar:
        while done < passes:
            for i, request in enumerate(requests):
                if barrier is not None:
                    barrier.wait()
                start = clock()
                data[request]
                totals[i] += clock() - start
                bar.update(1)
            done += 1
            if done == 1:
                passes = _agree_passes(float(totals.sum()), seconds, barrier, shared_passes, leads)
                bar.total = len(data) * passes  # known from here on: the log's lines give a share
    if leads:
        log.info("%d samples timed in %d interleaved passes, %.1f s of loading", len(data), done, totals.sum())
    return totals / done


def _agree_passes(first_pass_s: float, seconds: float, barrier, shared_passes, leads: bool) -> int:
    """The timed passes of the profile: enough to fill `seconds` at the first pass's pace, within
    [MIN_PASSES, MAX_PASSES]; the leading process decides and its co-runners read its answer."""
    if barrier is not None and not leads:
        barrier.wait()
        return int(shared_passes.value)
    wanted = math.ceil(min(seconds / first_pass_s, MAX_PASSES)) if first_pass_s > 0 else MIN_PASSES
    passes = min(max(wanted, MIN_PASSES), MAX_PASSES)
    if barrier is not None:
        shared_passes.value = passes
        barrier.wait()
    return passes


def _training_data(raw_config: dict, picked: pd.DataFrame) -> TrainingData:
    cfg = Config.from_dict(raw_config)
    return TrainingData(pool_samples(picked, cfg.datasets, cfg.seed), ModelHandle.resolve(cfg.model).sample_rules())


def _co_runner(raw_config: dict, picked: pd.DataFrame, barrier, shared_passes) -> None:
    """A second (third, ...) loader beside the timed one, in step with it (its timings are dropped)."""
    torch.set_num_threads(1)
    time_loads(_training_data(raw_config, picked), show_progress=False, barrier=barrier,
               shared_passes=shared_passes, leads=False)


def profile_loading(cfg: Config, shapes_path: str | Path, out_path: str | Path, *, co_runners: int = 1) -> pd.DataFrame:
    """Time the loads of `cfg.data.load_profile_samples` samples per modality of shapes.parquet on
    `co_runners` processes at once, over `cfg.data.load_profile_seconds`, and write
    load_profile.parquet atomically (module docstring)."""
    shapes = read_shapes(shapes_path)
    picked = pick_samples(shapes, cfg.data.load_profile_samples, cfg.seed)
    data = _training_data(dict(cfg.raw), picked)
    # Built before the fork, so the co-runners inherit the tokenizer and the image-processing
    # modules instead of each building them again (seconds, untimed either way).
    data.prepare(tokens=True, pixels=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each training rank runs (torchrun sets OMP_NUM_THREADS=1 per worker)
    # Forked on Linux, as the data profiler's workers: a spawned co-runner spends seconds importing
    # torch and transformers again before its first load (the loads are timed in step, not its start).
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    barrier = ctx.Barrier(co_runners, timeout=BARRIER_TIMEOUT_S) if co_runners > 1 else None
    shared_passes = ctx.Value("i", 0) if co_runners > 1 else None
    others = [ctx.Process(target=_co_runner, args=(dict(cfg.raw), picked, barrier, shared_passes), daemon=True)
              for _ in range(co_runners - 1)]
    try:
        for process in others:
            process.start()
        seconds = time_loads(data, seconds=cfg.data.load_profile_seconds, barrier=barrier,
                             shared_passes=shared_passes)
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
