"""How far the scheduler is from a certified lower bound, next to the benchmark's T*-based bound.

    python benchmarks/bench_scheduler_bound.py [--grid 256:16:8,1024:64:8] [--batches 5] [--seed 0]

Samples the same global batches of the generated LLaVA-OV-like mix as `bench_scheduler.py`
with the same grid, batches and seed (the rng is replayed over the whole grid), partitions each
with the DFLOP portfolio (ILP budget 0.25 s, as the benchmark) and prints per grid point the mean
over batches of:
  dflop       simulated step / bound, bound = max(T*, heaviest sample's path) (the benchmark's);
  certified   certified lower bound / bound, certified = max(`fluid_lower_bound`, heaviest
              sample's path): no partition in any order can simulate faster (proof in its
              docstring, brute-force tested);
  vs_cert     simulated step / certified lower bound (worst batch in vs_cert_max).
T* is not a lower bound (light first and last microbatches beat equal ones), which is why
"certified" is below 1.
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from dflop.errors import UserError
from scheduler_grid import parse_grid
from synthetic_costs import AnalyticCostModel, StageLayout, batch_costs_from_shapes
from dflop.scheduler.evaluate import heaviest_sample_path
from dflop.scheduler.partition import partition
from dflop.scheduler.profile import fluid_lower_bound
from synthetic_mix import llava_ov_mix


def run(grid, batches: int, seed: int, mix_size: int = 20000, budget_s: float = 0.25) -> pd.DataFrame:
    pool = llava_ov_mix(mix_size, seed=seed)
    rng = np.random.default_rng(seed)
    layout, costs_fn = StageLayout(), AnalyticCostModel()
    rows = []
    for n, m, dp in grid:
        for b in range(batches):
            idx = rng.choice(len(pool), size=n, replace=len(pool) < n)
            costs = batch_costs_from_shapes(pool.iloc[idx].reset_index(drop=True), layout, costs_fn)
            part = partition(costs, m, dp, dp, budget_s=budget_s, seed=seed + b)
            fluid = fluid_lower_bound(costs, m, dp, dp)
            if fluid is None:
                raise RuntimeError(f"fluid LP failed at n={n} m={m} dp={dp} batch {b}")
            certified = max(fluid, heaviest_sample_path(costs, dp))
            rows.append(dict(n=n, m=m, dp=dp, batch=b, step_s=part.step_s, bound_s=part.lower_bound_s,
                             certified_s=certified, member=part.member))
    raw = pd.DataFrame(rows)
    out = []
    for (n, m, dp), g in raw.groupby(["n", "m", "dp"], sort=False):
        vs_cert = g.step_s / g.certified_s
        out.append(dict(n=n, m=m, dp=dp, items_per_bin=n / (m * dp), dflop=(g.step_s / g.bound_s).mean(),
                        certified=(g.certified_s / g.bound_s).mean(), vs_cert=vs_cert.mean(),
                        vs_cert_max=vs_cert.max()))
    return pd.DataFrame(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", help="n:m:dp points, comma-separated (default: the benchmark's grid)")
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        grid = parse_grid(args.grid)
    except UserError as exc:
        raise SystemExit(f"error: {exc}") from None
    table = run(grid, args.batches, args.seed)
    print(table.to_string(index=False, float_format="{:.3f}".format))


if __name__ == "__main__":
    main()
