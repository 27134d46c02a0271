"""Model profiler: forward/backward time and memory of each model part over an adaptive shape grid,
for each tensor-parallel degree -> ``model_profile.parquet`` (docs/design.md).

One row per measured repeat:
    module, tp, batch, seq_len, n_layers, fwd_ms, bwd_ms, act_bytes, param_bytes, peak_bytes,
    device, dtype, repeat
plus grad_bytes, optim_bytes (Adam), tied_bytes (the LM head's weight when the model ties it to the
token embedding, else 0: `ModuleBench.tied_bytes`), preset, threads, co_runners and round (0 = coarse grid, k = k-th
refinement), and for the layer modules a stage may recompute (vision_layer, llm_layer)
``bwd_ms:<mode>``, ``act_bytes:<mode>`` and ``transient_bytes:<mode>`` for recompute selective and
full (NaN for the other modules; `_measure_round` says how many of a shape's rows have a
``bwd_ms:<mode>``). Modules and shapes are described in `dflop.profiling.model_modules`. Per rank:
param/grad/optim bytes are exact from the module, act_bytes is exact (tensors saved for
backward, `_memory.saved_tensor_bytes`), peak_bytes is the CUDA allocator peak during forward +
backward above what was allocated before it (NaN on CPU), and transient_bytes is what the forward
+ backward holds at its peak beyond its saved tensors, on any device (`_measured_run`). Times are milliseconds: CUDA events on
GPU, perf_counter on CPU, after `warmup` (at least 1) untimed runs, `repeats` of them or more for
light shapes (until they add up to `min_measure_ms`, at most `max_repeats`); every repeat is stored
(the cost models take the median). A round's repeats are taken in interleaved passes over all its
shapes, so a seconds-long slow phase of the machine touches one repeat of many shapes rather than
every repeat of one (`_measure_round`). Before the first shape, every curve's largest shape runs
once untimed, so the process's memory is warmed up before anything is timed.

Each module's rows also carry ``optim_ms`` (its parameters' AdamW step) and ``optim_call_ms`` (that
step's cost beyond any tensor), and a profile taken by
several ranks has ``allreduce`` and ``p2p`` rows (``batch`` = ranks, ``bytes`` = message size,
``fwd_ms`` = time; the shape, byte-count and recompute columns NaN): the step's costs outside the modules,
`dflop.profiling.step_costs`.

A profiling world of one rank (TP 1, no co-runners) runs in this process; a larger one (TP > 1,
or co-runners) runs in worker processes launched with torchrun (`dflop.profiling.model_tp_worker`;
gloo and one thread per rank on CPU, NCCL on GPU); rank 0 times after a barrier and all ranks
follow rank 0's grid decisions.

``co_runners``: ranks that share the machine while it is measured. The trainer runs one rank per
"GPU" of a node; on CPU those ranks share the node's cores and memory bandwidth, and a module
measured alone runs faster than the same module while a second rank computes (about 2x on a
2-core machine: benchmarks/README.md, "The demo"). So with ``co_runners`` = k > tp, k // tp groups of
``tp`` ranks run the same sweep in lockstep (one barrier per shape for the whole world) and rank 0's
timings are kept: the profile is what a training rank sees. On GPU each rank has its own device: 1.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch
import torch.distributed as dist
from transformers import PreTrainedConfig

from dflop.config import ProfileSection
from dflop.profiling.columns import LINK_MODULES, RECOMPUTE_TARGETS, TRANSIENT_TARGETS
from dflop.cpu_memory import reuse_large_cpu_allocations
from dflop.errors import UserError
from dflop.io import atomic_path
from dflop.progress import progress as progress_counter
from dflop.models.architectures import Architecture, architecture
from dflop.models.builder import model_config
from dflop.models.packing import select_packed_kernel, selected_packed_kernel
from dflop.models.precision import Precision
from dflop.models.handle import ModelHandle
from dflop.models.info import llm_tp_divides, projector_tp_divides, vision_tp_divides
from dflop.models.tensor_parallel import TPGroup
from dflop.profiling._memory import adam_state_bytes, allocated_peak, grad_bytes, param_bytes, saved_tensor_bytes
from dflop.profiling._timing import Timer
from dflop.profiling.model_grid import AdaptiveCurve, geometric_points
from dflop.profiling.model_modules import MODULES, RECOMPUTE_MODES, TILE_MODULES, ModuleBench, build_benches
from dflop.profiling.step_costs import link_rows, optimizer_call_ms, optimizer_step_ms

log = logging.getLogger(__name__)

COLUMNS = ("module", "tp", "batch", "seq_len", "n_layers", "fwd_ms", "bwd_ms", "act_bytes", "param_bytes",
           "peak_bytes", "device", "dtype", "repeat", "grad_bytes", "optim_bytes", "tied_bytes", "preset", "threads", "co_runners",
           "round", "optim_ms", "optim_call_ms", "bytes", TRANSIENT_TARGETS["none"],
           *(column for mode in RECOMPUTE_MODES for column in (*RECOMPUTE_TARGETS[mode], TRANSIENT_TARGETS[mode])))


@dataclass(frozen=True)
class ProfileSettings:
    """Shape grid and measurement settings.

    max_tiles: largest tiles per microbatch for vision modules (grid 1, 2, 3, 4, 6, 8, 11, 16, ...:
        `TILE_GRID_RATIO`).
    max_seq_len: largest packed row (tokens) for LLM modules; per-sample lengths go from
        min_seq_len up, and rows pack batch = 1, 4, 16, ... samples of equal length.
    time_budget_s: soft wall-time budget per TP degree; the coarse grid always completes,
        refinement stops once it is spent.
    tol: relative interpolation error that makes the grid refine an interval; misses smaller
        than abs_tol_ms or than the repeats' interquartile range are noise and never do.
    repeats: timed runs per shape at least, and the number of interleaved passes a round makes
        over its shapes; min_measure_ms: a shape whose first run (forward + backward) times
        `repeats` is less than this gets more runs, up to max_repeats, so the median of a light
        module is not at the mercy of one or two disturbed runs; a shape whose first run alone is
        less than this is also warmed up again before each pass (`_measure_round`).
    recompute_share: timed runs of each recompute mode (selective, full) of a layer module's shape,
        as a share of its mode-none runs (at least min(2, those)); 0 measures mode none only.
    """

    max_tiles: int = 16
    max_seq_len: int = 2048
    min_seq_len: int = 32
    repeats: int = 5
    warmup: int = 2
    min_measure_ms: float = 50.0
    max_repeats: int = 40
    time_budget_s: float = 120.0
    tol: float = 0.05
    abs_tol_ms: float = 0.05
    max_refine_rounds: int = 3
    batch_ratio: int = 4
    recompute_share: float = 0.25

    def check(self) -> None:
        if self.max_tiles < 1:
            raise UserError(f"profile.max_tiles must be >= 1, got {self.max_tiles}")
        if not 1 <= self.min_seq_len <= self.max_seq_len:
            raise UserError(f"profile.max_seq_len ({self.max_seq_len}) must be >= min_seq_len ({self.min_seq_len})")
        if self.repeats < 1 or self.warmup < 0:
            raise UserError(f"profile.repeats must be >= 1 and warmup >= 0, got {self.repeats}, {self.warmup}")
        if self.max_repeats < self.repeats or self.min_measure_ms < 0:
            raise UserError(f"profile.max_repeats ({self.max_repeats}) must be >= repeats ({self.repeats}) and "
                            f"min_measure_ms >= 0, got {self.min_measure_ms}")
        if not 0 <= self.recompute_share <= 1:
            raise UserError(f"profile recompute_share must be in [0, 1], got {self.recompute_share}")
        if self.time_budget_s <= 0:
            raise UserError(f"profile.time_budget_s must be > 0, got {self.time_budget_s}")


#: Torch threads of one rank on a CPU cluster: the model profiler times with this many, and the
#: trainer's CPU ranks run with as many (`dflop.runtime.run`), whatever OMP_NUM_THREADS the job got
#: (Snakemake exports a rule's `threads`; at 2 threads per rank the 2-rank demo oversubscribed its
#: 2 cores and ran well over its prediction).
CPU_THREADS_PER_RANK = 1


def profile_model(model: ModelHandle, profile: ProfileSection, out_path: str | Path, *, seed: int,
                  min_seq_len: int = 32, cpu_threads: int = CPU_THREADS_PER_RANK, co_runners: int = 1,
                  progress: bool = True) -> pd.DataFrame:
    """Profile every part of `model` for each of ``profile.tp_degrees``; write `out_path` atomically.

    profile: the config's ``profile`` section (device, degrees, shape grid, repeats, budget).
    min_seq_len: shortest per-sample length of the LLM grid; cpu_threads: torch threads per rank
    on CPU; co_runners: ranks measuring at the same time (module docstring; at least ``tp`` run for
    each TP degree). Timings do not need weights: with ``model.weights`` only the shapes are taken from it.
    TP degrees that do not divide a module's heads/width skip that module (logged).
    Returns the table that was written.
    """
    settings = ProfileSettings(max_tiles=profile.max_tiles, max_seq_len=profile.max_seq_len, min_seq_len=min_seq_len,
                               repeats=profile.repeats, warmup=profile.warmup, min_measure_ms=profile.min_measure_ms,
                               max_repeats=profile.max_repeats, time_budget_s=profile.time_budget_s)
    settings.check()
    spec, config, tp_degrees = model.spec, model.config, profile.tp_degrees
    select_packed_kernel(spec.packed_attention, device_type=profile.device,  # refuses a kernel that cannot
                         compute_dtype=Precision.of(spec.dtype).compute_dtype)  # run here, before any work
    _check_device(profile.device, tp_degrees, co_runners)
    job = dict(arch=spec.arch, vision=spec.vision, llm=spec.llm, weights_dir=spec.weights, device=profile.device,
               dtype=spec.dtype, packed_attention=spec.packed_attention, settings=asdict(settings),
               cpu_threads=cpu_threads, seed=seed, preset=spec.preset,
               co_runners=max(1, int(co_runners)))
    began = time.perf_counter()
    frames = []
    for tp in sorted(set(int(t) for t in tp_degrees)):
        modules = modules_for_tp(config, tp)
        if not modules:
            log.warning("TP=%d divides neither the vision nor the LLM heads of %s; skipped", tp, job["preset"])
            continue
        skipped = [m for m in MODULES if m not in modules]
        if skipped:
            log.info("TP=%d: not profiling %s (heads or width not divisible)", tp, ", ".join(skipped))
        world = tp * max(1, job["co_runners"] // tp)
        if job["co_runners"] > 1 and world != job["co_runners"]:
            log.info("TP=%d: %d ranks profile together (profile.co_runners %d rounded to whole TP groups)",
                     tp, world, job["co_runners"])
        job_tp = dict(job, tp=tp, modules=list(modules))
        rows = (profile_rank(job_tp, progress=progress, config=config) if world == 1
                else _run_workers(job_tp, world, progress=progress))
        frames.append(pd.DataFrame(rows, columns=list(COLUMNS)))
    if not frames:
        raise UserError(f"profile.tp_degrees {list(tp_degrees)}: no degree divides the model's heads")
    table = pd.concat(frames, ignore_index=True)
    with atomic_path(out_path) as tmp:
        table.to_parquet(tmp, index=False)
    log.info("model profile %s: %d rows in %.1f s -> %s\n%s", job["preset"], len(table),
             time.perf_counter() - began, out_path, summarize(table))
    return table


def modules_for_tp(config: PreTrainedConfig, tp: int) -> tuple[str, ...]:
    """Modules whose heads and widths `tp` splits evenly (see `dflop.models.info`)."""
    vision_ok = vision_tp_divides(config, tp, padded=True)  # zero-head padding (tensor_parallel.shard_vision_layer)
    allowed = {"vision_embed": vision_ok, "vision_layer": vision_ok, "projector": projector_tp_divides(config, tp)}
    llm_ok = llm_tp_divides(config, tp)
    return tuple(m for m in MODULES if allowed.get(m, llm_ok))


def summarize(table: pd.DataFrame) -> str:
    """One line per (module, TP): shapes measured, and median times and memory at the largest shape."""
    lines = [f"{'module':<14}{'tp':>3}{'shapes':>7}  {'largest (batch x seq_len)':<26}"
             f"{'fwd ms':>9}{'bwd ms':>9}{'act MiB':>9}{'param MiB':>10}"]
    for (module, tp), group in table[table["module"].isin(MODULES)].groupby(["module", "tp"], sort=False):
        shapes = group.groupby(["batch", "seq_len"]).median(numeric_only=True).reset_index()
        tokens = shapes["batch"] * shapes["seq_len"]
        top = shapes.loc[tokens.idxmax()]
        lines.append(f"{module:<14}{tp:>3}{len(shapes):>7}  {f'{int(top.batch)} x {int(top.seq_len)}':<26}"
                     f"{top.fwd_ms:>9.2f}{top.bwd_ms:>9.2f}{top.act_bytes / 2**20:>9.1f}"
                     f"{top.param_bytes / 2**20:>10.2f}")
    links = table[table["module"].isin(LINK_MODULES)]
    for (module, ranks), group in links.groupby(["module", "batch"], sort=False):
        ms = group.groupby("bytes")["fwd_ms"].median()
        lines.append(f"{module} over {int(ranks)} ranks: {ms.iloc[0]:.3f} ms at {int(ms.index[0]) // 1024} KiB, "
                     f"{ms.iloc[-1]:.2f} ms at {int(ms.index[-1]) // 2**20} MiB")
    return "\n".join(lines)


def _check_device(device: str, tp_degrees: Sequence[int], co_runners: int = 1) -> None:
    if device not in ("cpu", "cuda"):
        raise UserError(f"profile.device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("profile.device is 'cuda' but no CUDA device is visible")
        too_big = [t for t in tp_degrees if t > torch.cuda.device_count()]
        if too_big:
            raise UserError(f"profile.tp_degrees {too_big} exceed the {torch.cuda.device_count()} visible GPUs")
        if co_runners > torch.cuda.device_count():
            raise UserError(f"profile.co_runners {co_runners} exceeds the {torch.cuda.device_count()} visible GPUs "
                            "(one rank per GPU)")
    if any(int(t) < 1 for t in tp_degrees):
        raise UserError(f"profile.tp_degrees must be >= 1, got {list(tp_degrees)}")


# ---------------------------------------------------------------- one rank's measurements


class _RankSync:
    """Keeps every rank of the profiling world (TP groups and their co-runners) on the same shapes:
    world rank 0's numbers decide for everyone."""

    def __init__(self, device: torch.device):
        self.device = device
        self.size = dist.get_world_size() if dist.is_initialized() else 1

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def agree(self, *values: float) -> list[float]:
        """Rank 0's `values` on every rank."""
        if self.size == 1:
            return list(values)
        buf = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.broadcast(buf, src=0)
        return buf.tolist()


def profile_rank(job: dict, *, progress: bool, tp: TPGroup | None = None,
                 config: PreTrainedConfig | None = None) -> list[dict]:
    """Measure `job["modules"]` on this rank; returns rows (rank 0's are the ones kept).

    config: the model's resolved config; a TP worker process resolves it from the job's names."""
    tp = tp or TPGroup(rank=0, size=1)
    settings = ProfileSettings(**job["settings"])
    spec = architecture(job["arch"])
    if config is None:
        config = model_config(job["arch"], job["vision"], job["llm"], weights_dir=job["weights_dir"])
    device = _rank_device(job["device"])
    precision = Precision.of(job["dtype"])
    select_packed_kernel(job.get("packed_attention", "auto"))
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(job["cpu_threads"])
        reuse_large_cpu_allocations()  # as the CPU trainer does, so the profile is what it will see
    try:
        benches = build_benches(spec, config, modules=job["modules"], tp=tp, device=device, precision=precision,
                                seed=job["seed"])
        common = dict(tp=tp.size, device=_device_name(device), dtype=job["dtype"], preset=job["preset"],
                      threads=torch.get_num_threads() if device.type == "cpu" else 0,
                      co_runners=job.get("co_runners", 1))
        first = not dist.is_initialized() or dist.get_rank() == 0
        sync, timer = _RankSync(device), Timer(device)
        rows = _sweep(benches, spec, config, settings, sync, timer, common, progress=progress and first)
        return _with_step_costs(rows, benches, sync, timer, common, device, precision.param_dtype,
                                repeats=settings.repeats)
    finally:
        torch.set_num_threads(threads)


def _with_step_costs(rows: list[dict], benches, sync: _RankSync, timer: Timer, common: dict,
                     device: torch.device, dtype: torch.dtype, *, repeats: int) -> list[dict]:
    """`rows` with each module's ``optim_ms``, and the link rows when several ranks profile
    (`dflop.profiling.step_costs`)."""
    optim = {bench.name: optimizer_step_ms(bench.module, timer, repeats=repeats, barrier=sync.barrier)
             for bench in benches}
    call = optimizer_call_ms(device, dtype, timer, repeats=repeats, barrier=sync.barrier)
    rows = [dict(row, optim_ms=optim[row["module"]], optim_call_ms=call) for row in rows]
    if sync.size > 1:
        rows += link_rows(device, timer, common, repeats=repeats)
    return rows


def _rank_device(device: str) -> torch.device:
    if device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


#: Coarse grid ratio of the tile curves. A tile curve is a line, so refinement never adds to it and
#: a doubling grid leaves 5 shapes up to 16 tiles, 2 of them at the ends, where leaving one out to
#: measure the held-out error extrapolates; the finer grid is cheap (tiles are the light axis).
TILE_GRID_RATIO = 2**0.5


def _curves(bench: ModuleBench, spec: Architecture, config, settings: ProfileSettings):
    """(axis, fixed value, curve) sweeps of one module: tiles for vision, lengths per packing for LLM."""

    def curve(lo, hi, ratio=2.0):
        return AdaptiveCurve(lo, hi, ratio=ratio, tol=settings.tol, abs_floor=settings.abs_tol_ms)

    if bench.name in TILE_MODULES:
        return [("batch", spec.layer_tokens_per_tile(config), curve(1, settings.max_tiles, TILE_GRID_RATIO))]
    if bench.name in ("llm_layer", "llm_attention"):  # attention depends on per-sample lengths
        batches = geometric_points(1, settings.max_seq_len // settings.min_seq_len, settings.batch_ratio)
        return [("seq_len", b, curve(settings.min_seq_len, settings.max_seq_len // b)) for b in batches]
    return [("seq_len", 1, curve(settings.min_seq_len, settings.max_seq_len))]


def _sweep(benches, spec, config, settings, sync, timer, common, *, progress) -> list[dict]:
    curves = [(bench, axis, fixed, curve)
              for bench in benches for axis, fixed, curve in _curves(bench, spec, config, settings)]
    rows: list[dict] = []
    began = time.perf_counter()

    def over_budget() -> bool:
        (over,) = sync.agree(time.perf_counter() - began > settings.time_budget_s)
        return bool(over)

    _warm_up(curves, sync, timer)
    for round_ in range(settings.max_refine_rounds + 1):
        shapes = [_Shape.at(bench, axis, fixed, curve, x)
                  for bench, axis, fixed, curve in curves for x in curve.next_points()]
        if not shapes or (round_ > 0 and over_budget()):
            if shapes:
                log.info("TP=%d: time budget of %.0f s spent; refinement stopped before round %d",
                         common["tp"], settings.time_budget_s, round_)
            break
        # One counter per round, its total known before it starts: one tick per shape and pass
        # (refinement picks the next round's shapes only from this round's measurements).
        desc = f"profile TP={common['tp']} round {round_}"
        with progress_counter(_round_passes(settings) * len(shapes), desc, "shape-pass", enabled=progress) as bar:
            _measure_round(shapes, settings, sync, timer, stop_early=over_budget if round_ > 0 else None,
                           tick=bar.update)
        for shape in shapes:
            totals = [r["fwd_ms"] + r["bwd_ms"] for r in shape.timed]
            shape.curve.record(shape.x, *sync.agree(statistics.median(totals), _scatter(totals)))
            rows.extend(dict(r, **common, **shape.sizes, act_bytes=shape.act_bytes,
                             transient_bytes=shape.transient_bytes, repeat=k, module=shape.bench.name,
                             batch=shape.batch, seq_len=shape.seq_len, n_layers=shape.bench.n_layers, round=round_,
                             **shape.recompute_columns(k))
                        for k, r in enumerate(shape.timed))
    return rows


@dataclass
class _Shape:
    """One shape of one module's curve, and what has been measured of it so far."""

    bench: ModuleBench
    curve: AdaptiveCurve
    x: int
    batch: int
    seq_len: int
    timed: list[dict] = field(default_factory=list)
    act_bytes: int | None = None
    transient_bytes: float | None = None  # NaN: not measured (`_tracker_sees`)
    sizes: dict = field(default_factory=dict)
    recompute_timed: dict[str, list[dict]] = field(default_factory=dict)  # mode -> its timed runs
    recompute_act_bytes: dict[str, int] = field(default_factory=dict)
    recompute_transient_bytes: dict[str, int] = field(default_factory=dict)

    def recompute_columns(self, k: int) -> dict:
        """``bwd_ms:<mode>`` of the mode's k-th timed run (NaN past its last), ``act_bytes:<mode>`` and
        ``transient_bytes:<mode>``."""
        columns = {}
        for mode, runs in self.recompute_timed.items():
            bwd, act = RECOMPUTE_TARGETS[mode]
            columns[bwd] = runs[k]["bwd_ms"] if k < len(runs) else math.nan
            columns[act] = self.recompute_act_bytes[mode]
            columns[TRANSIENT_TARGETS[mode]] = self.recompute_transient_bytes[mode]
        return columns

    def measured(self, mode: str) -> bool:
        """Whether the bytes of `mode` (saved and transient) have been measured."""
        return self.act_bytes is not None if mode == "none" else mode in self.recompute_act_bytes

    def keep_bytes(self, mode: str, act: int, transient: int) -> None:
        if mode == "none":
            self.act_bytes, self.transient_bytes = act, transient
        else:
            self.recompute_act_bytes[mode], self.recompute_transient_bytes[mode] = act, transient

    @classmethod
    def at(cls, bench: ModuleBench, axis: str, fixed: int, curve: AdaptiveCurve, x: int) -> "_Shape":
        """The shape at point x of a curve that varies `axis` ("batch" or "seq_len") with the other fixed."""
        return cls(bench, curve, x, *((x, fixed) if axis == "batch" else (fixed, x)))


def _measure_round(shapes: list[_Shape], settings: ProfileSettings, sync: _RankSync, timer: Timer, *,
                   stop_early=None, tick=lambda: None) -> None:
    """Time every shape of a round in `settings.repeats` interleaved passes over all of them.

    The development CPUs change speed for seconds at a time (another tenant on the core; a fixed
    shape flips between two levels with the process doing nothing else:
    `benchmarks/bench_machine_phases.py`), so a shape's back-to-back repeats can all land in one slow phase and the fit
    reads the hump as a bend. Spread over the round's passes, the repeats sample several phases
    and the median lands in the common one. Pass 0 runs max(warmup, 1) untimed runs (the first
    measures the bytes, `_measured_run`) and one timed run per shape, which also decides how many timed
    runs the shape gets: `repeats`, or more up to `max_repeats` until they add up to
    `min_measure_ms` (rank 0's count, so the ranks' barriers stay paired). Later passes take
    their share of the rest, after one untimed run for shapes faster than `min_measure_ms`: the
    first run on returning to a light shape, after the other shapes and modules have been
    through the caches, is slower (cold caches), so a light shape's median mixed in one cold run
    per pass while a slightly heavier one (one run per pass) had only cold runs, an offset the fit
    read as a bend. Heavy shapes showed no cold-run cost, and re-warming them would double their
    time.
    `stop_early()` is asked between passes; when it says so, every shape keeps the runs it has
    (at least one). `tick()` is called once per shape and pass.

    A layer module's recompute modes run right after the shape's mode-none runs of each pass (so
    on warm caches, no untimed runs of their own but one in pass 0 that measures the mode's bytes,
    `_measured_run`), and `recompute_share` of the shape's run count in all (at least min(2,
    count)), spread over the passes like the others, so the modes cost a fraction of mode none's
    profiling time rather than as much again.
    """
    later_passes = _round_passes(settings) - 1
    wanted, rewarm, wanted_modes = [], [], []
    for shape in shapes:
        _run_shape(shape, max(settings.warmup, 1), 1, sync, timer)
        pace = shape.timed[0]["fwd_ms"] + shape.timed[0]["bwd_ms"]
        count = max(settings.repeats, math.ceil(settings.min_measure_ms / max(pace, 1e-6)))
        count, light = sync.agree(float(min(count, settings.max_repeats)), float(pace < settings.min_measure_ms))
        modes = shape.bench.recompute_modes if settings.recompute_share > 0 else ()
        for mode in modes:
            _run_shape(shape, 0, 1, sync, timer, mode)
        wanted.append(int(count))
        rewarm.append(int(light))
        wanted_modes.append({mode: min(int(count), max(2, math.ceil(settings.recompute_share * count)))
                             for mode in modes})
        tick()
    for pass_ in range(later_passes):
        if stop_early is not None and stop_early():
            return
        for shape, count, untimed, modes in zip(shapes, wanted, rewarm, wanted_modes):
            share = _share(count - 1, later_passes, pass_)
            if share:
                _run_shape(shape, untimed, share, sync, timer)
            for mode, mode_count in modes.items():
                share = _share(mode_count - 1, later_passes, pass_)
                if share:
                    _run_shape(shape, 0, share, sync, timer, mode)
            tick()


def _round_passes(settings: ProfileSettings) -> int:
    """Passes of `_measure_round` over its shapes: pass 0, then `repeats - 1` (at least one; with one
    repeat, the extra runs go back to back)."""
    return 1 + max(settings.repeats - 1, 1)


def _share(total: int, parts: int, index: int) -> int:
    """Part `index` of `total` split into `parts` near-equal parts (the larger ones first)."""
    return total // parts + (1 if index < total % parts else 0)


def _run_shape(shape: _Shape, untimed: int, timed: int, sync: _RankSync, timer: Timer,
               mode: str = "none") -> None:
    """`untimed` then `timed` forward + backward runs of one shape on fresh (seeded, identical on
    every rank and every pass) inputs, as a stage with recompute `mode` runs them. The first run of a
    mode ever is `_measured_run` (its saved and transient bytes), untimed: it stands for one of the
    untimed runs, or comes first when there is none (a recompute mode's first pass)."""
    bench = shape.bench
    torch.manual_seed(shape.batch * 1_000_003 + shape.seq_len)  # same inputs on every rank
    inputs = bench.make_inputs(shape.batch, shape.seq_len)
    params = list(bench.module.parameters())
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not shape.sizes:
        shape.sizes = dict(param_bytes=param_bytes(bench.module), grad_bytes=grad_bytes(bench.module),
                           optim_bytes=adam_state_bytes(bench.module), tied_bytes=bench.tied_bytes)
    cuda = timer.cuda
    timed_runs = shape.timed if mode == "none" else shape.recompute_timed.setdefault(mode, [])

    def run_forward(forward) -> torch.Tensor:
        with bench.precision.autocast(timer.device):  # as the stages run (`dflop.models.precision`)
            return forward(*inputs)

    def run(forward) -> dict:
        for t in params + leaves:
            t.grad = None
        sync.barrier()
        timer.synchronize()
        if cuda:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        out, fwd_ms = timer(lambda: run_forward(forward))
        seed = None if out.dim() == 0 else torch.randn_like(out)
        sync.barrier()
        _, bwd_ms = timer(functools.partial(out.backward, seed))
        peak = float(torch.cuda.max_memory_allocated() - base) if cuda else float("nan")
        return dict(fwd_ms=fwd_ms, bwd_ms=bwd_ms, peak_bytes=peak)

    with bench.recomputing(mode) as forward:
        if not shape.measured(mode):
            shape.keep_bytes(mode, *_measured_run(lambda: run_forward(forward), params, leaves, sync,
                                                  track=_tracker_sees(bench)))
            untimed = max(untimed - 1, 0)
        for _ in range(untimed):
            run(forward)
        timed_runs += [run(forward) for _ in range(timed)]


def _tracker_sees(bench: ModuleBench) -> bool:
    """Whether `_memory.allocated_peak` can follow the module's ops: not flex attention's
    higher-order op (a dispatch mode has no rule for it), so with ``model.packed_attention: flex``
    the attention-bearing LLM modules' transients are not measured (NaN: the fit leaves them out, and
    a stage's transient is then its other modules')."""
    return not (selected_packed_kernel() == "flex" and bench.name in ("llm_layer", "llm_attention"))


def _measured_run(forward, params: list[torch.Tensor], leaves: list[torch.Tensor], sync: _RankSync, *,
                  track: bool = True) -> tuple[int, float]:
    """One untimed forward + backward that measures a module's memory: (activation bytes, transient
    bytes), per rank.

    Activation bytes: the storages the forward saves for backward (`_memory.saved_tensor_bytes`;
    parameters excluded), what each in-flight microbatch keeps. Transient bytes: the most the forward
    + backward holds at once of what it allocates (`_memory.allocated_peak`), less the saved bytes
    it allocated itself: what a stage holds at this module's peak besides its training state and its
    in-flight activations (the LM head's logits and their float32 copy in forward, the loss's
    gradients in backward; a fully recomputed layer's rerun forward). The saved inputs (made before
    the block) are not subtracted: they are no part of the peak. The parameters' gradients exist
    before the run (zeros), as from a step's second microbatch on: the backward adds into them and only
    the gradient an op makes before that add is transient. (In a step's first microbatch the
    gradients are adopted instead, which holds no more beyond the state that counts them.)
    """
    for p in params:
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    for t in leaves:
        t.grad = None
    sync.barrier()
    if not track:  # `_tracker_sees`
        with saved_tensor_bytes(exclude=params) as saved:
            out = forward()
        out.backward(None if out.dim() == 0 else torch.randn_like(out))
        return saved.bytes, math.nan
    with allocated_peak() as allocated:
        with saved_tensor_bytes(exclude=params) as saved:
            out = forward()
        own = saved.among(allocated.holding())
        seed = None if out.dim() == 0 else torch.randn_like(out)
        out.backward(seed)
    return saved.bytes, max(0, allocated.peak - own)


def _warm_up(curves, sync: _RankSync, timer: Timer) -> None:
    """Run every curve's largest shape once, untimed, before anything is measured.

    Without this the coarse round, which runs first and grows the process's heap (and, on GPU,
    the caching allocator's pool) shape by shape, measured slower than later rounds at the same
    shapes, a drift no number of per-shape warm-ups removes and the fit then reads as a bend.
    Recompute modes are not warmed up: a layer's recomputed forward holds what its mode-none forward
    holds, so mode none's run grows the heap as far.
    """
    for bench, axis, fixed, curve in curves:
        _run_shape(_Shape.at(bench, axis, fixed, curve, max(curve.coarse)), 1, 0, sync, timer)


def _scatter(values: list[float]) -> float:
    """Interquartile range of repeated measurements (0 for fewer than 2)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


# ---------------------------------------------------------------- TP > 1 or co-runners: torchrun workers


def _run_workers(job: dict, world: int, *, progress: bool) -> list[dict]:
    """Launch `world` ranks (``world // tp`` TP groups) with torchrun; rank 0 writes its rows to a
    Parquet file we read back."""
    with tempfile.TemporaryDirectory(prefix="dflop-profile-") as tmp:
        part = Path(tmp) / "rows.parquet"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={world}", "-m", "dflop.profiling.model_tp_worker",
                   "--job", json.dumps(job), "--out", str(part)]
        if progress:
            command.append("--progress")
        env = dict(os.environ, OMP_NUM_THREADS=str(job["cpu_threads"]))
        # The workers' stderr (progress bar, errors) goes where ours goes.
        result = subprocess.run(command, env=env, stdout=subprocess.DEVNULL)
        if result.returncode != 0 or not part.exists():
            raise RuntimeError(f"TP={job['tp']} profiling workers ({world} ranks) failed (exit {result.returncode}); "
                               "their error is printed above")
        return pd.read_parquet(part).to_dict("records")
