"""Where the greedy's move/swap local search pays: the same batches partitioned with and without it.

    python benchmarks/bench_local_search.py [--grid 64:4:1,...] [--batches 5] [--seed 0]

Same generated LLaVA-OV-like mix, grid and batch sampling as `bench_scheduler.py` (so the batches
are the ones of its table), one vision + three LLM stages, analytic costs. Per grid point, means
over the batches of:
  - proxy_gain: greedy proxy / proxy after `local_search` (the search's own objective, the
    bottleneck-stage load; 1.000 = no change);
  - greedy_gain: simulated step of the portfolio's "greedy" member without / with the search;
  - dflop_gain: the portfolio's simulated step without / with it (local_search replaced by the
    identity in `dflop.scheduler.portfolio`, which also drops it from the greedy_ends members);
  - changed: batches whose final partition differs;
  - ls_ms: CPU milliseconds of one `local_search` call (p50 over the batches).
The ILP is off (``ilp="never"``) so both runs see the same members and results do not depend on
machine load.
"""

from __future__ import annotations

import argparse
import importlib
import time

import numpy as np
import pandas as pd

from scheduler_grid import DEFAULT_GRID, parse_grid
from synthetic_costs import AnalyticCostModel, StageLayout, batch_costs_from_shapes
from dflop.scheduler.evaluate import scalar_costs
from dflop.scheduler.greedy import MemoryGuard, greedy_2d, local_search, proxy
from synthetic_mix import llava_ov_mix

# the module, not the function `dflop.scheduler` re-exports under the same name
partition_module = importlib.import_module("dflop.scheduler.partition")
# where the portfolio's members call local_search
portfolio_module = importlib.import_module("dflop.scheduler.portfolio")


def _identity(sc, bin_of, *args, **kwargs):
    return bin_of.copy()


def run(grid, batches: int, seed: int) -> pd.DataFrame:
    pool = llava_ov_mix(20000, seed=seed)
    layout, costs_fn = StageLayout(), AnalyticCostModel()
    rng = np.random.default_rng(seed)   # the batch sampling of scheduler_grid.draw_batches
    rows = []
    for n, m, dp in grid:
        for b in range(batches):
            idx = rng.choice(len(pool), size=n, replace=len(pool) < n)
            costs = batch_costs_from_shapes(pool.iloc[idx].reset_index(drop=True), layout, costs_fn)
            sc = scalar_costs(costs, m, dp, dp)
            guard = MemoryGuard.from_costs(costs, dp)
            start = greedy_2d(sc, m, dp, guard)
            c0 = time.process_time()
            searched = local_search(sc, start, m, dp, guard)
            ls_s = time.process_time() - c0
            with_ls = partition_module.partition(costs, m, dp, dp, ilp="never", seed=seed + b)
            portfolio_module.local_search = _identity
            try:
                without = partition_module.partition(costs, m, dp, dp, ilp="never", seed=seed + b)
            finally:
                portfolio_module.local_search = local_search
            rows.append(dict(n=n, m=m, dp=dp, batch=b, proxy_gain=proxy(sc, start, m, dp) / proxy(sc, searched, m, dp),
                             greedy_gain=dict(without.candidates)["greedy"] / dict(with_ls.candidates)["greedy"],
                             dflop_gain=without.step_s / with_ls.step_s, changed=not with_ls.same_assignment(without),
                             member=with_ls.member, ls_ms=1e3 * ls_s))
    return pd.DataFrame(rows)


def summarise(raw: pd.DataFrame) -> pd.DataFrame:
    g = raw.groupby(["n", "m", "dp"], sort=False)
    out = g.agg(items_per_bin=("n", "first"), proxy_gain=("proxy_gain", "mean"), greedy_gain=("greedy_gain", "mean"),
                dflop_gain=("dflop_gain", "mean"), dflop_gain_max=("dflop_gain", "max"),
                dflop_gain_min=("dflop_gain", "min"), changed=("changed", "sum"), ls_ms=("ls_ms", "median"))
    out["items_per_bin"] = [n / (m * dp) for n, m, dp in out.index]
    return out.reset_index()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default=None, help="n:m:dp,... (default: bench_scheduler's grid)")
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    grid = parse_grid(args.grid) if args.grid else DEFAULT_GRID
    summary = summarise(run(grid, args.batches, args.seed))
    fmt = {c: "{:.4f}".format for c in ("proxy_gain", "greedy_gain", "dflop_gain", "dflop_gain_max", "dflop_gain_min")}
    fmt.update(items_per_bin="{:.1f}".format, ls_ms="{:.1f}".format)
    print(summary.to_string(index=False, formatters=fmt))


if __name__ == "__main__":
    main()
