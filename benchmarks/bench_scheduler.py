"""Benchmark the microbatch partitioning policies: the same as `dflop bench-scheduler ARGS`.

    python benchmarks/bench_scheduler.py [--shapes results/data/shapes.parquet] [--out bench.csv]
        [--batches 3] [--budget-s 0.25] [--costmodel results/costmodel/costmodel.json
        --vision-layers 27 --llm-layers 28] [--timing]

Prints one row per (data set, n, m, dp): mean simulated step / bound per policy, our worst batch,
our worst ratio to the best baseline, and our solve time p50/p99 in ms. See benchmarks/README.md.
The ILP is opt-in (`partition(ilp="never")` by default), so --budget-s has no effect here; which
members earn their place in the portfolio: benchmarks/bench_portfolio.py.
"""

import sys

from dflop.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-scheduler", *sys.argv[1:]]))
