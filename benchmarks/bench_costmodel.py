"""Held-out error of the fitted cost models on real profiles: profile a preset, fit, report.

    python benchmarks/bench_costmodel.py [--presets tiny small] [--timer wall|thread-cpu]
        [--time-budget-s 60] [--repeats 9] [--out-dir results/bench/costmodel] [--reuse]

For each preset (LLaVA-OV: ``tiny`` = siglip-tiny + qwen2.5-tiny, ``small`` = siglip-small +
qwen2.5-small, ~10M + 48M parameters) it runs the model profiler at TP=1 on this machine's CPU with
one torch thread, fits the cost models (`dflop.costmodel.fit.fit`) and prints the median absolute
percentage error on held-out shapes (leave one shape out) per module, for forward time, backward
time and activation memory, against the targets (time <= 10 %, memory <= 5 %). Outputs under
``--out-dir/<preset>/``: model_profile.parquet, costmodel.json, validation.parquet.

``--timer thread-cpu`` counts the profiled thread's CPU time instead of wall time, so other
processes sharing the cores do not inflate single measurements (valid at TP=1 with one thread,
where all the work runs on the calling thread). The profiler has no such option yet; this script
swaps the profiler's timer for the duration of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import time
from pathlib import Path

import pandas as pd
import torch

from dflop.config import Config
from dflop.costmodel.fit import fit
from dflop.models.handle import ModelHandle
from dflop.profiling import model_profiler
from dflop.profiling._timing import Timer

PRESETS = {
    "tiny": ("llava_ov", "siglip-tiny", "qwen2.5-tiny"),
    "small": ("llava_ov", "siglip-small", "qwen2.5-small"),
}
TIME_TARGET_PCT = 10.0
MEMORY_TARGET_PCT = 5.0


class ThreadCPUTimer(Timer):
    """The profiler's CPU timer measuring CPU time of the calling thread, in milliseconds (a
    subclass, so it has every attribute the profiler reads from its timer)."""

    def __init__(self, device: torch.device):
        if device.type != "cpu":
            raise ValueError("thread CPU time only measures CPU work")
        super().__init__(device)

    def __call__(self, fn):
        begin = time.thread_time()
        result = fn()
        return result, (time.thread_time() - begin) * 1e3


@contextlib.contextmanager
def profiler_timer(kind: str):
    """Use `kind` ('wall' or 'thread-cpu') as the profiler's timer inside the block."""
    if kind == "wall":
        yield
        return
    original = model_profiler.Timer
    model_profiler.Timer = ThreadCPUTimer
    try:
        yield
    finally:
        model_profiler.Timer = original


def run_preset(name: str, out_dir: Path, *, timer: str, time_budget_s: float, repeats: int,
               reuse: bool) -> tuple[pd.DataFrame, float]:
    """Profile (unless reused) and fit one preset; returns the validation table and profiling seconds."""
    arch, vision, llm = PRESETS[name]
    profile_path = out_dir / name / "model_profile.parquet"
    profile_s = float("nan")
    if not (reuse and profile_path.exists()):
        began = time.perf_counter()
        with profiler_timer(timer):
            cfg = Config.from_dict({"model": {"arch": arch, "vision": vision, "llm": llm},
                                    "profile": {"device": "cpu", "tp_degrees": [1], "repeats": repeats,
                                                "time_budget_s": time_budget_s}})
            model_profiler.profile_model(ModelHandle.resolve(cfg.model), cfg.profile, profile_path, seed=0,
                                         cpu_threads=1, progress=False)
        profile_s = time.perf_counter() - began
    fit(profile_path, out_dir / name / "costmodel.json", out_dir / name / "validation.parquet")
    return pd.read_parquet(out_dir / name / "validation.parquet"), profile_s


def report(name: str, validation: pd.DataFrame, profile_s: float) -> list[str]:
    """Markdown rows: one per module with fwd / bwd / act held-out median (and p90) APE."""
    arch, vision, llm = PRESETS[name]
    table = validation.pivot_table(index=["module", "tp"], columns="target",
                                   values=["mape_median", "mape_p90", "n_test_shapes"])
    rows = []
    for (module, tp), r in table.iterrows():
        time_ok = max(r[("mape_median", "fwd_ms")], r[("mape_median", "bwd_ms")]) <= TIME_TARGET_PCT
        memory_ok = r[("mape_median", "act_bytes")] <= MEMORY_TARGET_PCT
        rows.append(
            f"| {name} | {module} | {tp} | {int(r[('n_test_shapes', 'fwd_ms')])} "
            f"| {r[('mape_median', 'fwd_ms')]:.1f} ({r[('mape_p90', 'fwd_ms')]:.0f}) "
            f"| {r[('mape_median', 'bwd_ms')]:.1f} ({r[('mape_p90', 'bwd_ms')]:.0f}) "
            f"| {r[('mape_median', 'act_bytes')]:.2f} "
            f"| {'ok' if time_ok else 'MISS'} / {'ok' if memory_ok else 'MISS'} |"
        )
    how = "profile reused" if math.isnan(profile_s) else f"profiled in {profile_s:.0f} s"
    print(f"{name}: {arch} {vision} + {llm}; {how}")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["tiny", "small"])
    ap.add_argument("--timer", choices=["wall", "thread-cpu"], default="wall")
    ap.add_argument("--time-budget-s", type=float, default=60.0, help="profiler refinement budget per preset")
    ap.add_argument("--repeats", type=int, default=9,
                    help="timed runs per shape, taken in as many interleaved passes (see the profiler)")
    ap.add_argument("--out-dir", type=Path, default=Path("results/bench/costmodel"))
    ap.add_argument("--reuse", action="store_true", help="fit existing profiles in --out-dir instead of profiling")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    load_before = os.getloadavg()
    rows = []
    for name in args.presets:
        validation, profile_s = run_preset(name, args.out_dir, timer=args.timer, time_budget_s=args.time_budget_s,
                                           repeats=args.repeats, reuse=args.reuse)
        rows += report(name, validation, profile_s)
    load_after = os.getloadavg()
    timer = f"{args.timer} (reused profiles keep the timer they were made with)" if args.reuse else args.timer
    print(f"\ntimer: {timer}; torch threads: 1; CPU cores: {os.cpu_count()}; "
          f"1-min load average before/after: {load_before[0]:.1f} / {load_after[0]:.1f}")
    print("held-out median APE % (p90 in parentheses), leave-one-shape-out; "
          f"targets: time <= {TIME_TARGET_PCT:g} %, memory <= {MEMORY_TARGET_PCT:g} %\n")
    print("| preset | module | tp | shapes | fwd time | bwd time | act memory | time / memory |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
