"""How well the cost model's per-sample load line predicts what a step's samples take to load.

    python benchmarks/bench_load_line.py --workdir DIR [--co-runners 2] [--batch 8] [--batches 500]
    python benchmarks/bench_load_line.py --workdir DIR --profiles N

DIR is a finished demo working directory (`make demo`: results/data/shapes.parquet,
results/profile/load_profile.parquet, results/costmodel/costmodel.json, config/config.yaml).
Times the load of EVERY usable sample the way `dflop profile-loading` times its subsample (the
trainer's `TrainingData` path, `--co-runners` processes in lockstep, the mean over interleaved
passes that fill the config's `data.load_profile_seconds`), then compares the cost model's line (fitted on the profile's few samples per
modality) with those timings: per sample (median relative error per modality) and summed over
random batches of `--batch` samples drawn from the samples the line was NOT fitted on (what a rank
loads per step: 8 = the demo's 16-sample global batch over 2 replicas).

With ``--profiles N`` it instead takes the workflow's load profile N times again, as rule
profile_loading does (same samples, config and co-runners), and prints each one's summed load
against the workflow's: how far the line's level moves from one profile to the next on this
machine. To compare two versions of the profiler, alternate runs of each (PYTHONPATH=<worktree>).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--co-runners", type=int, default=None,
                        help="loaders at once (default: the config's, as rule profile_loading runs it)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--profiles", type=int, default=0, help="re-take the workflow's load profile this many times")
    args = parser.parse_args()

    from dflop.config import load
    from dflop.costmodel.jsonio import load_cost_model
    from dflop.profiling.load_profiler import profile_loading

    w = args.workdir.resolve()
    os.chdir(w)  # the config's dataset paths are relative to the working directory, as for Snakemake
    cfg = load(w / "config/config.yaml")
    if args.co_runners is None:
        args.co_runners = cfg.profile.co_runners_on(cfg.cluster)
    if args.profiles:
        return repeat_profiles(cfg, w, args.profiles, args.co_runners)
    shapes = pd.read_parquet(w / "results/data/shapes.parquet")
    usable = shapes[shapes["status"] == "ok"]
    every = dict(cfg.raw)
    every["data"] = {**every["data"], "load_profile_samples": len(usable)}  # all samples of every modality
    with tempfile.TemporaryDirectory() as tmp:
        timed = profile_loading(type(cfg).from_dict(every), w / "results/data/shapes.parquet",
                                Path(tmp) / "all.parquet", co_runners=args.co_runners)
    line = load_cost_model(w / "results/costmodel/costmodel.json").step_costs.loading
    fitted_on = set(pd.read_parquet(w / "results/profile/load_profile.parquet")["sample_id"])
    timed["predicted_s"] = line(timed)
    timed["rel_err"] = timed["predicted_s"] / timed["load_s"] - 1
    print(f"{len(timed)} samples timed ({args.co_runners} loading at once); line fitted on {len(fitted_on)} of them")
    print(timed.groupby("modality").agg(samples=("load_s", "size"), measured_ms=("load_s", lambda x: 1e3 * x.median()),
                                        predicted_ms=("predicted_s", lambda x: 1e3 * x.median()),
                                        median_rel_err=("rel_err", "median")).round(3).to_string())
    again = timed.merge(pd.read_parquet(w / "results/profile/load_profile.parquet")[["sample_id", "load_s"]],
                        on="sample_id", suffixes=("", "_profiled"))
    print(f"the line's own {len(again)} samples, timed again now / in the profile: median "
          f"{np.median(again['load_s'] / again['load_s_profiled']):.3f} (the machine's drift between the two)")
    held_out = timed[~timed["sample_id"].isin(fitted_on)].reset_index(drop=True)
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(args.batches):
        rows = rng.choice(len(held_out), size=args.batch, replace=False)
        ratios.append(held_out["predicted_s"].iloc[rows].sum() / held_out["load_s"].iloc[rows].sum())
    ratios = np.array(ratios)
    print(f"predicted / measured load of {args.batches} random {args.batch}-sample batches of the {len(held_out)} "
          f"held-out samples: median {np.median(ratios):.3f}, p10 {np.quantile(ratios, 0.1):.3f}, "
          f"p90 {np.quantile(ratios, 0.9):.3f}")


def repeat_profiles(cfg, w: Path, count: int, co_runners: int) -> None:
    """Re-take the workflow's load profile `count` times; print each one's total against it."""
    import time

    from dflop.profiling.load_profiler import profile_loading

    workflow = pd.read_parquet(w / "results/profile/load_profile.parquet")["load_s"].sum()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(count):
            began = time.perf_counter()
            table = profile_loading(cfg, w / "results/data/shapes.parquet", Path(tmp) / f"{k}.parquet",
                                    co_runners=co_runners)
            ratios.append(table["load_s"].sum() / workflow)
            print(f"profile {k + 1}/{count}: {len(table)} samples, summed load {table['load_s'].sum():.3f} s, "
                  f"{ratios[-1]:.3f}x the workflow's; {time.perf_counter() - began:.1f} s", flush=True)
    print(f"summed load / the workflow's over {count} profiles: {min(ratios):.3f}-{max(ratios):.3f} "
          f"(max / min {max(ratios) / min(ratios):.2f})")


if __name__ == "__main__":
    main()
