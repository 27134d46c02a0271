"""The scheduler benchmark (benchmarks/bench_scheduler.py): every partitioning policy on sampled
global batches over an (n, m, dp) grid.

For each data set (a shapes.parquet and/or the generated LLaVA-OV-like mix), grid point and sampled
global batch, each policy partitions the batch; we record the simulated 1F1B step over the bound
max(T*, heaviest sample's critical path) and the wall time of the solve. Costs come from the
synthetic per-sample model (`synthetic_costs`, the recorded table's) by default; with a fitted
cost model, each grid point's plan (vision tp1 pp1 dp | LLM tp1 pp dp, an even layer split) is
priced by the product's one pricing path (`dflop.pricing.pricing`), transfers and all-reduces
included.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd

from dflop.errors import UserError
from dflop.scheduler.partition import POLICIES, greedy_partition, partition
from dflop.shapes import read_shapes
from synthetic_costs import AnalyticCostModel, CostsFn, StageLayout, batch_costs_from_shapes
from synthetic_mix import llava_ov_mix

DEFAULT_GRID = tuple((n, m, dp) for n in (64, 256, 1024, 4096) for m in (4, 16, 64) for dp in (1, 4, 8)
                     if m * dp <= n)


def load_pools(shapes_path: str | None, *, include_mix: bool = True, mix_size: int = 20000,
               seed: int = 0) -> list[tuple[str, pd.DataFrame]]:
    """(name, shapes) of the data sets to sample from: the shapes file's (named by its datasets)
    and the generated LLaVA-OV-like mix (always, when there is no shapes file)."""
    pools = []
    if shapes_path:
        shapes = read_shapes(shapes_path)
        name = "+".join(sorted(shapes["dataset"].astype(str).unique())) if "dataset" in shapes else Path(shapes_path).stem
        pools.append((name, shapes))
    if include_mix or not pools:
        pools.append(("llava_ov_mix", llava_ov_mix(mix_size, seed=seed)))
    return pools


def draw_batches(pool: pd.DataFrame, *, grid, batches: int, seed: int):
    """The benchmark's global batches: (n, m, dp, batch index, shapes rows) for each grid point and
    batch, drawn from `pool` by one generator seeded with `seed` (every script that compares with the
    recorded table draws them this way)."""
    rng = np.random.default_rng(seed)
    for n, m, dp in grid:
        for b in range(batches):
            idx = rng.choice(len(pool), size=n, replace=len(pool) < n)
            yield n, m, dp, b, pool.iloc[idx].reset_index(drop=True)


def _lengths(shapes: pd.DataFrame):
    """[n] text tokens (what llava_group sorts by), or None."""
    return shapes["text_tokens"].to_numpy(dtype=np.float64) if "text_tokens" in shapes else None


def sample_batches(pool: pd.DataFrame, *, grid, batches: int, seed: int, layout: StageLayout, costs_fn: CostsFn):
    """`draw_batches` with the synthetic costs: (n, m, dp, batch index, costs, lengths)."""
    for n, m, dp, b, shapes in draw_batches(pool, grid=grid, batches=batches, seed=seed):
        yield n, m, dp, b, batch_costs_from_shapes(shapes, layout, costs_fn), _lengths(shapes)


class FittedPricing:
    """Each grid point's plan priced by the one pricing path with a fitted cost model (module
    docstring): the model from the cost model's provenance (``arch/vision/llm``), `pp_llm` LLM
    stages, `cluster`'s links and memory."""

    def __init__(self, costmodel_path: str, *, pp_llm: int, cluster):
        from dflop.config import Config
        from dflop.costmodel.jsonio import load_cost_model
        from dflop.models.handle import ModelHandle

        self.cost = load_cost_model(costmodel_path)
        arch, vision, llm = (self.cost.provenance.preset.split("/") + ["", "", ""])[:3]
        if not (arch and vision and llm):
            raise UserError(f"{costmodel_path}: records no arch/vision/llm preset; cannot build its model")
        self.model = ModelHandle.resolve(Config.from_dict({"model": {"arch": arch, "vision": vision, "llm": llm}}).model)
        self.pp_llm, self.cluster, self._plans = pp_llm, cluster, {}

    def __call__(self, m: int, dp: int):
        from dflop.plan import Layout, Plan
        from dflop.pricing.pricing import Pricing

        if (m, dp) not in self._plans:
            plan = Plan.uniform(Layout("disjoint", 1, 1, dp, 1, self.pp_llm, dp, m), self.model.n_vision_layers,
                                self.model.n_llm_layers)
            self._plans[(m, dp)] = Pricing.of(plan, self.cost, self.model, self.cluster)
        return self._plans[(m, dp)]


def run_grid(pool: pd.DataFrame, dataset: str, *, grid, batches: int, budget_s: float, seed: int,
             policies, layout: StageLayout, costs_fn: CostsFn, ilp: str = "never",
             pricing: FittedPricing | None = None) -> pd.DataFrame:
    """One row per (grid point, batch, policy) with step_s, bound_s, ratio, solve_s, member.
    Costs: `costs_fn` on `layout` (synthetic), or `pricing` (a fitted cost model) when given."""
    from dflop.pricing.pool import Pool

    rows = []
    for n, m, dp, b, shapes in draw_batches(pool, grid=grid, batches=batches, seed=seed):
        lengths, p2p_s, allreduce_s = _lengths(shapes), 0.0, 0.0
        if pricing is None:
            costs = batch_costs_from_shapes(shapes, layout, costs_fn)
        else:
            priced = pricing(m, dp)
            pc = priced.batch(Pool.from_shapes(shapes))
            costs, p2p_s, allreduce_s = pc.costs, priced.p2p_s, pc.allreduce_s
        for policy in policies:
            t0, c0 = time.perf_counter(), time.process_time()
            part = partition(costs, m, dp, dp, budget_s=budget_s, seed=seed + b, policy=policy, lengths=lengths,
                             ilp=ilp, p2p_s=p2p_s, allreduce_s=allreduce_s)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            rows.append(dict(dataset=dataset, n=n, m=m, dp=dp, batch=b, policy=policy, step_s=part.step_s,
                             bound_s=part.lower_bound_s, ratio=part.gap, solve_s=wall, solve_cpu_s=cpu,
                             member=part.member,
                             ilp_status=part.ilp_status, memory_ok=part.memory_ok,
                             greedy_step_s=dict(part.candidates).get("greedy", np.nan)))
    return pd.DataFrame(rows)


def summarise(raw: pd.DataFrame) -> pd.DataFrame:
    """One row per (dataset, n, m, dp): mean step/bound per policy, our worst batch, our worst
    ratio to the best baseline, our solve wall p50/p99 and CPU p50 (ms), which members won and
    the ILP's statuses."""
    out = []
    for (ds, n, m, dp), g in raw.groupby(["dataset", "n", "m", "dp"], sort=False):
        row = dict(dataset=ds, n=n, m=m, dp=dp, n_per_m=n / m, items_per_bin=n / (m * dp))
        for policy in POLICIES:
            sub = g[g.policy == policy]
            if len(sub):
                row[policy] = sub.ratio.mean()
        ours = g[g.policy == "dflop"].set_index("batch")
        if len(ours):
            base = g[g.policy != "dflop"].groupby("batch").step_s.min()
            row["dflop_max"] = ours.ratio.max()
            row["vs_best_baseline"] = float((ours.step_s / base).max()) if len(base) else np.nan
            row["p50_ms"] = 1e3 * ours.solve_s.quantile(0.5)
            row["p99_ms"] = 1e3 * ours.solve_s.quantile(0.99)
            row["cpu_p50_ms"] = 1e3 * ours.solve_cpu_s.quantile(0.5)
            row["won_by"] = ",".join(f"{k}:{v}" for k, v in ours.member.value_counts().items())
            row["ilp"] = ",".join(f"{k}:{v}" for k, v in ours.ilp_status.value_counts().items() if k != "not_run")
        out.append(row)
    return pd.DataFrame(out)


# What each column of `format_table` means; printed under the table and in `--help`.
LEGEND = """\
columns (one row per data set and grid point, over its sampled global batches):
  dataset           where the global batches come from (the --shapes file's dataset, or llava_ov_mix)
  n, m, dp          samples per global batch, microbatches per replica, data-parallel replicas
  n_per_m           n / m;  items_per_bin: n / (m * dp), samples per microbatch of one replica
  dflop, megatron, llava_group, lpt1d
                    each policy's simulated step time / the batch's lower bound, mean over the
                    batches (1.000 = at the bound); megatron, llava_group and lpt1d are the data-blind baselines
                    (dflop/scheduler/baselines.py)
  dflop_max         dflop's worst batch, step time / lower bound
  vs_best_baseline  dflop's step time / the best baseline's on the same batch, worst batch (<= 1)
  p50_ms, p99_ms    dflop's partitioning wall time per batch, median and 99th percentile
  cpu_p50_ms        dflop's partitioning CPU time per batch, median
  won_by            portfolio member that gave dflop's partition: number of batches
  ilp               ILP statuses: number of batches (only with --ilp auto|always)"""


def format_table(summary: pd.DataFrame) -> str:
    cols = ["dataset", "n", "m", "dp", "n_per_m", "items_per_bin", *[p for p in POLICIES if p in summary],
            "dflop_max", "vs_best_baseline", "p50_ms", "p99_ms", "cpu_p50_ms", "won_by", "ilp"]
    cols = [c for c in cols if c in summary]
    fmt = {c: "{:.3f}".format for c in (*POLICIES, "dflop_max", "vs_best_baseline")}
    fmt.update({"p50_ms": "{:.1f}".format, "p99_ms": "{:.1f}".format, "cpu_p50_ms": "{:.1f}".format,
                "n_per_m": "{:.0f}".format,
                "items_per_bin": "{:.1f}".format})
    return summary[cols].to_string(index=False, formatters=fmt)


def bench_scheduler(shapes_path: str | None = None, out_csv: str | None = None, *, grid=DEFAULT_GRID,
                    batches: int = 3, budget_s: float = 0.25, seed: int = 0, policies=POLICIES,
                    include_mix: bool = True, mix_size: int = 20000, layout: StageLayout | None = None,
                    costs_fn: CostsFn | None = None, verbose: bool = True, ilp: str = "never",
                    pricing: FittedPricing | None = None) -> pd.DataFrame:
    """Benchmark every policy; print the summary table and return it (raw rows to `out_csv`).

    Args:
        shapes_path: a shapes.parquet to sample global batches from (optional).
        out_csv: where to write one row per (data set, n, m, dp, batch, policy); the summary goes
            next to it as ``<stem>_summary.csv``.
        grid: (n, m, dp) points; dp is used for both the LLM and the vision encoder.
        batches: global batches sampled per grid point and data set.
        budget_s: ILP time budget per partition (seconds), with ``ilp`` "auto" or "always".
        ilp: `partition`'s ILP mode; default "never" (the ILP is opt-in).
        include_mix: also run the generated LLaVA-OV-like mix (`llava_ov_mix`, `mix_size` samples).
        layout: pipeline stages and memory limits (default: 1 vision stage, 3 equal LLM stages).
        costs_fn: ``(shapes, layout) -> BatchCosts``; default `AnalyticCostModel()`.
        pricing: a fitted cost model through the pricing path instead (`FittedPricing`).
    """
    layout = layout or StageLayout()
    costs_fn = costs_fn or AnalyticCostModel()
    pools = load_pools(shapes_path, include_mix=include_mix, mix_size=mix_size, seed=seed)
    raw = pd.concat([run_grid(pool, name, grid=grid, batches=batches, budget_s=budget_s, seed=seed,
                              policies=policies, layout=layout, costs_fn=costs_fn, ilp=ilp, pricing=pricing)
                     for name, pool in pools],
                    ignore_index=True)
    summary = summarise(raw)
    if out_csv:
        out = Path(out_csv)
        out.parent.mkdir(parents=True, exist_ok=True)
        raw.to_csv(out, index=False)
        summary.to_csv(out.with_name(out.stem + "_summary.csv"), index=False)
    if verbose:
        print(format_table(summary))
        print(LEGEND)
    return summary


def time_greedy_path(n: int = 1024, layouts=((64, 1), (16, 4), (8, 8)), *, repeats: int = 20, seed: int = 1,
                     layout: StageLayout | None = None, costs_fn: CostsFn | None = None,
                     verbose: bool = True) -> pd.DataFrame:
    """Wall and CPU time of the portfolio without the ILP (what a step waits for at worst) on
    `repeats` global batches of the generated mix, for each (m, dp) in `layouts`."""
    import os

    layout = layout or StageLayout()
    costs_fn = costs_fn or AnalyticCostModel()
    pool = llava_ov_mix(20000, seed=seed)
    rng = np.random.default_rng(seed)
    load_before = os.getloadavg()[0]
    rows = []
    for m, dp in layouts:
        wall, cpu = [], []
        for _ in range(repeats):
            shapes = pool.iloc[rng.choice(len(pool), n)].reset_index(drop=True)
            costs = batch_costs_from_shapes(shapes, layout, costs_fn)
            t0, c0 = time.perf_counter(), time.process_time()
            greedy_partition(costs, m, dp, dp)  # the online service's fallback
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        rows.append(dict(n=n, m=m, dp=dp, bins=m * dp, wall_p50_ms=1e3 * np.median(wall),
                         wall_p99_ms=1e3 * np.quantile(wall, 0.99), cpu_p50_ms=1e3 * np.median(cpu)))
    table = pd.DataFrame(rows)
    if verbose:
        print(f"greedy path (the service's fallback: no ILP, no LP), {repeats} batches each; "
              f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        print(table.to_string(index=False, float_format="{:.1f}".format))
    return table


def parse_grid(text: str | None) -> tuple[tuple[int, int, int], ...]:
    """``"64:4:1,256:16:4"`` -> ((64, 4, 1), (256, 16, 4)); the default grid when empty."""
    if not text:
        return DEFAULT_GRID
    points = []
    for point in text.split(","):
        parts = point.split(":")
        if len(parts) != 3 or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
            raise UserError(f"--grid: {point!r} is not n:m:dp with three positive integers")
        points.append(tuple(int(x) for x in parts))
    return tuple(points)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Every microbatch partitioning policy on sampled global batches over "
                                             "an (n, m, dp) grid: mean simulated step / bound per policy.",
                                 epilog=LEGEND, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="shapes.parquet to sample global batches from")
    ap.add_argument("--out", help="CSV of every (data set, n, m, dp, batch, policy) row")
    ap.add_argument("--batches", type=int, default=3, help="global batches per grid point and data set")
    ap.add_argument("--ilp", choices=["never", "auto", "always"], default="never",
                    help="the portfolio's exact member (opt-in, see benchmarks/README.md)")
    ap.add_argument("--budget-s", type=float, default=0.25, help="ILP time budget per partition (with --ilp)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the batch sampling and the generated mix")
    ap.add_argument("--no-mix", action="store_true", help="skip the generated LLaVA-OV-like mix")
    ap.add_argument("--grid", help="n:m:dp points, comma-separated (default: 64..4096 x 4..64 x 1..8)")
    ap.add_argument("--costmodel", help="fitted costmodel.json (its preset's model), priced by the pricing path")
    ap.add_argument("--pp-llm", type=int, default=3, help="LLM pipeline stages (with --costmodel)")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0, help="GPU memory (with --costmodel)")
    ap.add_argument("--timing", action="store_true",
                    help="only time the greedy path at n=1024 with 64 bins (64x1, 16x4, 8x8)")
    return ap


def run_from_args(args: argparse.Namespace) -> pd.DataFrame | None:
    """Run the benchmark with the options of `build_parser`."""
    grid = parse_grid(args.grid)
    pricing = None
    if args.costmodel:
        from dflop.pricing.cluster import GB, Cluster

        pricing = FittedPricing(args.costmodel, pp_llm=args.pp_llm,
                                cluster=Cluster(nodes=8, gpus_per_node=8, gpu_memory_bytes=args.gpu_memory_gb * GB))
    if args.timing:
        return time_greedy_path()
    return bench_scheduler(args.shapes, args.out, grid=grid, batches=args.batches, budget_s=args.budget_s,
                           seed=args.seed, include_mix=not args.no_mix, ilp=args.ilp, pricing=pricing)
