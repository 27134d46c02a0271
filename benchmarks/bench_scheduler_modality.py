"""Which samples make a grid point hard: the scheduler on the LLaVA-OV-like mix with and without one modality.

    python benchmarks/bench_scheduler_modality.py [--grid 64:8:8,256:32:8,512:64:8] [--batches 3] [--seed 0]
        [--drop video]

Prints two tables:
  1. each modality's share of the samples, of the vision work and of the LLM work in the mix
     (the benchmark's 20 000-sample pool, `AnalyticCostModel`, default `StageLayout`), and its
     vision stage seconds per LLM stage second (vision on the one vision stage, LLM on the busiest
     LLM stage; the mix as a whole is close to 1, which is what the default layout balances);
  2. `bench_scheduler.py`'s columns (mean step / bound per policy, our worst batch, our worst
     step over the best baseline's) on the same grid, for the mix as the benchmark samples it and
     for the mix with every sample of the dropped modality removed (batches redrawn from what is
     left, same seed).
If the dropped modality explains a point's gap to the bound, the second row of that point is
near 1 while the first is not (benchmarks/README.md, "Modality mix").
"""

from __future__ import annotations

import argparse

import pandas as pd

from dflop.errors import UserError
from scheduler_grid import format_table, parse_grid, run_grid, summarise
from synthetic_costs import AnalyticCostModel, StageLayout, batch_costs_from_shapes
from dflop.scheduler.evaluate import scalar_costs
from dflop.scheduler.partition import POLICIES
from synthetic_mix import llava_ov_mix


def modality_shares(pool: pd.DataFrame, layout: StageLayout, costs_fn) -> pd.DataFrame:
    """One row per modality: share of samples, of vision and of LLM stage work, and their ratio."""
    costs = batch_costs_from_shapes(pool, layout, costs_fn)
    sc = scalar_costs(costs, 1, 1, 1)                       # per-sample seconds on the busiest stages
    work = pd.DataFrame({"modality": pool["modality"].to_numpy(), "vision": sc.vision, "llm": sc.llm})
    by = work.groupby("modality").agg(samples=("llm", "size"), vision=("vision", "sum"), llm=("llm", "sum"))
    out = pd.DataFrame({
        "samples": by.samples / by.samples.sum(),
        "vision_work": by.vision / by.vision.sum(),
        "llm_work": by.llm / by.llm.sum(),
        "vision_per_llm": by.vision / by.llm,
    })
    total = pd.DataFrame({"samples": [1.0], "vision_work": [1.0], "llm_work": [1.0],
                          "vision_per_llm": [by.vision.sum() / by.llm.sum()]}, index=["all"])
    return pd.concat([out, total])


def run(grid, batches: int, seed: int, drop: str, mix_size: int = 20000, budget_s: float = 0.25):
    pool = llava_ov_mix(mix_size, seed=seed)
    if drop not in set(pool["modality"]):
        raise UserError(f"--drop {drop!r}: the mix has no such modality (it has {sorted(set(pool['modality']))})")
    layout, costs_fn = StageLayout(), AnalyticCostModel()
    shares = modality_shares(pool, layout, costs_fn)
    kept = pool[pool["modality"] != drop].reset_index(drop=True)
    raw = pd.concat([run_grid(p, name, grid=grid, batches=batches, budget_s=budget_s, seed=seed, policies=POLICIES,
                              layout=layout, costs_fn=costs_fn)
                     for name, p in (("llava_ov_mix", pool), (f"without_{drop}", kept))], ignore_index=True)
    summary = summarise(raw).sort_values(["n", "m", "dp"], kind="stable")
    return shares, summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", default="64:8:8,256:32:8,512:64:8", help="n:m:dp points, comma-separated")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drop", default="video", help="modality to remove from the mix (default: video)")
    args = ap.parse_args(argv)
    try:
        shares, summary = run(parse_grid(args.grid), args.batches, args.seed, args.drop)
    except UserError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(shares.to_string(float_format="{:.3f}".format))
    print()
    print(format_table(summary))


if __name__ == "__main__":
    main()
