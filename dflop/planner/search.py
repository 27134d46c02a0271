"""The data-aware 3D-parallelism search: screen -> MILP per layout -> simulate the best.

1. `build_space`: admissible TP degrees and microbatch counts (rejections recorded).
2. `screen`: every layout (placement, degrees, m) gets an exact memory-feasibility test and a lower
   bound on its mean-shape step; the best `keep` feasible layouts are kept, best bound first.
3. MILP per layout (`solve_split`) in bound order (`milp.objective_bound_s`: bottleneck + stage sum
   + the least all-reduce tail any split can have) until the next bound cannot beat the
   `n_prescreen`-th best objective found: those are then the best by the MILP
   objective among all layouts ("top_k_proven"). Every kept layout left unsolved is a candidate
   row of its own: pruned, reason milp_bound (its bound and the objective it could not beat) or
   max_milps (the solver budget ran out before its bound was reached).
4. Prescreen: the best `prescreen` layouts by MILP objective are simulated on the first sampled
   batch split by plain LPT (`quick_step_s`: an upper bound of the online scheduler's step on that
   batch). This catches what the mean-shape objective cannot see — bins of one or two samples,
   vision/LLM imbalance of real batches — at one simulation per plan. The best top_k go on.
5. The top_k are simulated over the same `sample_batches` global batches sampled from the data,
   each partitioned by the online scheduler (`dflop.planner.expected`); the lowest mean step wins
   (ties: fewer GPUs). With ``racing`` the batches are spent by successive halving: all candidates
   on 1 batch, the better half on 2, ... until the last ones have all K (same batches for all, so
   the comparison is paired); this approximates simulating everything on K batches at a fraction of
   the cost on large clusters.
6. The data-blind baselines (`dflop.planner.baseline`: Megatron packed, HF/LLaVA padded) on the same batches.

Pipeline schedules (`planner.schedules`, default 1F1B only): before the prescreen, each of the best
`n_prescreen` layouts' 1F1B plans is re-timed under every other schedule the setting allows
(`_choose_schedules`: ZB-H1 on the same split; interleaved 1F1B with `INTERLEAVE_CHUNKS` chunks per
rank, each rank's layers split evenly over its chunks) on the first sampled batch's LPT partition;
the fastest that still fits the layout's memory under the schedule's in-flight counts (its
techniques settled again where the 1F1B ones no longer fit) replaces it (ties keep 1F1B), and
keeps its place in the race only while it simulates faster than the 1F1B plan on the same
batches. One partition and a few simulations per layout, no extra MILP: the layer split is the
1F1B one (a rank's total layers), which the MILP chose for 1F1B.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, fields, replace

import numpy as np
import pandas as pd

from dflop.config import Config, PlannerSection
from dflop.costmodel.model import CostModel
from dflop.errors import UserError
from dflop.plan import PIPELINE_SCHEDULES, Layout, Plan
from dflop.planner.baseline import INTERLEAVE_CHUNKS, BaselineResult, search_baseline
from dflop.planner.candidates import candidates_frame, evaluation_columns, plan_columns
from dflop.pricing.cluster import Cluster
from dflop.planner.expected import (Evaluation, evaluate_plan, quick_step_s, run_partition,
                                   sample_batches, schedule_priced, schedule_step_s)
from dflop.pricing.pricing import Pricing
from dflop.planner.means import Granularity
from dflop.pricing.pool import Pool, TransferSizes
from dflop.planner.milp import SplitResult, objective_bound_s, solve_split
from dflop.planner.screen import ScreenResult, SearchSpace, layout_of, screen
from dflop.planner.space import ModelShape, build_space
from dflop.scheduler.policy import Policy
from dflop.scheduler.settings import SchedulerSettings
from dflop.planner.stages import StageModel, TransferMeans, min_peak_split
from dflop.planner.technique_choice import TechniqueMeans, TechniqueSpace


@dataclass(frozen=True)
class SearchSettings:
    """Knobs of the search: the config's planner section, train.global_batch_size (global_batch) and
    run.seed, whose defaults are the schema's only (`from_config`), then the search's own.

    prescreen: layouts (best by MILP objective) ranked by the LPT simulation before the top_k are
    chosen (default max(2 top_k, 16)); keep: layouts kept by the screen for the tighter bound
    (default max(2048, 8 prescreen)); max_milps:
    MILP solver calls at most (default max(64, 4 top_k)); baseline_simulate: data-blind layouts
    simulated; milp_cutoff: once n_prescreen objectives are known, each MILP first asks HiGHS for a
    split at or below the n_prescreen-th best objective and is pruned (milp_bound) when none exists.
    """

    planner: PlannerSection
    global_batch: int
    seed: int
    racing: bool = True
    prescreen: int | None = None
    keep: int | None = None
    max_milps: int | None = None
    baseline_simulate: int = 4
    milp_cutoff: bool = True
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings.planning)

    @classmethod
    def from_config(cls, planner: PlannerSection | None = None, *, global_batch: int | None = None,
                    seed: int | None = None, **others) -> "SearchSettings":
        """The settings of the config's planner section, train.global_batch_size and run.seed (each
        None: the schema's default, as a config without the key reads); `others`: the search's own
        fields, or planner keys set over the section (tests, benchmarks)."""
        if planner is None or global_batch is None or seed is None:
            empty = Config.from_dict({})
            planner = planner or empty.planner
            global_batch = empty.train.global_batch_size if global_batch is None else global_batch
            seed = empty.seed if seed is None else seed
        keys = {f.name for f in fields(PlannerSection)}
        planner = replace(planner, **{k: v for k, v in others.items() if k in keys})
        return cls(planner, global_batch, seed, **{k: v for k, v in others.items() if k not in keys})

    @property
    def technique_space(self) -> TechniqueSpace:
        p = self.planner
        return TechniqueSpace.of(p.recompute, p.shard_optimizer, p.sequence_parallel)

    @property
    def schedules(self) -> tuple[str, ...]:
        """LLM pipeline schedules the planner may choose (``planner.schedules``)."""
        return tuple(self.planner.schedules)

    @property
    def n_prescreen(self) -> int:
        return max(self.planner.top_k, self.prescreen or max(2 * self.planner.top_k, 16))

    def __post_init__(self):
        """Planner keys set directly (`from_config`'s `others`) bypass the schema: checked here."""
        for key, value in (("planner.sample_batches", self.planner.sample_batches),
                           ("planner.top_k", self.planner.top_k), ("baseline_simulate", self.baseline_simulate)):
            if int(value) != value or value < 1:
                raise UserError(f"{key} must be a whole number >= 1, got {value!r}")
        if not self.planner.time_limit_s > 0:
            raise UserError(f"planner.time_limit_s must be > 0, got {self.planner.time_limit_s!r}")
        if not self.planner.rel_gap >= 0:
            raise UserError(f"planner.rel_gap must be >= 0, got {self.planner.rel_gap!r}")
        self.technique_space  # noqa: B018 (validates the technique keys)
        bad = [x for x in self.schedules if x not in PIPELINE_SCHEDULES]
        if bad or "1f1b" not in self.schedules:
            raise UserError(f"planner.schedules must list 1f1b (the layer split is solved for it) and only "
                            f"{', '.join(PIPELINE_SCHEDULES)}, got {list(self.schedules)}")


@dataclass(frozen=True)
class SearchResult:
    """The chosen plan and baseline, every candidate row, and search statistics.

    stats: layouts, feasible, milps (layouts that reached the MILP step: solved, single split or cut
    by the cutoff proof), milp_s (sum of their solve walls), milp_statuses (milps by status; "cutoff"
    for the cut), top_k_proven, milp_pruned (kept layouts pruned with reason milp_bound: skipped by
    `milp.objective_bound_s`, or cut), simulated, screen_s, milp_wall_s, schedules_s (choosing the LLM
    schedules, `_choose_schedules`; about 0 with 1F1B alone), simulate_s, baseline_s, wall_s.
    """

    chosen: Evaluation
    stage_model: StageModel
    milp: SplitResult
    baseline: BaselineResult
    candidates: pd.DataFrame
    stats: dict
    sizes: TransferSizes
    padded_baseline: BaselineResult | None = None   # the HF/LLaVA padded trainer (`baseline` packs)




@dataclass
class _Solved:
    layout: Layout
    bound_s: float
    stage_model: StageModel
    result: SplitResult
    evaluation: Evaluation | None = None
    status: str = "solved"
    reason: str = ""
    detail: str = ""
    variant: Plan | None = None  # its split under another LLM schedule, when `_choose_schedules` chose one

    @property
    def base_plan(self) -> Plan:
        """The MILP's plan, under 1F1B."""
        return self.stage_model.plan(self.result.split, self.result.modes)

    @property
    def plan(self) -> Plan:
        return self.base_plan if self.variant is None else self.variant


def bin_granularity(cost: CostModel, pool: Pool, space: SearchSpace) -> Granularity:
    """`Granularity` of the data's per-sample LLM layer cost (at the smallest admissible TP degree)."""
    terms = cost.llm_stage_terms(pool.seq_len, n_layers=1, first=False, last=False, tp=min(space.llm_tp))
    return Granularity.of(terms.fwd_s + terms.bwd_s, space.global_batch, space.microbatches)


def prepare_means(cost: CostModel, shape: ModelShape, pool: Pool, space: SearchSpace,
                  techniques: TechniqueSpace = TechniqueSpace.of("none", False, False)) -> TechniqueMeans:
    """Module means per admissible TP degree and technique setting (`TechniqueMeans`)."""
    vision_tps = sorted(set(space.vision_tp) | set(space.shared_tp))
    return TechniqueMeans.of(cost, pool, shape, vision_tps, space.llm_tp, techniques)


def search(cost: CostModel, shape: ModelShape, pool: Pool, cluster: Cluster,
           settings: SearchSettings | None = None) -> SearchResult:
    """Run the whole search (module docstring) with `settings` (None: the config's defaults);
    raises UserError when nothing can run."""
    t0 = time.perf_counter()
    s = settings if settings is not None else SearchSettings.from_config()
    space, rejected = build_space(shape, cost, cluster, placements=s.planner.placements,
                                  microbatches=s.planner.microbatches,
                                  global_batch=s.global_batch, mean_tiles=float(pool.n_tiles.mean()))
    means = prepare_means(cost, shape, pool, space, s.technique_space)
    vision, llm = means.for_times()
    sizes = TransferSizes.for_model(llm_hidden=shape.llm_hidden, vision_hidden=shape.vision_hidden,
                                    vision_tokens_per_tile=shape.vision_tokens_per_tile, dtype=cost.provenance.dtype)
    transfer = TransferMeans.of(pool, sizes)
    granularity = bin_granularity(cost, pool, space)
    keep = s.keep or max(2048, 8 * s.n_prescreen)
    screened = screen(space, vision, llm, cluster, transfer, keep=keep, granularity=granularity, floor=means.floor())
    t_screen = time.perf_counter()
    if screened.n_feasible == 0:
        raise UserError(closest_fit_message(space, screened, means, cluster, transfer))

    solved, proven, unsolved = _solve_layouts(screened, space, means, cluster, transfer, s, granularity)
    t_milp = time.perf_counter()
    if not any(x.result.has_solution for x in solved):
        statuses = sorted({x.result.status for x in solved})
        raise UserError(f"no layer split found by the MILP for any feasible layout (statuses: {statuses})")

    batches = sample_batches(len(pool), s.planner.sample_batches, s.global_batch, s.seed, draw_p=pool.draw_p)

    def evaluate(plan: Plan, subset: slice, scheduler: SchedulerSettings) -> Evaluation:
        return evaluate_plan(plan, cost, pool, batches[subset], cluster, sizes, scheduler,
                             seed=s.seed + (subset.start or 0))

    ranked = sorted((x for x in solved if x.result.has_solution), key=lambda x: x.result.objective_s)
    kw = dict(cluster=cluster, global_batch=space.global_batch, transfer=transfer, granularity=granularity)
    quick = _choose_schedules(ranked[:s.n_prescreen], s, cost, pool.take(batches[0]), cluster, sizes,
                              lambda lay, sm: means.stage_model(lay, (*sm.shard, sm.sequence_parallel), **kw),
                              lambda lay, split: means.fit(lay, split, **kw))
    t_sched = time.perf_counter()
    ranked = _prescreen(ranked, s, lambda plan: quick.get(plan) or quick_step_s(plan, cost, pool.take(batches[0]),
                                                                                 cluster, sizes))
    chosen = _simulate_finalists(ranked, s, lambda plan, sub: evaluate(plan, sub, s.scheduler))
    t_sim = time.perf_counter()
    def baseline_for(policy: str, also=()) -> BaselineResult:
        return search_baseline(space, means, cluster, transfer, granularity,
                               lambda plan: evaluate(plan, slice(0, None), s.scheduler.with_policy(policy)),
                               simulate=s.baseline_simulate, policy=policy, also=also, schedules=s.schedules)

    # the padded trainer first: the packed one also simulates its layout (packing it can only help)
    padded = baseline_for(Policy.PADDED)
    baseline = baseline_for(Policy.MEGATRON, also=(padded.evaluation.plan.layout,) if padded.evaluation else ())
    t_base = time.perf_counter()

    rows = list(rejected) + [_layout_row(x) for x in solved] + unsolved + baseline.rows + padded.rows
    listed = _counts(_group_key(x.layout) for x in solved)
    for r in unsolved:
        key = (r["placement"] == "colocated", r["tp_v"], r["pp_v"], r["tp_l"], r["pp_l"], r["m"])
        listed[key] = listed.get(key, 0) + 1
    candidates = candidates_frame(rows, _unlisted(screened.groups, listed))
    cut = [r for r in unsolved if r.get("milp_status") == "cutoff"]  # reached HiGHS, pruned by its proof
    milp_s = [x.result.solve_s for x in solved] + [r["milp_solve_s"] for r in cut]
    stats = {
        "layouts": screened.n_layouts, "feasible": screened.n_feasible, "milps": len(solved) + len(cut),
        "milp_s": float(np.sum(milp_s)),
        "milp_statuses": _counts([x.result.status for x in solved] + [r["milp_status"] for r in cut]),
        "top_k_proven": proven, "milp_pruned": sum(r["reason"] == "milp_bound" for r in unsolved),
        "simulated": sum(x.evaluation is not None for x in solved),
        "screen_s": t_screen - t0, "milp_wall_s": t_milp - t_screen, "schedules_s": t_sched - t_milp,
        "simulate_s": t_sim - t_sched,
        "baseline_s": t_base - t_sim, "wall_s": time.perf_counter() - t0,
    }
    return SearchResult(chosen.evaluation, chosen.stage_model, chosen.result, baseline, candidates, stats, sizes,
                        padded_baseline=padded)


def _solve_layouts(screened: ScreenResult, space: SearchSpace, means: TechniqueMeans, cluster, transfer,
                   s: SearchSettings, granularity: Granularity) -> tuple[list[_Solved], bool, list[dict]]:
    """MILPs in bound order until the n_prescreen best by objective are certain (or max_milps).

    The kept layouts are re-ranked by the tighter `objective_bound_s` (a lower bound of the MILP
    optimum of the leanest setting, whose times equal every setting's and whose tail is the least);
    a layout whose modules have one stage each has a single split, computed directly (milp status
    "single_split"). Each layout is solved with its leanest technique setting and then settled
    (`technique_choice.settle`). Returns the solved, whether their best n_prescreen are proven, and
    one candidate row per kept layout left unsolved (`_unsolved_row`).
    """
    kw = dict(cluster=cluster, global_batch=space.global_batch, transfer=transfer, granularity=granularity)
    max_milps = s.max_milps or max(64, 4 * s.n_prescreen)
    want = s.n_prescreen
    rows = list(screened.layouts.itertuples(index=False))
    # Lazy re-ranking: pop the smallest bound; a screen bound is replaced by the tighter
    # split_bound_s (never smaller) and pushed back, so a popped refined bound is the next best.
    heap = [(float(r.bound_s), i, None) for i, r in enumerate(rows)]
    heapq.heapify(heap)

    def next_layout():
        while heap:
            bound, i, sm = heapq.heappop(heap)
            if sm is not None:
                return bound, sm
            lay = layout_of(rows[i])
            sm = means.stage_model(lay, means.leanest(lay), **kw)
            heapq.heappush(heap, (max(objective_bound_s(sm), bound), i, sm))
        return None

    truncated = screened.n_feasible > len(screened.layouts)
    unseen_bound = float(screened.layouts["bound_s"].max()) if truncated else np.inf
    solved: list[_Solved] = []
    objectives: list[float] = []
    proven = not truncated
    n_calls = 0
    cut: list[dict] = []  # kept layouts HiGHS proved unable to reach the best want (rows, in solve order)
    stop = None  # (reason, the objective to beat) once the loop ends before the heap is empty
    while (item := next_layout()) is not None:
        bound, sm = item
        lay = sm.layout
        if len(objectives) >= want:
            kth = sorted(objectives)[want - 1]
            if bound >= kth:  # its optimum, so any incumbent of it, is >= kth: it cannot enter the best want
                proven = kth <= unseen_bound
                stop = ("milp_bound", kth)
                heapq.heappush(heap, (bound, -1, sm))
                break
        single = sm.n_stages == (1 if lay.colocated else 2)
        if not single and n_calls >= max_milps:
            proven = False
            kth = sorted(objectives)[want - 1] if len(objectives) >= want else np.inf
            stop = ("max_milps", kth)
            heapq.heappush(heap, (bound, -1, sm))
            break
        if single:
            split = np.array([sm.llm_layers] if lay.colocated else [sm.vision_layers, sm.llm_layers])
            res = SplitResult("single_split", split, None, None, 0.0)
        else:
            cutoff = sorted(objectives)[want - 1] if s.milp_cutoff and len(objectives) >= want else None
            res = solve_split(sm, time_limit_s=s.planner.time_limit_s, rel_gap=s.planner.rel_gap, cutoff_s=cutoff)
            n_calls += 1
            if res.status == "cutoff":  # its optimum, so its settled objective, is above the want-th best
                cut.append(_unsolved_row(lay, cutoff, "milp_bound", cutoff, want, max_milps, solve_s=res.solve_s,
                                         screened_s=bound))
                continue
        settled = means.fit(lay, res.split, leanest_model=sm, **kw) if res.has_solution else None
        if settled is not None:
            sm, modes = settled
            objective = sm.objective_s(res.split, modes)
            res = replace(res, modes=tuple(modes), objective_s=objective,
                          bound_s=objective if single else res.bound_s)
        elif res.has_solution:  # a single split that fits in no mode
            res = SplitResult("infeasible", None, None, None, res.solve_s)
        item = _Solved(lay, bound, sm, res)
        if res.has_solution:
            objectives.append(res.objective_s)
        else:
            item.status, item.reason = "rejected", f"milp_{res.status}"
        solved.append(item)
    unsolved = cut + ([] if stop is None else
                      [_unsolved_row(sm.layout if sm is not None else layout_of(rows[i]), bound, *stop, want, max_milps)
                       for bound, i, sm in sorted(heap, key=lambda e: e[:2])])
    return solved, proven, unsolved


def _unsolved_row(lay: Layout, bound: float, why: str, kth: float, want: int, max_milps: int,
                  solve_s: float | None = None, screened_s: float | None = None) -> dict:
    """Candidate row of a kept layout the loop did not solve: pruned by its bound (it cannot reach
    the best `want`: ``bound >= kth``, the want-th best objective) or by the budget. With `solve_s`
    the bound is HiGHS's proof that no split reaches ``kth`` (`solve_split`'s cutoff), after the
    lower bound `screened_s` had not ruled it out."""
    if solve_s is not None:
        detail = (f"MILP optimum >= {kth:.6g} s, the {want}th best MILP objective so far (HiGHS: no layer split "
                  f"at or below it; lower bound {screened_s:.6g} s)")
    elif why == "milp_bound" or bound >= kth:
        why, detail = "milp_bound", (f"mean-shape step lower bound {bound:.6g} s >= {kth:.6g} s, the {want}th best "
                                     f"MILP objective so far")
    else:
        detail = f"not solved: the {max_milps} MILP calls (planner.max_milps) were spent; lower bound {bound:.6g} s"
    row = {"kind": "plan", "level": "layout", "status": "pruned", "reason": why, "detail": detail,
           "bound_s": bound, "n_layouts": 1, "placement": lay.placement, "tp_v": lay.tp_v, "pp_v": lay.pp_v,
           "dp_v": lay.dp_v, "tp_l": lay.tp_l, "pp_l": lay.pp_l, "dp_l": lay.dp_l, "m": lay.m,
           "world_size": lay.world_size}
    if solve_s is not None:
        row.update(milp_status="cutoff", milp_solve_s=solve_s)
    return row


def _unlisted(groups: pd.DataFrame, listed: dict) -> pd.DataFrame:
    """The screen's group rows less the layouts listed on rows of their own (`listed`: group key ->
    count): the counts shrink, and a group with nothing left goes."""
    if not len(groups) or not listed:
        return groups
    # hundreds of thousands of groups against a few thousand listed keys: a join, not a lookup per group
    keys = ["colocated", "tp_v", "pp_v", "tp_l", "pp_l", "m"]
    counts = pd.DataFrame([(bool(k[0]), *map(int, k[1:]), n) for k, n in listed.items()], columns=keys + ["taken"])
    left = pd.DataFrame({k: groups[k].to_numpy(dtype=bool if k == "colocated" else np.int64) for k in keys})
    taken = left.merge(counts, on=keys, how="left")["taken"].fillna(0).to_numpy(dtype=np.int64)
    out = groups.assign(n_layouts=groups["n_layouts"] - taken, n_fit=np.maximum(groups["n_fit"] - taken, 0))
    return out[out["n_layouts"] > 0]


def schedule_options(plan: Plan, schedules: tuple[str, ...]) -> list[tuple[str, int]]:
    """(schedule, chunks) a 1F1B plan could also run under, of those `schedules` allows: ZB-H1 and
    interleaved need LLM pipeline ranks (pp_l >= 2); interleaved needs m a multiple of pp_l and at
    least one layer per chunk on every rank."""
    lay = plan.layout
    out = []
    if lay.pp_l < 2:
        return out
    if "zb-h1" in schedules:
        out.append(("zb-h1", 1))
    if "interleaved" in schedules and lay.m % lay.pp_l == 0:
        fewest = min(plan.llm_rank_layers)
        out += [("interleaved", v) for v in INTERLEAVE_CHUNKS if v <= fewest]
    return out


def _choose_schedules(head: list[_Solved], s: SearchSettings, cost: CostModel, batch: Pool, cluster: Cluster,
                      sizes: TransferSizes, stage_model, refit) -> dict:
    """Give each of `head` the schedule (of `planner.schedules`) whose step on `batch`, split by
    LPT (as `quick_step_s`), is the least among those its memory allows, as `x.variant`.

    A schedule's memory is the layout's stage model under it (`stage_model(layout, sm)`: its
    in-flight counts are the schedule's) with the split's techniques; where that does not fit, the
    techniques are settled again for the schedule (`refit(layout, split)`, as the MILP's split was:
    more recomputation, sharding or SP where needed), so a schedule may cost recomputation. Returns
    {plan: that quick step} for the prescreen to reuse."""
    steps: dict = {}
    if s.schedules == ("1f1b",):
        return steps
    for x in head:
        base = x.plan
        options = schedule_options(base, s.schedules)
        if not options:
            continue
        pricing = Pricing(base, cost, cluster, sizes)
        pc = pricing.batch(batch)
        part = run_partition(pc, pricing, s.scheduler.with_policy(Policy.LPT1D))
        best, best_s = None, part.step_s
        split = x.result.split
        for sched, v in options:
            lay = base.layout.with_schedule(sched, v)
            if stage_model(lay, x.stage_model).fits(split, x.result.modes):
                plan = base.with_schedule(sched, v)
            else:
                settled = refit(lay, split)
                if settled is None:
                    continue
                sm, modes = settled  # its techniques on the 1F1B layout, then the schedule's chunks
                plan = replace(sm, layout=base.layout).plan(split, modes).with_schedule(sched, v)
            if not schedule_priced(plan):
                continue  # ZB-H1's W under full recomputation: a cost the model does not price
            vpricing = Pricing(plan, cost, cluster, sizes)
            # one chunk per rank and the same techniques: the same times and tails as the 1F1B
            # plan's (only the memory limits, which the timing does not read, differ); interleaved
            # plans carry their chunks' own times (`BatchCosts.llm_chunks`)
            same = v == 1 and _rank_techniques(plan) == _rank_techniques(base)
            step = schedule_step_s(vpricing, pc if same else vpricing.batch(batch), part, batch)
            if step < best_s:
                best, best_s = plan, step
        x.variant = best
        steps[x.plan] = best_s
    return steps


def _rank_techniques(plan: Plan) -> tuple:
    tech = plan.llm_techniques
    return plan.vision_techniques, plan.llm_rank_recompute(), tech.shard_optimizer, tech.sequence_parallel


def _keep_schedule_or_1f1b(x: _Solved, ev: Evaluation, plain: Evaluation) -> Evaluation:
    """`x`'s first simulated batches under its chosen schedule (`ev`) and under 1F1B (`plain`):
    the chosen was screened on an LPT partition, the online scheduler's partitions are tuned by
    1F1B simulations, so 1F1B can win here; the better stays (ties: 1F1B)."""
    if plain.ok and (not ev.ok or plain.mean_s <= ev.mean_s):
        x.detail = (f"{x.plan.layout.describe_schedule()[2:]} simulated {ev.mean_s:.4g} s, 1F1B "
                    f"{plain.mean_s:.4g} s on the first batches: kept 1F1B")
        x.variant = None
        return plain
    return ev


def _prescreen(ranked: list[_Solved], s: SearchSettings, quick) -> list[_Solved]:
    """The best `n_prescreen` by MILP objective, re-ranked by `quick(plan)` (seconds); the rest after."""
    head, tail = ranked[:s.n_prescreen], ranked[s.n_prescreen:]
    if len(head) <= s.planner.top_k:
        return ranked
    steps = {id(x): quick(x.plan) for x in head}
    head = sorted(head, key=lambda x: (steps[id(x)], x.result.objective_s))
    for x in head[s.planner.top_k:]:
        x.status, x.reason = "pruned", "prescreen"
        x.detail = f"LPT-partitioned step on sampled batch 0: {steps[id(x)]:.4g} s"
    return head + tail


def _simulate_finalists(ranked: list[_Solved], s: SearchSettings, evaluate) -> _Solved:
    """Simulate the top_k (racing or not), mark statuses, return the winner."""
    finalists, rest = ranked[:s.planner.top_k], ranked[s.planner.top_k:]
    K = s.planner.sample_batches
    for x in rest:
        if x.status not in ("pruned", "rejected"):
            x.status, x.reason = "solved", ""
    alive = list(finalists)
    done, n = 0, (1 if s.racing and len(finalists) > 1 else K)
    while alive:
        n = min(n, K)
        for x in alive:
            ev = evaluate(x.plan, slice(done, n))
            if x.evaluation is None and x.variant is not None:
                ev = _keep_schedule_or_1f1b(x, ev, evaluate(x.base_plan, slice(done, n)))
            x.evaluation = ev if x.evaluation is None else x.evaluation.extended(ev)
        for x in alive:
            if not x.evaluation.ok:
                x.status, x.reason = "rejected", "memory"
        alive = sorted((x for x in alive if x.evaluation.ok), key=lambda x: (x.evaluation.mean_s, x.layout.world_size))
        done = n
        if n >= K:
            break
        if len(alive) <= 1:
            n = K  # finish the last one on every batch
            continue
        for x in alive[math.ceil(len(alive) / 2):]:
            x.status, x.reason = "pruned", "racing"
        alive = alive[:math.ceil(len(alive) / 2)]
        n *= 2
    if alive and alive[0].variant is not None and done > 1:  # the winner's schedule, on every batch
        x = alive[0]
        plain = evaluate(x.base_plan, slice(0, done))
        if plain.ok and plain.mean_s <= x.evaluation.mean_s:
            x.detail = (f"{x.plan.layout.describe_schedule()[2:]} simulated {x.evaluation.mean_s:.4g} s, "
                        f"1F1B {plain.mean_s:.4g} s: kept 1F1B")
            x.variant, x.evaluation = None, plain
    for x in alive:
        x.status = "simulated"
    if not alive:
        if rest:  # every finalist ran out of memory on a sampled batch: try the next ones
            return _simulate_finalists(rest, s, evaluate)
        first = next(x for x in finalists if x.evaluation is not None and not x.evaluation.ok)
        raise UserError(f"every plan that fits the mean-shape memory check runs out of memory on the sampled "
                        f"batches; first: {first.layout.describe()}: {first.evaluation.failure}")
    winner = alive[0]
    winner.status = "chosen"
    return winner


def _layout_row(x: _Solved) -> dict:
    row = {"kind": "plan", "level": "layout", "status": x.status, "reason": x.reason,
           "detail": x.evaluation.failure if (x.evaluation is not None and not x.evaluation.ok) else x.detail,
           "bound_s": x.bound_s, "milp_status": x.result.status, "milp_solve_s": x.result.solve_s,
           "mean_shape_step_s": x.result.objective_s, "n_layouts": 1}
    if x.result.has_solution:
        row.update(plan_columns(x.plan))
    else:
        lay = x.layout
        row.update({"placement": lay.placement, "tp_v": lay.tp_v, "pp_v": lay.pp_v, "dp_v": lay.dp_v,
                    "tp_l": lay.tp_l, "pp_l": lay.pp_l, "dp_l": lay.dp_l, "m": lay.m, "world_size": lay.world_size})
    if x.evaluation is not None:
        row.update(evaluation_columns(x.evaluation))
    return row


def _group_key(lay: Layout) -> tuple:
    return (bool(lay.colocated), lay.tp_v, lay.pp_v, lay.tp_l, lay.pp_l, lay.m)


def _counts(values) -> dict:
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def closest_fit_message(space: SearchSpace, screened: ScreenResult, means: TechniqueMeans, cluster: Cluster,
                        transfer: TransferMeans, max_groups: int = 2000) -> str:
    """One line naming the layout that misses GPU memory by the least, and by how much.

    Checks the most memory-friendly layouts of each group (largest and smallest LLM dp) exactly
    (`min_peak_split`, every memory technique the space allows on), most GPUs per model replica
    first, at most `max_groups` groups.
    """
    W, B, M = cluster.world_size, space.global_batch, cluster.gpu_memory_bytes
    g = screened.groups
    if g.empty:
        return "no layout to try: the cluster is too small for one model replica"
    order = np.lexsort((-g["m"].to_numpy(), -(g["tp_v"] * g["pp_v"]).to_numpy(), -(g["tp_l"] * g["pp_l"]).to_numpy()))
    best = None
    for r in g.iloc[order[:max_groups]].itertuples(index=False):
        for lay in _representatives(r, W, B, space):
            sm = means.stage_model(lay, means.leanest(lay), cluster=cluster, global_batch=B, transfer=transfer)
            split, mem = min_peak_split(sm)
            s = int(np.argmax(mem))
            if best is None or mem[s] < best[0]:
                best = (float(mem[s]), sm.plan(split), s)
    need, plan, s = best
    lean = _leanest_label(means)
    return (f"no plan fits in {M / 1e9:.3g} GB per GPU{lean}: the closest, {plan.layout.describe()}, needs "
            f"{need / 1e9:.3g} GB on {plan.stage_name(s)} ({(need - M) / 1e9:.3g} GB short); use more GPUs or "
            f"GPU memory, more microbatches, or a smaller global batch")


def _leanest_label(means: TechniqueMeans) -> str:
    """What the closest fit already used, e.g. " even with full recompute, sharded optimizer, SP"."""
    space, floor = means.space, means.floor()
    lean = sorted({m for mm in (*floor.vision.values(), *floor.llm.values()) for m in mm.modes} - {"none"})
    used = [f"{'/'.join(lean)} recompute"] if lean else []
    used += ["sharded optimizer"] if space.can_shard else []
    used += ["sequence parallelism"] if space.can_sp else []
    return f" even with {', '.join(used)}" if used else ""


def _representatives(r, W: int, B: int, space: SearchSpace) -> list[Layout]:
    tp_l, pp_l, m = int(r.tp_l), int(r.pp_l), int(r.m)
    if bool(r.colocated):
        dp = min(W // (tp_l * pp_l), B // m)
        return [Layout("colocated", tp_l, 1, dp, tp_l, pp_l, dp, m)] if dp >= 1 else []
    tp_v, pp_v = int(r.tp_v), int(r.pp_v)
    hi = min((W - tp_v * pp_v) // (tp_l * pp_l), B // m)
    cap = max(1, int(np.floor(B / m * space.mean_tiles)))
    out = []
    for dp_l in sorted({1, hi}):
        dp_v = min((W - tp_l * pp_l * dp_l) // (tp_v * pp_v), cap)
        if dp_l >= 1 and dp_v >= 1:
            out.append(Layout("disjoint", tp_v, pp_v, dp_v, tp_l, pp_l, dp_l, m))
    return out
