"""`dflop optimize`: shapes.parquet + costmodel.json + cluster -> plan.yaml + candidates.parquet.

Reads the inputs, runs `dflop.planner.search.search`, writes both outputs atomically and prints a
summary (chosen plan, predicted step and speedup over the data-blind baseline, utilisation, solver
times). Every bad input is a one-line `UserError` naming the file or key.
"""

from __future__ import annotations

import time
from typing import Sequence

from dflop.costmodel.model import CostModel
from dflop.plan import write_plan
from dflop.planner.candidates import write_candidates
from dflop.planner.cluster import Cluster
from dflop.planner.expected import SchedulerSettings
from dflop.planner.inputs import check_cost_model_matches, load_model_shape
from dflop.planner.means import Pool
from dflop.planner.planfile import plan_document
from dflop.planner.search import SearchResult, SearchSettings, search
from dflop.planner.space import ModelShape
from dflop.shapes import read_shapes


def optimize(shapes_path, costmodel_path, plan_path, candidates_path, *,
             arch: str = "llava_ov", vision: str = "siglip-tiny", llm: str = "qwen2.5-tiny",
             weights: str | None = None, device: str = "cpu", nodes: int = 1, gpus_per_node: int = 2,
             gpu_memory_gb: float = 8.0, intra_node_gbps: float = 150.0, inter_node_gbps: float = 25.0,
             p2p_latency_us: float = 20.0, placements: Sequence[str] = ("disjoint", "colocated"),
             microbatches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), sample_batches: int = 8, top_k: int = 16,
             time_limit_s: float = 10.0, rel_gap: float = 0.01, global_batch_size: int = 16, seed: int = 0,
             scheduler_ilp: str = "never", scheduler_budget_ms: float = 50.0, racing: bool = True,
             verbose: bool = True,
             shape: ModelShape | None = None) -> SearchResult:
    """Plan the parallel layout; write plan.yaml and candidates.parquet; return the search result.

    Keyword arguments mirror the config: model.{arch, vision, llm, weights}, cluster.*,
    planner.{placements, microbatches, sample_batches, top_k, time_limit_s, rel_gap},
    train.global_batch_size, run.seed; scheduler_ilp / scheduler_budget_ms: whether the online
    scheduler's exact ILP runs on each sampled batch and its wall budget (default "never": plans
    must not depend on machine load, see `SchedulerSettings`); racing: successive halving over the
    sampled batches (see `dflop.planner.search`). `shape` overrides the model structure (tests).
    """
    t0 = time.perf_counter()
    cost = CostModel.load(costmodel_path)
    check_cost_model_matches(cost, arch, vision, llm, costmodel_path)
    shape = shape or load_model_shape(arch, vision, llm, weights)
    pool = Pool.from_shapes(read_shapes(shapes_path), where=str(shapes_path),
                            llm_tokens_per_tile=shape.llm_tokens_per_tile)
    cluster = Cluster.from_config(nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_gb=gpu_memory_gb,
                                  intra_node_gbps=intra_node_gbps, inter_node_gbps=inter_node_gbps,
                                  p2p_latency_us=p2p_latency_us, device=device)
    scheduler = SchedulerSettings(budget_s=scheduler_budget_ms / 1e3, ilp=scheduler_ilp)
    settings = SearchSettings(global_batch=global_batch_size, placements=tuple(placements),
                              microbatches=tuple(microbatches), sample_batches=sample_batches, top_k=top_k,
                              time_limit_s=time_limit_s, rel_gap=rel_gap, seed=seed, racing=racing, scheduler=scheduler)
    result = search(cost, shape, pool, cluster, settings)
    base = result.baseline
    doc = plan_document(
        chosen=result.chosen, mean_shape_step_s=result.milp.objective_s,
        baseline=base.evaluation,
        baseline_mean_shape_s=base.stage_model.objective_s(base.stage_model.split_of(base.evaluation.plan))
        if base.evaluation is not None else None,
        global_batch=global_batch_size, cluster=cluster,
        solver={"name": "highs (pyomo)", "status": result.milp.status, "time_s": result.stats["milp_s"],
                "milps": result.stats["milps"], "statuses": result.stats["milp_statuses"],
                "top_k_proven": result.stats["top_k_proven"], "layouts": result.stats["layouts"],
                "feasible": result.stats["feasible"], "time_limit_s": time_limit_s, "rel_gap": rel_gap,
                "wall_s": time.perf_counter() - t0},
        evaluation={"sample_batches": sample_batches, "seed": seed, "racing": racing, "top_k": top_k,
                    "scheduler": {"policy": scheduler.policy, "budget_s": scheduler.budget_s, "ilp": scheduler.ilp}},
        model={"arch": arch, "vision": vision, "llm": llm, "weights": weights, "dtype": cost.provenance.dtype},
        inputs={"shapes": str(shapes_path), "costmodel": str(costmodel_path)},
    )
    write_plan(doc, plan_path)
    write_candidates(result.candidates, candidates_path)
    if verbose:
        print(summary(result, cluster, global_batch_size, plan_path, candidates_path))
    return result


def summary(result: SearchResult, cluster: Cluster, global_batch: int, plan_path=None, candidates_path=None) -> str:
    """A readable report of the search."""
    ev, st = result.chosen, result.stats
    lines = [f"plan for {cluster.world_size} GPUs ({cluster.nodes} x {cluster.gpus_per_node}, "
             f"{cluster.gpu_memory_bytes / 1e9:.3g} GB each), global batch {global_batch}:",
             f"  chosen   {ev.plan.describe()}",
             f"           {ev.plan.layout.world_size} GPUs, step {ev.mean_s:.4g} s mean / {ev.p50_s:.4g} p50 / "
             f"{ev.p90_s:.4g} p90 over {len(ev.step_s)} sampled batches, utilisation {100 * ev.mean_utilisation:.1f}%",
             "           memory per stage (GB): " + ", ".join(
                 f"{ev.plan.stage_name(s)} {m / 1e9:.3g}" for s, m in enumerate(ev.memory_bytes))]
    b = result.baseline.evaluation
    if b is not None:
        lines += [f"  baseline {b.plan.describe()} (data-blind: uniform split, fixed-count microbatches)",
                  f"           step {b.mean_s:.4g} s mean / {b.p90_s:.4g} p90, utilisation "
                  f"{100 * b.mean_utilisation:.1f}%",
                  f"  predicted speedup over the baseline: {b.mean_s / ev.mean_s:.2f}x"]
    else:
        lines.append("  baseline: no data-blind layout fits (see candidates.parquet, kind == 'baseline')")
    lines.append(f"  search: {st['layouts']} layouts ({st['feasible']} fit in memory), {st['milps']} MILPs "
                 f"{dict(st['milp_statuses'])} in {st['milp_s']:.2f} s solver time, {st['simulated']} plans "
                 f"simulated; top-k {'proven' if st['top_k_proven'] else 'NOT proven (raise planner.top_k)'}")
    lines.append(f"  times: screen {st['screen_s']:.2f} s, MILPs {st['milp_wall_s']:.2f} s, simulation "
                 f"{st['simulate_s']:.2f} s, baseline {st['baseline_s']:.2f} s, total {st['wall_s']:.2f} s")
    if plan_path is not None:
        lines.append(f"  wrote {plan_path} and {candidates_path}")
    return "\n".join(lines)
