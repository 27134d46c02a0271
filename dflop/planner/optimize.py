"""`dflop optimize`: shapes.parquet + costmodel.json + cluster -> plan.yaml + candidates.parquet.

Reads the inputs, runs `dflop.planner.search.search`, writes both outputs atomically and prints a
summary (chosen plan, predicted step and speedup over the data-blind baselines, Megatron-style
packed and HF/LLaVA padded, utilisation, solver times). Every bad input is a one-line `UserError`
naming the file or key.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

from dflop.config import ClusterSection, DatasetSpec, PlannerSection
from dflop.data.sampling import dataset_mix
from dflop.models.handle import ModelHandle
from dflop.plan import write_plan
from dflop.planner.candidates import write_candidates
from dflop.pricing.cluster import Cluster
from dflop.scheduler.settings import SchedulerSettings
from dflop.planner.inputs import check_cost_model_matches
from dflop.pricing.pool import Pool
from dflop.planner.planfile import BASELINE_LABELS, plan_document
from dflop.planner.search import SearchResult, SearchSettings, search
from dflop.planner.space import ModelShape, describe_plan
from dflop.planner.techniques import technique_costs, techniques_record
from dflop.shapes import read_shapes
from dflop.scheduler.policy import Policy
from dflop.costmodel.jsonio import load_cost_model


def optimize(shapes_path, costmodel_path, plan_path, candidates_path, *, model: ModelHandle,
             cluster: ClusterSection, planner: PlannerSection, global_batch_size: int, seed: int,
             scheduler: SchedulerSettings = SchedulerSettings.planning(), racing: bool = True, verbose: bool = True,
             shape: ModelShape | None = None, datasets: Sequence[DatasetSpec] = ()) -> SearchResult:
    """Plan the parallel layout; write plan.yaml and candidates.parquet; return the search result.

    model: the resolved model (`ModelHandle`); cluster / planner: the config's sections;
    global_batch_size: train.global_batch_size; seed: run.seed. scheduler: how the online
    scheduler partitions each sampled batch (`SchedulerSettings.for_planning` of the config's
    section: no ILP, so plans do not depend on machine load); racing: successive halving over the sampled batches (see
    `dflop.planner.search`). `shape` overrides the model structure (tests). datasets: the
    config's ``data.datasets``, whose weights (if any) the sampled batches are drawn by.
    """
    t0 = time.perf_counter()
    cost = load_cost_model(costmodel_path)
    check_cost_model_matches(cost, model.spec, costmodel_path)
    shape = shape or ModelShape.from_info(model.info)
    table = read_shapes(shapes_path)
    pool = Pool.from_shapes(table, where=str(shapes_path), llm_tokens_per_tile=shape.llm_tokens_per_tile)
    mix = dataset_mix(table["dataset"].tolist(), datasets)  # None without weights
    if mix is not None:
        pool = replace(pool, draw_p=mix.probabilities)
    cluster = Cluster.from_section(cluster)
    p = planner
    settings = SearchSettings.from_config(p, global_batch=global_batch_size, seed=seed, racing=racing,
                                          scheduler=scheduler)
    result = search(cost, shape, pool, cluster, settings)
    base = result.baseline
    doc = plan_document(
        chosen=result.chosen, mean_shape_step_s=result.milp.objective_s,
        baseline=base.evaluation,
        baseline_mean_shape_s=base.stage_model.objective_s(base.stage_model.split_of(base.evaluation.plan),
                                                           base.stage_model.modes_of(base.evaluation.plan))
        if base.evaluation is not None else None,
        padded_baseline=result.padded_baseline.evaluation if result.padded_baseline is not None else None,
        global_batch=global_batch_size, cluster=cluster,
        solver={"name": "highs (highspy)", "status": result.milp.status, "time_s": result.stats["milp_s"],
                "milps": result.stats["milps"], "statuses": result.stats["milp_statuses"],
                "top_k_proven": result.stats["top_k_proven"], "layouts": result.stats["layouts"],
                "feasible": result.stats["feasible"], "time_limit_s": p.time_limit_s, "rel_gap": p.rel_gap,
                "wall_s": time.perf_counter() - t0},
        evaluation={"sample_batches": p.sample_batches, "seed": seed, "racing": racing, "top_k": p.top_k,
                    "scheduler": {"policy": scheduler.policy, "budget_s": scheduler.budget_s, "ilp": scheduler.ilp}},
        model={"arch": model.spec.arch, "vision": model.spec.vision, "llm": model.spec.llm,
               "weights": model.spec.weights, "dtype": cost.provenance.dtype},
        inputs={"shapes": str(shapes_path), "costmodel": str(costmodel_path)},
        techniques=techniques_record(technique_costs(result.chosen.plan, cost, pool, cluster, result.sizes,
                                                     global_batch=global_batch_size)),
        shape=shape,
    )
    write_plan(doc, plan_path)
    write_candidates(result.candidates, candidates_path)
    if verbose:
        print(summary(result, cluster, global_batch_size, plan_path, candidates_path, shape=shape))
    return result


def summary(result: SearchResult, cluster: Cluster, global_batch: int, plan_path=None, candidates_path=None,
            shape: ModelShape | None = None) -> str:
    """A readable report of the search; `shape` names vision head padding (`describe_plan`)."""
    ev, st = result.chosen, result.stats

    def describe(plan) -> str:
        return describe_plan(plan, shape) if shape is not None else plan.describe()

    lines = [f"plan for {cluster.world_size} GPUs ({cluster.nodes} x {cluster.gpus_per_node}, "
             f"{cluster.gpu_memory_bytes / 1e9:.3g} GB each), global batch {global_batch}:",
             f"  chosen   {describe(ev.plan)}",
             f"           {ev.plan.layout.world_size} GPUs, step {ev.mean_s:.4g} s mean / {ev.p50_s:.4g} p50 / "
             f"{ev.p90_s:.4g} p90 over {len(ev.step_s)} sampled batches, utilisation {100 * ev.mean_utilisation:.1f}%",
             "           memory per stage (GB): " + ", ".join(
                 f"{ev.plan.stage_name(s)} {m / 1e9:.3g}" for s, m in enumerate(ev.memory_bytes))]
    bases = [(result.baseline, "baseline", Policy.MEGATRON)]
    if result.padded_baseline is not None:
        bases.append((result.padded_baseline, "baseline_padded", Policy.PADDED))
    for base, kind, policy in bases:
        b, label = base.evaluation, BASELINE_LABELS[policy]
        if b is not None:
            lines += [f"  baseline {describe(b.plan)} ({label}: uniform split, fixed-count microbatches)",
                      f"           step {b.mean_s:.4g} s mean / {b.p90_s:.4g} p90, utilisation "
                      f"{100 * b.mean_utilisation:.1f}%",
                      f"  predicted speedup over the baseline: {b.mean_s / ev.mean_s:.2f}x vs {label}"]
        else:
            lines.append(f"  baseline: no {label} layout fits (see candidates.parquet, kind == '{kind}')")
    lines.append(f"  search: {st['layouts']} layouts ({st['feasible']} fit in memory), {st['milps']} MILPs "
                 f"{dict(st['milp_statuses'])} in {st['milp_s']:.2f} s solver time, {st['simulated']} plans "
                 f"simulated; top-k {'proven' if st['top_k_proven'] else 'NOT proven (raise planner.top_k)'}")
    schedules = f"schedules {st['schedules_s']:.2f} s, " if st.get("schedules_s", 0) > 0.005 else ""
    lines.append(f"  times: screen {st['screen_s']:.2f} s, MILPs {st['milp_wall_s']:.2f} s, {schedules}simulation "
                 f"{st['simulate_s']:.2f} s, baseline {st['baseline_s']:.2f} s, total {st['wall_s']:.2f} s")
    if plan_path is not None:
        lines.append(f"  wrote {plan_path} and {candidates_path}")
    return "\n".join(lines)
