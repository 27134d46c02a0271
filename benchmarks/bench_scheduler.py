"""Benchmark the microbatch partitioning policies (implementation: `scheduler_grid`).

    python benchmarks/bench_scheduler.py [--shapes results/data/shapes.parquet] [--out bench.csv]
        [--batches 3] [--ilp auto --budget-s 0.25] [--costmodel results/costmodel/costmodel.json
        --pp-llm 3] [--timing]

Prints one row per (data set, n, m, dp): mean simulated step / bound per policy, our worst batch,
our worst ratio to the best baseline, and our solve time p50/p99 in ms. See benchmarks/README.md.
The ILP is opt-in (--ilp; --budget-s is its budget); which members earn their place in the
portfolio: benchmarks/bench_portfolio.py.
"""

import sys

from dflop.errors import UserError
from scheduler_grid import build_parser, run_from_args


def main(argv=None) -> int:
    try:
        run_from_args(build_parser().parse_args(argv))
    except UserError as exc:
        print(f"bench_scheduler: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
