"""Benchmark the microbatch partitioning policies (thin wrapper of dflop.scheduler.bench_scheduler).

    python benchmarks/bench_scheduler.py [--shapes results/data/shapes.parquet] [--out bench.csv]
        [--batches 3] [--budget-s 0.25] [--costmodel results/costmodel/costmodel.json
        --vision-layers 27 --llm-layers 28] [--timing]

Prints one row per (data set, n, m, dp): mean simulated step / bound per policy, our worst batch,
our worst ratio to the best baseline, and our solve time p50/p99 in ms. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import math

from dflop.scheduler.bench import DEFAULT_GRID, bench_scheduler, time_greedy_path
from dflop.scheduler.costs import fitted_costs_fn


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="shapes.parquet to sample global batches from")
    ap.add_argument("--out", help="CSV of every (data set, n, m, dp, batch, policy) row")
    ap.add_argument("--batches", type=int, default=3, help="global batches per grid point and data set")
    ap.add_argument("--budget-s", type=float, default=0.25, help="ILP time budget per partition")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-mix", action="store_true", help="skip the generated LLaVA-OV-like mix")
    ap.add_argument("--grid", help="n:m:dp points, comma-separated (default: 64..4096 x 4..64 x 1..8)")
    ap.add_argument("--costmodel", help="fitted costmodel.json instead of the analytic model")
    ap.add_argument("--vision-layers", type=int, help="vision encoder layers (with --costmodel)")
    ap.add_argument("--llm-layers", type=int, help="LLM layers (with --costmodel)")
    ap.add_argument("--pp-llm", type=int, default=3, help="LLM pipeline stages (with --costmodel)")
    ap.add_argument("--mem-limit-gb", type=float, default=math.inf, help="GPU memory (with --costmodel)")
    ap.add_argument("--timing", action="store_true",
                    help="only time the greedy path at n=1024 with 64 bins (64x1, 16x4, 8x8)")
    args = ap.parse_args(argv)
    grid = DEFAULT_GRID if not args.grid else tuple(tuple(int(x) for x in p.split(":")) for p in args.grid.split(","))
    costs_fn = layout = None
    if args.costmodel:
        if not (args.vision_layers and args.llm_layers):
            ap.error("--costmodel needs --vision-layers and --llm-layers")
        costs_fn, layout = fitted_costs_fn(args.costmodel, vision_layers=args.vision_layers,
                                           llm_layers=args.llm_layers, pp_llm=args.pp_llm,
                                           mem_limit_bytes=args.mem_limit_gb * 2**30)
    if args.timing:
        time_greedy_path(layout=layout, costs_fn=costs_fn)
        return
    bench_scheduler(args.shapes, args.out, grid=grid, batches=args.batches, budget_s=args.budget_s,
                    seed=args.seed, include_mix=not args.no_mix, layout=layout, costs_fn=costs_fn)


if __name__ == "__main__":
    main()
