"""`dflop simulate --plan plan.yaml [--gpus N] [--shapes other.parquet]`: re-evaluate a plan.

Users ask this before buying GPU hours: how fast would this plan run on other data, or on N GPUs?
The plan (and its data-blind baselines: Megatron-style packed, HF/LLaVA padded) is simulated over
sampled global batches exactly as the optimizer did (`dflop.planner.expected`), with the cost
model and cluster recorded in plan.yaml unless overridden, and a Gantt chart of a median batch is
drawn. The summary ends with what the plan's memory techniques cost and save per stage
(`dflop.planner.techniques`), or says none is on.

With ``gpus=N`` the plan keeps its TP and PP degrees, layer split and microbatch count and scales
data parallelism to fit N GPUs: colocated ``dp = N // (tp * pp)``; disjoint keeps the vision/LLM
GPU ratio (LLM dp rounded, the vision tower takes what is left). The global batch scales with the
GPUs (the plan's samples per GPU are kept) unless ``global_batch`` gives it; LLM dp is capped so
every bin gets a sample, and the summary says how many GPUs the scaled plan really uses. Each baseline
keeps its form (`scale_baseline`: colocated, or one encoder stage per LLM replica) and its
fixed-count microbatches (dp reduced to a divisor of the batch). Like the
optimizer, scaling keeps only layouts `Cluster.launchable` allows (whole nodes, LLM TP groups
inside a node), stepping dp down until one is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd

from dflop.costmodel.model import CostModel, charged_load_line
from dflop.errors import UserError
from dflop.models.handle import ModelHandle
from dflop.finite import check_finite_values
from dflop.plan import Layout, Plan, PlanFile, read_plan, whole_number
from dflop.pricing.cluster import Cluster
from dflop.planner.expected import Evaluation, evaluate_plan, sample_batches, simulate_batch
from dflop.pricing.pool import Pool, TransferSizes
from dflop.planner.inputs import check_cost_model_matches
from dflop.planner.planfile import BASELINE_LABELS
from dflop.planner.space import ModelShape
from dflop.planner.techniques import format_techniques, technique_costs
from dflop.shapes import read_shapes
from dflop.scheduler.policy import Policy
from dflop.scheduler.settings import SchedulerSettings
from dflop.costmodel.jsonio import load_cost_model


@dataclass(frozen=True)
class WhatIf:
    """The re-evaluated plan and baselines (Megatron-style packed `baseline`, HF/LLaVA
    `padded_baseline`; None when plan.yaml has none or it cannot be scaled), the chart written, the
    plan's memory techniques with their costs per stage (`technique_costs`), which cost model priced
    it, what a training run of the plan measured against its predictions (if one was given), and
    whether the host's loading of the samples is charged (`loading_note`)."""

    plan: Evaluation
    baseline: Evaluation | None
    cluster: Cluster
    gantt_png: Path | None
    notes: tuple[str, ...]
    techniques: pd.DataFrame | None = None
    cost_model: str = ""
    measured: str | None = None
    loading: str | None = None
    padded_baseline: Evaluation | None = None


@dataclass(frozen=True)
class PlanContext:
    """Everything needed to re-simulate plan.yaml as the optimizer judged it.

    shapes_path / costmodel_path: the inputs used (plan.yaml's unless overridden); seed and
    sample_batches: the recorded evaluation settings; scheduler: the recorded scheduler settings.
    """

    plan_file: PlanFile
    cost: CostModel
    shape: ModelShape
    pool: Pool
    cluster: Cluster
    sizes: TransferSizes
    scheduler: SchedulerSettings
    seed: int
    sample_batches: int
    shapes_path: str | Path
    costmodel_path: str | Path


def load_plan_context(plan_path, *, shapes_path=None, costmodel_path=None, shape: ModelShape | None = None) -> PlanContext:
    """Read plan.yaml and the inputs it names (or the ones given); one-line UserErrors for missing keys."""
    pf = read_plan(plan_path)
    doc = pf.doc
    inputs, evaluation = _section(doc, "inputs", plan_path), _section(doc, "evaluation", plan_path)
    shapes_path = shapes_path or inputs.get("shapes")
    costmodel_path = costmodel_path or inputs.get("costmodel")
    if not shapes_path or not costmodel_path:
        raise UserError(f"{plan_path}: inputs.shapes / inputs.costmodel missing; pass --shapes and --costmodel")
    cost = load_cost_model(costmodel_path)
    if shape is None:
        spec = pf.model_spec()
        check_cost_model_matches(cost, spec, costmodel_path)
        shape = ModelShape.from_info(ModelHandle.resolve(spec).info)
    pool = Pool.from_shapes(read_shapes(shapes_path), where=str(shapes_path), llm_tokens_per_tile=shape.llm_tokens_per_tile)
    cluster = Cluster.from_record(doc.get("cluster"), str(plan_path))
    sizes = TransferSizes.for_model(llm_hidden=shape.llm_hidden, vision_hidden=shape.vision_hidden,
                                    vision_tokens_per_tile=shape.vision_tokens_per_tile, dtype=cost.provenance.dtype)
    recorded = _section(evaluation, "scheduler", f"{plan_path}: evaluation")
    planning = SchedulerSettings.planning()  # what optimize scores with, where plan.yaml records nothing
    budget_s = recorded.get("budget_s", planning.budget_s)
    check_finite_values([("evaluation.scheduler.budget_s", budget_s)], str(plan_path), positive=True)
    scheduler = replace(planning, budget_s=float(budget_s), ilp=str(recorded.get("ilp", planning.ilp)))
    seed = whole_number(evaluation.get("seed", 0), f"{plan_path}: evaluation.seed", minimum=0)
    batches = whole_number(evaluation.get("sample_batches", 8), f"{plan_path}: evaluation.sample_batches")
    return PlanContext(pf, cost, shape, pool, cluster, sizes, scheduler, seed=seed, sample_batches=batches,
                       shapes_path=shapes_path, costmodel_path=costmodel_path)


def _section(doc: Mapping, key: str, where) -> Mapping:
    """A recorded plan.yaml section (absent: empty); one-line UserError when it is not a mapping."""
    value = doc.get(key) or {}
    if not isinstance(value, Mapping):
        raise UserError(f"{where}: {key}: expected a mapping, got {value!r}")
    return value


def scale_plan(plan: Plan, cluster: Cluster, global_batch: int) -> Plan:
    """`plan` with its data parallelism scaled to the GPUs of `cluster` (module docstring), keeping
    only layouts `Cluster.launchable` allows."""
    lay, gpus, gpus_per_node = plan.layout, cluster.world_size, cluster.gpus_per_node
    for module, tp in (("vision", lay.tp_v), ("llm", lay.tp_l)):
        if gpus_per_node % tp:
            raise UserError(f"--gpus {gpus}: {module} tp={tp} does not fit in a {gpus_per_node}-GPU node")
    per_llm = lay.tp_l * lay.pp_l
    cap = global_batch // lay.m
    if lay.colocated:
        dps = cluster.launchable_dps(per_llm, min(gpus // per_llm, cap), lay.tp_l)
        if len(dps) == 0:
            raise UserError(f"--gpus {gpus}: no replica count of this plan (tp {lay.tp_l} x pp {lay.pp_l} GPUs "
                            f"each) fills whole {gpus_per_node}-GPU nodes")
        dp = int(dps[0])
        new = Layout("colocated", lay.tp_l, 1, dp, lay.tp_l, lay.pp_l, dp, lay.m, lay.schedule, lay.chunks)
        return Plan(new, plan.vision_layers, plan.llm_layers, plan.source, plan.vision_techniques, plan.llm_techniques)
    per_vision = lay.tp_v * lay.pp_v
    if gpus < per_vision + per_llm:
        raise UserError(f"--gpus {gpus}: this disjoint plan needs at least {per_vision + per_llm} GPUs "
                        f"(one vision replica of {per_vision} and one LLM replica of {per_llm})")
    dp_l = max(1, min(round(lay.dp_l * gpus / lay.world_size), cap, (gpus - per_vision) // per_llm))
    dls = np.arange(dp_l, 0, -1)  # the LLM side as close to the plan's share as can be launched
    dvs = cluster.largest_launchable_vision_dp((gpus - dls * per_llm) // per_vision, per_vision, dls * per_llm,
                                               lay.tp_l)
    for dl, dv in zip(dls.tolist(), dvs.tolist()):
        if dv:
            new = Layout("disjoint", lay.tp_v, lay.pp_v, dv, lay.tp_l, lay.pp_l, dl, lay.m, lay.schedule, lay.chunks)
            return Plan(new, plan.vision_layers, plan.llm_layers, plan.source, plan.vision_techniques, plan.llm_techniques)
    raise UserError(f"--gpus {gpus}: no split of this disjoint plan over whole {gpus_per_node}-GPU nodes keeps "
                    f"the LLM's tp={lay.tp_l} groups inside a node")


def scale_baseline(plan: Plan, cluster: Cluster, global_batch: int) -> Plan | None:
    """The data-blind baseline on the GPUs of `cluster`, or None if no launchable dp keeps
    fixed-count microbatches.

    It keeps its form (`dflop.planner.baseline`): colocated, or Megatron-Core's encoder stage, one
    vision tower of its own TP before each LLM replica (``dp_v = dp_l``), and takes as many
    replicas as `Cluster.launchable` allows and the global batch splits into."""
    lay = plan.layout
    vision_per_replica = lay.tp_v * lay.pp_v if not lay.colocated else 0
    per_replica = vision_per_replica + lay.tp_l * lay.pp_l
    dps = np.arange(cluster.world_size // per_replica, 0, -1)
    dps = dps[cluster.launchable(dps * per_replica, dps * vision_per_replica, lay.tp_l)]
    dps = dps[global_batch % (lay.m * dps) == 0]
    if len(dps) == 0:
        return None
    dp = int(dps[0])
    new = Layout(lay.placement, lay.tp_v, lay.pp_v, dp, lay.tp_l, lay.pp_l, dp, lay.m, lay.schedule, lay.chunks)
    return Plan(new, plan.vision_layers, plan.llm_layers, plan.source, plan.vision_techniques, plan.llm_techniques)


def simulate_plan(plan_path, *, gpus: int | None = None, global_batch: int | None = None, shapes_path=None,
                  out_png=None, costmodel_path=None, sample_batches_k: int | None = None, seed: int | None = None,
                  verbose: bool = True, shape: ModelShape | None = None, measured: str | None = None) -> WhatIf:
    """Re-evaluate plan.yaml (optionally on `gpus` GPUs and/or other shapes); draw the Gantt chart.

    The plan (and its baselines) is first checked against the model and its recorded cluster
    (`Plan.check`). gpus: scale data parallelism to this many GPUs; global_batch: the global
    batch to simulate (default: plan.yaml's, scaled by gpus / the plan's world size when `gpus` is
    given). shapes_path / costmodel_path default to the ones recorded in plan.yaml;
    sample_batches_k, seed and the scheduler settings to its evaluation settings; out_png: where to
    write the Gantt chart (None: no chart). `shape` overrides the model structure (tests).
    measured: what a training run of this plan measured against its predictions (a sentence,
    `dflop.runtime.metrics.PredictionAgreement.describe`), repeated in the summary: the sampled
    p10-p90 is the spread over batches, this is how far the cost model itself was off.
    """
    ctx = load_plan_context(plan_path, shapes_path=shapes_path, costmodel_path=costmodel_path, shape=shape)
    pf, cost, pool, cluster, sizes, scheduler = ctx.plan_file, ctx.cost, ctx.pool, ctx.cluster, ctx.sizes, ctx.scheduler
    shapes_path = ctx.shapes_path
    replace(pf.plan, source=str(plan_path)).check(ctx.shape, cluster)
    bases = {policy: b for policy, b in ((Policy.MEGATRON, pf.baseline), (Policy.PADDED, pf.padded_baseline))
             if b is not None}
    for policy, b in bases.items():
        replace(b, source=f"{plan_path}: {_BASELINE_KEY[policy]}").check(ctx.shape, cluster)
    plan, notes = pf.plan, []
    if gpus is not None:
        cluster = cluster.with_gpus(int(gpus))
    B = scaled_global_batch(pf, cluster if gpus is not None else None, global_batch, notes)
    if gpus is not None:
        plan = scale_plan(plan, cluster, B)
        used = plan.layout.world_size
        notes.append(f"scaled to {cluster.world_size} GPUs: {plan.layout.describe()}"
                     + (f" (uses {used} of the {cluster.world_size} GPUs)" if used < cluster.world_size else ""))
        for policy in list(bases):
            bases[policy] = scale_baseline(bases[policy], cluster, B)
            if bases[policy] is None:
                notes.append(f"{_BASELINE_KEY[policy]}: no dp keeps fixed-count microbatches on this many GPUs")
    elif global_batch is not None:
        if B < plan.layout.m * plan.layout.dp_l:
            raise UserError(f"--global-batch {B} cannot fill the plan's m x llm dp = {plan.layout.m} x "
                            f"{plan.layout.dp_l} microbatch bins")
        for policy, b in list(bases.items()):
            if B % (b.layout.m * b.layout.dp_l):
                notes.append(f"{_BASELINE_KEY[policy]}: global batch {B} does not split into its fixed-count "
                             f"microbatches (m x dp = {b.layout.m} x {b.layout.dp_l})")
                bases[policy] = None
    if len(pool) < B:
        notes.append(f"{shapes_path} has {len(pool)} usable samples, fewer than the global batch of {B}: batches "
                     "are drawn with replacement")
    k = int(sample_batches_k or ctx.sample_batches)
    seed = ctx.seed if seed is None else int(seed)
    batches = sample_batches(len(pool), k, B, seed)
    ev = evaluate_plan(plan, cost, pool, batches, cluster, sizes, scheduler, seed=seed)
    if not ev.ok:
        raise UserError(f"plan {plan.describe()} cannot run on {shapes_path}: {ev.failure}")
    evaluated = {}
    for policy, b in bases.items():
        if b is None:
            continue
        evaluated[policy] = evaluate_plan(b, cost, pool, batches, cluster, sizes, replace(scheduler, policy=policy),
                                          seed=seed)
        if not evaluated[policy].ok:
            notes.append(f"{_BASELINE_KEY[policy]} {b.describe()} cannot run: {evaluated.pop(policy).failure}")
    png = None
    if out_png is not None:
        from dflop.sim import plot_gantt  # matplotlib: only when drawing

        median = int(sorted(range(len(ev.step_s)), key=lambda i: ev.step_s[i])[len(ev.step_s) // 2])
        _, timeline = simulate_batch(plan, cost, pool.take(batches[median]), cluster, sizes, scheduler, seed=seed + median)
        png = plot_gantt(timeline, out_png, title=f"{plan.layout.describe()}: step {timeline.step_s:.4g} s "
                         f"(median of {len(ev.step_s)} sampled batches), idle {100 * timeline.idle_fraction():.1f}%")
    techniques = technique_costs(plan, cost, pool, cluster, sizes, global_batch=B)
    result = WhatIf(ev, evaluated.get(Policy.MEGATRON), cluster, png, tuple(notes), techniques,
                    cost_model=f"{ctx.costmodel_path}: {cost.provenance.describe()}", measured=measured,
                    loading=loading_note(cost, cluster, pool, B), padded_baseline=evaluated.get(Policy.PADDED))
    if verbose:
        print(whatif_summary(result, B, shapes_path))
    return result


_BASELINE_KEY = {Policy.MEGATRON: "baseline", Policy.PADDED: "padded_baseline"}  # plan.yaml's section of each policy


def loading_note(cost: CostModel, cluster: Cluster, pool: Pool, global_batch: int) -> str | None:
    """Whether the steps are charged the host's per-sample load (`Pricing.load_s`: on CPU clusters,
    with a measured load line) and how much it is, or None when the cost model has no load line."""
    line = cost.step_costs.loading
    if line is None:
        return None
    per_sample = line(pool.load_features)
    size = f"{1e3 * float(per_sample.mean()):.3g} ms per sample on average (line fitted on {line.n_samples} samples)"
    if charged_load_line(cost.step_costs_on(cluster.device), cluster.device) is not None:  # as Pricing.load_s
        return (f"charged to the stage that decodes each sample, {size}: "
                f"{float(per_sample.mean()) * global_batch:.3g} s of host time per global batch")
    return f"not charged on GPUs (the next step's samples load behind this one); measured {size}"


def scaled_global_batch(pf: PlanFile, cluster: Cluster | None, global_batch: int | None, notes: list[str]) -> int:
    """The global batch a what-if simulates on `cluster` (None: the plan's own), saying in `notes`
    what it chose: `global_batch` when given; else the plan's batch scaled with the GPUs. With a
    baseline, the scaling keeps the baseline's samples per microbatch and multiplies its replicas
    (the largest launchable count), so its fixed-count microbatches still divide the batch;
    without one, the plan's samples per GPU are kept."""
    planned, world = pf.global_batch_size, pf.plan.layout.world_size
    if global_batch is not None:
        if global_batch < 1:
            raise UserError(f"--global-batch must be >= 1, got {global_batch}")
        if global_batch != planned:
            notes.append(f"global batch {global_batch} (--global-batch; the plan was made for {planned})")
        return int(global_batch)
    if cluster is None or cluster.world_size == world:
        return planned
    base = pf.baseline.layout if pf.baseline is not None else None
    per_replica = base.tp_l * base.pp_l if base is not None else 0
    dps = cluster.launchable_dps(per_replica, cluster.world_size // per_replica, base.tp_l) if base else []
    if base is not None and len(dps) and planned % (base.m * base.dp_l) == 0:
        per_microbatch = planned // (base.m * base.dp_l)
        scaled = per_microbatch * base.m * int(dps[0])
        how = (f"the baseline's {per_microbatch} samples per microbatch x {base.m} microbatches on {int(dps[0])} "
               "replicas")
    else:
        scaled = max(1, round(planned * cluster.world_size / world))
        how = f"the plan's {planned / world:.3g} samples per GPU"
    notes.append(f"global batch {planned} -> {scaled}: {how} on {cluster.world_size} GPUs (--global-batch sets "
                 "another)")
    return scaled


def whatif_summary(w: WhatIf, global_batch: int, shapes_path) -> str:
    ev = w.plan
    lines = [f"what-if on {w.cluster.world_size} GPUs with {shapes_path} (global batch {global_batch}):"]
    lines += [f"  note: {n}" for n in w.notes]
    if w.cost_model:
        lines.append(f"  cost model: {w.cost_model}")
    if w.loading:
        lines.append(f"  sample loading: {w.loading}")
    lines.append(f"  training run of this plan: {w.measured}" if w.measured is not None else
                 "  training run of this plan: none given (--metrics), so how far the cost model is off is unknown")
    lines += [f"  plan     {ev.plan.describe()}",
              f"           step {ev.p10_s:.4g} / {ev.p50_s:.4g} / {ev.p90_s:.4g} s p10 / p50 / p90 over "
              f"{len(ev.step_s)} sampled batches (mean {ev.mean_s:.4g} s), {global_batch / ev.mean_s:.4g} samples/s, "
              f"utilisation {100 * ev.mean_utilisation:.1f}%",
              "           memory per stage (GB): " + ", ".join(
                  f"{ev.plan.stage_name(s)} {m / 1e9:.3g}" for s, m in enumerate(ev.memory_bytes))]
    for base in (w.baseline, w.padded_baseline):
        if base is not None:
            label = BASELINE_LABELS[base.policy]
            lines += [f"  baseline ({label}) {base.plan.describe()}: step {base.mean_s:.4g} s mean",
                      f"  predicted speedup over the baseline: {base.mean_s / ev.mean_s:.2f}x vs {label}"]
    if w.techniques is not None:
        lines += ["  " + line for line in format_techniques(w.techniques).splitlines()]
    if w.gantt_png is not None:
        lines.append(f"  Gantt chart: {w.gantt_png}")
    return "\n".join(lines)
