"""The data-blind baseline layout (Megatron-style), evaluated exactly like the DFLOP plan.

What a data-blind stack runs: the vision tower colocated on the first LLM stage (torchtitan,
Megatron), or, as Megatron-Core's ``--encoder-pipeline-model-parallel-size 1`` and
``--encoder-tensor-model-parallel-size`` run it, on a pipeline stage of its own before the LLM's
with its own TP degree and one encoder per LLM replica (placement "disjoint", ``dp_v = dp_l``: the
way to train an encoder whose heads no LLM TP degree divides, such as InternViT-6B's 25); LLM
layers split uniformly over the stages (``llm_layers % pp == 0``), as many data-parallel replicas
as fit (the largest ``dp`` that `Cluster.launchable` allows, and the largest such divisor of the
global batch), and microbatches of a fixed sample count (``global_batch % (m * dp) == 0``) cut
from the batch in order. Among those layouts the baseline is the best one by the same simulation over the same
sampled batches (the mean-shape step picks which `simulate` of them are simulated), so the
reported speedup is what data awareness buys over a tuned data-blind layout, not over a bad one.

With more LLM schedules allowed (`planner.schedules`), the packed baseline's best layout is also
simulated under each (`baseline_schedules`): Megatron-LM's virtual pipeline stages (interleaved
1F1B, layers split uniformly over the ``pp x chunks`` chunks, so ``llm_layers % (pp x chunks) ==
0`` as Megatron requires) and ZB-H1 on its uniform split, where their in-flight activations fit;
the fastest is the baseline. The padded (HF/LLaVA) baseline stays 1F1B: that trainer has no
other schedule.

Two data-blind trainers are searched over the same layouts (`BASELINE_POLICIES`): "megatron"
packs each microbatch's samples into one sequence; "padded" is the HF/LLaVA trainer, which pads
them to the microbatch's longest sample (`dflop.scheduler.padded.padded_pool`). Their
candidates.parquet rows are kinds "baseline" and "baseline_padded".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.plan import Layout, Plan
from dflop.scheduler.policy import Policy
from dflop.planner.candidates import evaluation_columns, plan_columns
from dflop.pricing.cluster import Cluster
from dflop.planner.expected import Evaluation, schedule_priced
from dflop.planner.means import Granularity
from dflop.planner.screen import SearchSpace
from dflop.planner.stages import StageModel, TransferMeans
from dflop.planner.technique_choice import TechniqueMeans

BASELINE_POLICIES = (Policy.MEGATRON, Policy.PADDED)
# Model chunks per rank the planner and the Megatron-style baseline try for interleaved 1F1B. Only
# 2: each further v is one more exact simulation of every screened layout (the simulator compiles
# a graph of dp x pp x v rows x m microbatches per layout), which at 1024 GPUs cost seconds of
# planning for no plan of the paper configurations (v = 2, 3, 4 tried: only 2 was ever chosen).
INTERLEAVE_CHUNKS = (2,)
ROW_KIND = {Policy.MEGATRON: "baseline", Policy.PADDED: "baseline_padded"}


@dataclass(frozen=True)
class BaselineResult:
    """The chosen baseline (None when no data-blind layout runs) and one row per layout tried."""

    evaluation: Evaluation | None
    stage_model: StageModel | None
    rows: list[dict]


def baseline_layouts(space: SearchSpace, cluster: Cluster) -> tuple[list[Layout], list[dict]]:
    """Every data-blind layout, and rejection rows for (tp, pp, m) that break its divisibility rules."""
    layouts, rejected = _colocated_layouts(space, cluster)
    return layouts + _encoder_stage_layouts(space, cluster), rejected


def _encoder_stage_layouts(space: SearchSpace, cluster: Cluster) -> list[Layout]:
    """Megatron-Core's encoder pipeline stage (module docstring): per replica one vision tower of TP
    ``tp_v`` before ``pp`` uniform LLM stages of TP ``tp_l``; the replica counts and microbatches as
    for the colocated layouts; layouts that break these rules are not listed (no rejection rows)."""
    W, B, L = cluster.world_size, space.global_batch, space.llm_layers
    layouts = []
    for tv in space.vision_tp:
        for t in (t for t in space.llm_tp if t >= tv):  # Megatron-Core: no encoder TP above the decoder's
            for pp in (p for p in range(1, L + 1) if L % p == 0):
                per_replica = tv + t * pp
                dps = np.arange(W // per_replica, 0, -1)
                dps = dps[cluster.launchable(dps * per_replica, dps * tv, t)]
                if len(dps) == 0:
                    continue
                dividing = dps[B % dps == 0]
                for dp in sorted({int(dps[0]), *(int(d) for d in dividing[:1])}):
                    layouts += [Layout("disjoint", tv, 1, dp, t, pp, dp, m) for m in space.microbatches
                                if B % (m * dp) == 0]
    return layouts


def _colocated_layouts(space: SearchSpace, cluster: Cluster) -> tuple[list[Layout], list[dict]]:
    """The colocated data-blind layouts, and rejection rows for (tp, pp, m) that break their rules."""
    W, B, L = cluster.world_size, space.global_batch, space.llm_layers
    layouts, rejected = [], []
    for t in space.shared_tp:
        for pp in range(1, L + 1):
            if L % pp:
                rejected.append(_row("rejected", "divisibility", f"uniform split: {L} llm layers not divisible by "
                                     f"pp={pp}", tp_v=t, tp_l=t, pp_l=pp))
                continue
            dp_max = W // (t * pp)
            if dp_max < 1:
                break
            launchable = cluster.launchable_dps(t * pp, dp_max, t)
            if len(launchable) == 0:
                rejected.append(_row("rejected", "divisibility", f"replicas of {t * pp} GPUs (tp {t} x pp {pp}) fill "
                                     f"no whole {cluster.gpus_per_node}-GPU node", tp_v=t, tp_l=t, pp_l=pp))
                continue
            dividing = launchable[B % launchable == 0]
            dps = sorted({int(launchable[0]), *(int(d) for d in dividing[:1])})
            for dp in dps:
                for m in space.microbatches:
                    if B % (m * dp):
                        rejected.append(_row("rejected", "divisibility", f"fixed-count microbatches: global batch "
                                             f"{B} not divisible by m x dp = {m} x {dp}", tp_v=t, tp_l=t, pp_l=pp,
                                             dp_v=dp, dp_l=dp, m=m))
                    else:
                        layouts.append(Layout("colocated", t, 1, dp, t, pp, dp, m))
    return layouts, rejected


def search_baseline(space: SearchSpace, means: TechniqueMeans, cluster: Cluster, transfer: TransferMeans,
                    granularity: Granularity, evaluate, *, simulate: int = 4, policy: Policy = Policy.MEGATRON,
                    also: tuple[Layout, ...] = (), schedules: tuple[str, ...] = ("1f1b",)) -> BaselineResult:
    """The best data-blind layout for `policy` (one of `BASELINE_POLICIES`); `evaluate(plan) ->
    Evaluation` runs the sampled batches under that policy. Layouts are ranked for simulation by
    the packed mean-shape step (there is no padded one), so with few `simulate` the padded search
    may miss a layout that padding favours (more microbatches, less padding).

    Each layout uses the memory techniques its uniform split needs, chosen as for the data-aware
    plans (`technique_choice.settle`: the fastest recompute mode per stage that fits, sharding and
    SP only where needed), so the baseline is tuned with the same techniques available. Layouts in
    `also` are simulated whatever their rank (the other baseline's choice: neither baseline may lose
    to a layout only the other one simulated)."""
    if policy not in ROW_KIND:
        raise ValueError(f"policy must be one of {BASELINE_POLICIES}, got {policy!r}")
    layouts, rows = baseline_layouts(space, cluster)
    scored = []
    for lay in layouts:
        split = np.r_[[space.vision_layers] * lay.n_vision_stages, [space.llm_layers // lay.pp_l] * lay.pp_l]
        settled = means.fit(lay, split, cluster=cluster, global_batch=space.global_batch, transfer=transfer,
                            granularity=granularity)
        if settled is None:
            sm = means.stage_model(lay, means.leanest(lay), cluster=cluster, global_batch=space.global_batch,
                                   transfer=transfer, granularity=granularity)
            need = sm.lean_memory_at(split)
            s = int(np.argmax(need - sm.memory_bytes))
            plan = sm.plan(split)
            rows.append(_row("rejected", "memory", f"uniform split needs {need[s] / 1e9:.3g} GB on "
                             f"{plan.stage_name(s)} with every memory technique", plan=plan))
            continue
        sm, modes = settled
        scored.append((sm.objective_s(split, modes), sm, sm.plan(split, modes)))
    scored.sort(key=lambda x: x[0])
    best: tuple[Evaluation, StageModel] | None = None
    best_row = -1
    for rank, (objective, sm, plan) in enumerate(scored):
        if rank >= simulate and best is not None and plan.layout not in also:
            rows.append(_row("pruned", "bound", "not among the best data-blind layouts by the mean-shape step",
                             plan=plan, milp_objective_s=objective))
            continue
        ev = evaluate(plan)
        if ev.policy != policy:
            raise ValueError(f"evaluate simulated policy {ev.policy!r}, the baseline searched is {policy!r}")
        rows.append(_row("simulated" if ev.ok else "rejected", "" if ev.ok else "memory", ev.failure or "",
                         plan=plan, milp_objective_s=objective, evaluation=ev))
        if ev.ok and (best is None or ev.mean_s < best[0].mean_s):
            best, best_row = (ev, sm), len(rows) - 1
    for row in rows:
        row["kind"] = ROW_KIND[policy]
    if best is not None and policy == "megatron":
        kw = dict(cluster=cluster, global_batch=space.global_batch, transfer=transfer, granularity=granularity)
        for plan in baseline_schedules(best[0].plan, schedules):
            sm = means.stage_model(plan.layout, (*best[1].shard, best[1].sequence_parallel), **kw)
            if not sm.fits(sm.split_of(plan), sm.modes_of(plan)):
                rows.append(_row("rejected", "memory", "the schedule's in-flight activations do not fit the "
                                 "uniform split", plan=plan, kind=ROW_KIND[policy]))
                continue
            ev = evaluate(plan)
            rows.append(_row("simulated" if ev.ok else "rejected", "" if ev.ok else "memory", ev.failure or "",
                             plan=plan, evaluation=ev, kind=ROW_KIND[policy]))
            if ev.ok and ev.mean_s < best[0].mean_s:
                best, best_row = (ev, best[1]), len(rows) - 1
    if best is None:
        return BaselineResult(None, None, rows)
    rows[best_row]["status"] = "chosen"
    return BaselineResult(best[0], best[1], rows)


def baseline_schedules(plan: Plan, schedules: tuple[str, ...]) -> list[Plan]:
    """The 1F1B data-blind `plan` under the other schedules `schedules` allows, as Megatron-LM runs
    them: ZB-H1 on its split; interleaved with v in `INTERLEAVE_CHUNKS` virtual stages per rank where the LLM's
    layers split uniformly into pp x v chunks and m is a multiple of pp. ZB-H1 only where no LLM rank
    recomputes fully (`schedule_priced`)."""
    lay = plan.layout
    if lay.pp_l < 2:
        return []
    out = [plan.with_schedule("zb-h1")] if "zb-h1" in schedules else []
    out = [x for x in out if schedule_priced(x)]
    n = sum(plan.llm_layers)
    if "interleaved" in schedules and lay.m % lay.pp_l == 0:
        out += [plan.with_schedule("interleaved", v) for v in INTERLEAVE_CHUNKS if n % (lay.pp_l * v) == 0]
    return out


def _row(status: str, reason: str, detail: str, *, plan: Plan | None = None, evaluation: Evaluation | None = None,
         milp_objective_s: float | None = None, **layout) -> dict:
    row = {"kind": "baseline", "level": "layout" if plan else "degree", "placement": "colocated", "status": status,
           "reason": reason, "detail": detail, **layout}
    if plan is not None:
        row.update(plan_columns(plan))
    if milp_objective_s is not None:
        row["mean_shape_step_s"] = milp_objective_s
    if evaluation is not None:
        row.update(evaluation_columns(evaluation))
    return row
