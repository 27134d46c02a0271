"""Which portfolio members earn their place: the win table on the scheduler benchmark's batches.

    python benchmarks/bench_portfolio.py --shapes results/data/shapes.parquet [--batches 5] \
        [--grid 64:4:1,...] [--threshold 0.001] [--no-mix] [--ilp-budget-s 0.25 [--ilp-everywhere]]

Same batches as `bench_scheduler.py --batches 5` (data sets, grid, seed, analytic costs, one vision
+ three LLM stages), ILP off. Prints (`portfolio_wins` defines every column):
  1. the win table of every member in the registry: grid rows and batches where it runs, batches it
     wins by more than the threshold (and grid rows with such a win), ties, the median and largest
     margin (runner-up's step / its step) where it wins, and what removing it costs: grid rows
     whose mean step / bound rises by more than the threshold, the largest such rise, the largest
     rise of one batch, and the same for the greedy-path fallback (fb_*);
  2. backward elimination: members removed one at a time while one costs nothing measurable;
  3. the win table of the members kept, and every grid row whose mean step / bound changes, in
     the portfolio and in its greedy-path fallback;
  4. each member's build CPU time (p50 ms where it runs; machine-dependent, unlike the rest).
With --ilp-budget-s: the ILP warm-started from the fastest member, scored by simulation, on every
batch where ``ilp="auto"`` runs it (with --ilp-everywhere: every batch within its size limit);
time-budgeted, so machine-dependent. With --open-gates, instead: every gated member also runs
outside its gate, and the grid rows it would then make faster are printed (what each gate costs).
"""

from __future__ import annotations

import argparse

import pandas as pd

from scheduler_grid import load_pools, parse_grid, sample_batches
from synthetic_costs import AnalyticCostModel, StageLayout
from dflop.scheduler.portfolio import PortfolioSettings
from portfolio_wins import (OPEN_GATES, THRESHOLD, eliminate, gate_gains, ilp_rows, instances, member_names,
                                      row_table, win_table)

FORMATS = {"margin_median": "{:.4f}".format, "margin_max": "{:.4f}".format, "row_loss_max": "{:+.3%}".format,
           "batch_loss_max": "{:+.3%}".format, "fb_row_loss_max": "{:+.3%}".format, "fb_batch_loss_max": "{:+.3%}".format, "before": "{:.4f}".format, "after": "{:.4f}".format,
           "ratio": "{:.4f}".format, "worst_batch": "{:.4f}".format}


def run(shapes: str | None, *, grid, batches: int, seed: int, include_mix: bool = True,
        settings: PortfolioSettings = PortfolioSettings()):
    """Instances of every data set's batches (`portfolio_wins.Instance`)."""
    insts = []
    for name, pool in load_pools(shapes, include_mix=include_mix, seed=seed):
        insts += instances(sample_batches(pool, grid=grid, batches=batches, seed=seed, layout=StageLayout(),
                                          costs_fn=AnalyticCostModel()), name, settings=settings)
    return insts


def cpu_table(insts) -> pd.DataFrame:
    cpu = pd.DataFrame([inst.build_cpu_s for inst in insts])
    cpu = cpu[["(shared greedy)"] + [n for n in member_names(insts) if n in cpu]]
    return pd.DataFrame({"member": cpu.columns, "cpu_p50_ms": 1e3 * cpu.median().to_numpy(),
                         "cpu_max_ms": 1e3 * cpu.max().to_numpy()})


def ilp_summary(raw: pd.DataFrame, threshold: float) -> pd.DataFrame:
    raw = raw.assign(gain=raw.step_s / raw.ilp_step_s)
    out = []
    for (ds, n, m, dp), g in raw.groupby(["dataset", "n", "m", "dp"], sort=False):
        out.append(dict(dataset=ds, n=n, m=m, dp=dp, batches=len(g), gated=int(g.gated.sum()),
                        statuses=",".join(f"{k}:{v}" for k, v in g.status.value_counts().items()),
                        wins=int((g.gain > 1 + threshold).sum()), gain_max=g.gain.max(),
                        wall_p50_ms=1e3 * g.wall_s.median()))
    return pd.DataFrame(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", help="shapes.parquet to sample global batches from (besides the mix)")
    ap.add_argument("--no-mix", action="store_true", help="leave out the generated LLaVA-OV-like mix")
    ap.add_argument("--grid", default=None, help="n:m:dp,... (default: bench_scheduler's grid)")
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=THRESHOLD,
                    help="relative change that counts (default 0.001: the recorded table's resolution)")
    ap.add_argument("--ilp-budget-s", type=float, default=0.0, help="also measure the ILP with this budget")
    ap.add_argument("--ilp-everywhere", action="store_true", help="the ILP on every batch within its size limit")
    ap.add_argument("--open-gates", action="store_true",
                    help="instead: run every gated member everywhere and print what each gate costs (minutes)")
    args = ap.parse_args(argv)
    pd.set_option("display.width", 250)
    if args.open_gates:
        insts = run(args.shapes, grid=parse_grid(args.grid), batches=args.batches, seed=args.seed,
                    include_mix=not args.no_mix, settings=OPEN_GATES)
        print(f"{len(insts)} batches; grid rows where running a member outside its gate makes the row faster "
              f"by more than {args.threshold:g} (gain: mean step / bound gated / ungated; fb: greedy path)")
        print(gate_gains(insts, threshold=args.threshold).to_string(index=False, float_format="{:.4f}".format))
        return
    insts = run(args.shapes, grid=parse_grid(args.grid), batches=args.batches, seed=args.seed,
                include_mix=not args.no_mix)
    everyone = member_names(insts)
    print(f"{len(insts)} batches; threshold {args.threshold:g}\n\nwin table, every member:")
    print(win_table(insts, everyone, threshold=args.threshold).to_string(index=False, formatters=FORMATS))
    kept, removed = eliminate(insts, everyone, threshold=args.threshold)
    print("\nremoved, in order (what removing it cost then):")
    print(removed.to_string(index=False, formatters=FORMATS) if len(removed) else "(none)")
    print("\nwin table, members kept:")
    print(win_table(insts, kept, threshold=args.threshold).to_string(index=False, formatters=FORMATS))
    for fallback in (False, True):
        rows = row_table(insts, everyone, kept, fallback=fallback)
        changed = rows[(rows.ratio != 1.0) | (rows.worst_batch != 1.0)]
        print(f"\ngrid rows whose mean step / bound changes (every member -> kept){', greedy path' * fallback}:")
        print(changed.to_string(index=False, formatters=FORMATS) if len(changed) else "(none)")
    print("\nbuild CPU per member (ms, where it runs; machine-dependent):")
    print(cpu_table(insts).to_string(index=False, float_format="{:.1f}".format))
    if args.ilp_budget_s > 0:
        raw = ilp_rows(insts, kept, budget_s=args.ilp_budget_s, everywhere=args.ilp_everywhere)
        print(f"\nILP warm-started from the kept portfolio's fastest member, budget {args.ilp_budget_s:g} s "
              f"(machine-dependent): {len(raw)} batches, wins {int((raw.step_s / raw.ilp_step_s > 1 + args.threshold).sum())}")
        if len(raw):
            print(ilp_summary(raw, args.threshold).to_string(index=False, float_format="{:.4f}".format))


if __name__ == "__main__":
    main()
