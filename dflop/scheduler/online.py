"""The online driver of the scheduler: which samples each step trains on, and how they are split.

Global batches are a pure function of (seed, step): epoch e visits the usable samples of
shapes.parquet in the order of a permutation seeded with (seed, e), cut into consecutive global
batches (a last incomplete batch is dropped). Both scheduler policies therefore see the same
batches, and a resumed run continues with the next batch.

Rank 0 turns each batch into a `StepPlan` with the online scheduler (`SchedulerService`, running
ahead in its background thread): which samples form each bin (microbatch x LLM replica) in execution
order, and how each microbatch's images are shared among the vision replicas. Every other rank gets
the plan (sample indices + the shapes.parquet numbers it needs) from rank 0 (the trainer's
`next_plan`) and never decodes media to learn shapes.

Vision sharing: a microbatch's samples that have tiles are dealt to the vision replicas by
longest-processing-time on their vision cost, so the replicas' shares differ by at most one sample's
cost (a sample's tiles stay together: LLaVA-OV packs an image's crops together). In colocated
placement each replica encodes the images of its own bin.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from dflop.costmodel.types import BatchCosts
from dflop.data.sampling import DatasetMix
from dflop.errors import UserError
from dflop.plan import Plan
from dflop.scheduler.correction import WARMUP_STEPS, AdaptiveCorrection, MeasuredTimes, ShapeBuckets
from dflop.scheduler.evaluate import lower_bound, simulate_times, stage_times
from dflop.scheduler.partition import Partition, greedy_partition, partition
from dflop.scheduler.policy import Policy
from dflop.scheduler.service import SchedulerService
from dflop.shapes import numpy_backed


@dataclass(frozen=True)
class StepPlan:
    """One step's work, the same on every rank. Sample k of the global batch is ``rows[k]`` of the
    training pool (the usable rows of shapes.parquet, in file order).

    bins[p][r]: batch indices of LLM replica r's packed row at execution position p.
    vision_shares[p][v]: batch indices (with tiles) vision replica v encodes at position p.
    microbatch_ids[p]: the scheduler's id of the microbatch run at position p.
    n_tiles, seq_len, feature_rows: per batch sample (shapes.parquet; feature rows per `vision.feature_rows`).
    predicted_step_s, lower_bound_s: the simulated step of this partition and its lower bound
    (seconds), priced with the cost model as profiled (never with the adaptive correction);
    corrected_step_s: the same partition simulated with the correction's learned costs (NaN before
    its first observation, or without one); correction_active: whether the scheduler partitioned
    with the corrected costs (the correction's cost-benefit gate);
    sched_s: its solve time (seconds); member: the portfolio member that won.
    """

    step: int
    rows: tuple[int, ...]
    n_tiles: tuple[int, ...]
    seq_len: tuple[int, ...]
    feature_rows: tuple[int, ...]
    bins: tuple[tuple[tuple[int, ...], ...], ...]
    vision_shares: tuple[tuple[tuple[int, ...], ...], ...]
    microbatch_ids: tuple[int, ...]
    predicted_step_s: float = float("nan")
    lower_bound_s: float = float("nan")
    sched_s: float = 0.0
    member: str = ""
    corrected_step_s: float = float("nan")
    correction_active: bool = False

    @property
    def n_microbatches(self) -> int:
        return len(self.bins)


class GlobalBatches:
    """Seeded global batches over a pool of `n_samples` (module docstring). mix: the datasets'
    sampling ratios (`dflop.data.sampling.DatasetMix`): an epoch is then `n_samples` draws by
    those ratios instead of a permutation; None: every sample once per epoch."""

    def __init__(self, n_samples: int, batch_size: int, seed: int, shuffle: bool = True,
                 mix: DatasetMix | None = None):
        if n_samples < batch_size:
            raise UserError(f"train.global_batch_size is {batch_size} but the data has only {n_samples} usable samples")
        if mix is not None and len(mix.groups) != n_samples:
            raise ValueError(f"the dataset mix covers {len(mix.groups)} samples, the pool has {n_samples}")
        self.n_samples, self.batch_size, self.seed, self.shuffle = n_samples, batch_size, seed, shuffle
        self.mix = mix
        self.per_epoch = n_samples // batch_size
        self._cached: tuple[int | None, np.ndarray | None] = (None, None)

    def rows(self, step: int) -> np.ndarray:
        """[batch_size] pool indices of global batch `step`."""
        epoch, index = divmod(step, self.per_epoch)
        return self._order(epoch)[index * self.batch_size:(index + 1) * self.batch_size].copy()

    def _order(self, epoch: int) -> np.ndarray:
        """The pool's order in `epoch`; the last one is kept. Rank 0 asks for each step's rows
        more than once on the step's critical path, and a fresh draw is slow beside the scheduler's
        busy thread (`benchmarks/bench_next_plan.py`). (Read once, swapped whole: thread-safe.)"""
        cached_epoch, order = self._cached
        if cached_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            if not self.shuffle:
                order = np.arange(self.n_samples)
            elif self.mix is not None:
                order = self.mix.order(rng)
            else:
                order = rng.permutation(self.n_samples)
            self._cached = (epoch, order)
        return order


def share_by_cost(indices: Sequence[int], cost: np.ndarray, n_replicas: int) -> list[tuple[int, ...]]:
    """Deal `indices` (batch indices) to `n_replicas` by LPT on `cost[index]`; each share sorted."""
    shares: list[list[int]] = [[] for _ in range(n_replicas)]
    heap = [(0.0, v) for v in range(n_replicas)]
    for i in sorted(indices, key=lambda i: (-float(cost[i]), i)):
        load, v = heapq.heappop(heap)
        shares[v].append(i)
        heapq.heappush(heap, (load + float(cost[i]), v))
    return [tuple(sorted(s)) for s in shares]


def step_plan_from_partition(step: int, rows: np.ndarray, shapes: pd.DataFrame, part: Partition, plan: Plan,
                             feature_rows: Sequence[int], vision_cost: np.ndarray) -> StepPlan:
    """The StepPlan of one partitioned global batch (`shapes`: its rows, in batch order)."""
    tiles = shapes["n_tiles"].to_numpy()
    bins = tuple(tuple(tuple(int(i) for i in b) for b in mb) for mb in part.bins())
    shares = []
    for mb in bins:
        if plan.colocated:
            shares.append(tuple(tuple(i for i in b if tiles[i] > 0) for b in mb))
        else:
            with_tiles = [i for b in mb for i in b if tiles[i] > 0]
            shares.append(tuple(share_by_cost(with_tiles, vision_cost, plan.vision.dp)))
    return StepPlan(step=step, rows=tuple(int(r) for r in rows), n_tiles=tuple(int(t) for t in tiles),
                    seq_len=tuple(int(s) for s in shapes["seq_len"]), feature_rows=tuple(int(f) for f in feature_rows),
                    bins=bins, vision_shares=tuple(shares), microbatch_ids=tuple(int(j) for j in part.order),
                    predicted_step_s=float(part.step_s), lower_bound_s=float(part.lower_bound_s),
                    sched_s=float(part.solve_s), member=part.member)


class StepPlanner:
    """Rank 0's side of the data path: global batches -> costs -> scheduler service -> StepPlans.

    costs_fn: [n] pool indices of one global batch (in batch order) -> BatchCosts for the plan's
        layout (the trainer's: the one pricing path, `dflop.pricing.pricing`, on a `Pool` built and
        checked once).
    feature_rows_fn: shapes rows -> [n] feature rows per sample.
    policy: a `Policy`: the portfolio, or a data-blind baseline (fixed count per microbatch in batch
        order; the padded one prices its padding in `costs_fn`).
    p2p_s, allreduce_s: the pipeline send latency and the [P] per-stage gradient all-reduce seconds
        the 1F1B simulation charges (the pricing's), so predictions match the planner's.
    ilp: the portfolio's exact member, as `partition` takes it (opt-in: it has not earned its place
        on the benchmark grid, see benchmarks/README.md).
    wgrad_frac_fn: [n] pool indices of one global batch -> the LLM backward's W share
        (`Pricing.wgrad_frac`); needed by ZB-H1 plans, whose predictions time the partition under
        ZB-H1 as the planner does (`dflop.planner.expected.schedule_timeline`). The partition itself
        is still scored as 1F1B, as the planner's is.
    """

    def __init__(self, pool: pd.DataFrame, batches: GlobalBatches, plan: Plan,
                 costs_fn: Callable[[np.ndarray], BatchCosts], feature_rows_fn: Callable[[pd.DataFrame], np.ndarray],
                 *, policy: Policy | str = Policy.DFLOP, budget_s: float = 0.2, prefetch: int = 2, seed: int = 0,
                 total_steps: int | None = None, adaptive: bool = True, p2p_s: float = 0.0, allreduce_s=0.0,
                 ilp: str = "never", wgrad_frac_fn: Callable[[np.ndarray], float] | None = None):
        if plan.layout.schedule == "zb-h1" and wgrad_frac_fn is None:
            raise ValueError("StepPlanner: a zb-h1 plan needs wgrad_frac_fn (the W share its steps are timed with)")
        if policy not in (Policy.DFLOP, Policy.MEGATRON, Policy.PADDED):  # what the trainer runs
            raise UserError(f"StepPlanner: policy must be dflop, megatron or padded, got {policy!r}")
        policy = Policy(policy)
        self.pool, self.batches, self.plan = numpy_backed(pool.reset_index(drop=True)), batches, plan
        self.costs_fn, self.feature_rows_fn = costs_fn, feature_rows_fn
        self.schedule = plan.layout.schedule
        self.wgrad_frac_fn = wgrad_frac_fn
        self.policy, self.prefetch, self.total_steps = policy, prefetch, total_steps
        self.buckets = ShapeBuckets()
        self.correction = AdaptiveCorrection(self.buckets.n_buckets) if adaptive and not policy.data_blind else None
        dp_vision = plan.vision_replicas
        self.budget_s = budget_s
        self.p2p_s, self.allreduce_s = p2p_s, allreduce_s
        # The baseline's split is instant and must not fall back to the DFLOP greedy: no service.
        self.service = None if policy.data_blind else SchedulerService(
            m=plan.microbatches, dp_llm=plan.llm.dp, dp_vision=dp_vision, budget_s=budget_s, seed=seed,
            prefetch=prefetch, policy=policy.bins, p2p_s=p2p_s, allreduce_s=allreduce_s,
            correction=self.correction, solver=functools.partial(partition, ilp=ilp))
        self._submitted = -1
        self._first: int | None = None
        self._costs: dict[int, tuple[BatchCosts, np.ndarray, Partition | None, float]] = {}  # + W share

    def _submit_through(self, step: int) -> None:
        last = step if self.total_steps is None else min(step, self.total_steps - 1)
        while self._submitted < last:
            s = self._submitted + 1
            rows = self.batches.rows(s)
            shapes = self.pool.iloc[rows].reset_index(drop=True)
            costs = self.costs_fn(rows)
            buckets = self.buckets.assign(shapes["n_tiles"].to_numpy(), shapes["seq_len"].to_numpy())
            if self.service is not None:
                self.service.submit(s, costs, buckets)
            self._costs[s] = (costs, buckets, None, self._wgrad_frac(rows))
            self._submitted = s

    def get(self, step: int, timeout_s: float | None = None) -> StepPlan:
        """The plan of `step` (submitting the next `prefetch` batches so the worker keeps ahead).

        timeout_s: how long to wait for the portfolio before taking the greedy fallback; default
        0, except on the run's first step, which has no training to overlap with (budget + 1 s).
        """
        if step <= self._submitted and step not in self._costs:
            raise ValueError(f"step {step} was already taken")
        if self._first is None:
            self._first = step
        if self._submitted < step - 1:
            self._submitted = step - 1  # resumed run: nothing before `step` is needed
        self._submit_through(step + self.prefetch)
        costs, buckets, _, frac = self._costs[step]
        if self.service is None:
            dp_vision = self.plan.vision_replicas
            part = partition(costs, self.plan.microbatches, self.plan.llm.dp, dp_vision,
                             policy=self.policy.bins, p2p_s=self.p2p_s, allreduce_s=self.allreduce_s)
        else:
            # The first step has nothing to overlap with: wait for the solve rather than fall back.
            if timeout_s is None:
                timeout_s = self.budget_s + 1.0 if step == self._first else 0.0
            part = self.service.get(step, timeout_s=timeout_s)
        rows = self.batches.rows(step)
        shapes = self.pool.iloc[rows].reset_index(drop=True)
        self._costs[step] = (costs, buckets, part, frac)
        plan = step_plan_from_partition(step, rows, shapes, part, self.plan, self.feature_rows_fn(shapes),
                                        costs.vision_total())
        return self._with_predictions(plan, part, costs, buckets, frac)

    def _wgrad_frac(self, rows: np.ndarray) -> float:
        """The W share ZB-H1 plans time `rows`' step with; 0.5 (unused) under the other schedules."""
        return float(self.wgrad_frac_fn(rows)) if self.schedule == "zb-h1" else 0.5

    def _simulate(self, costs: BatchCosts, part: Partition, wgrad_frac: float) -> float:
        """The step of `part` priced with `costs` (the partition's own send latency and all-reduces)
        under the plan's schedule: ZB-H1 with `wgrad_frac`, interleaved where `costs` carry chunks."""
        times = stage_times(costs, part.microbatch, part.replica, part.m, part.dp_llm, part.dp_vision)
        return float(simulate_times(times, part.order, p2p_s=self.p2p_s, allreduce_s=self.allreduce_s,
                                    schedule=self.schedule, wgrad_frac=wgrad_frac).step_s)

    def _with_predictions(self, plan: StepPlan, part: Partition, costs: BatchCosts, buckets,
                          wgrad_frac: float) -> StepPlan:
        """`plan` with both predictions of its partition: the profiled costs' (whatever the
        partition was solved with; a ZB-H1 plan's timed under ZB-H1, the partition's own step being
        1F1B's) and the correction's (`StepPlan`)."""
        corr = self.correction
        active = self.service is not None and self.service.solved_corrected.pop(plan.step, False)
        if active:  # solved with corrected costs: price it again as profiled
            plan = replace(plan, predicted_step_s=self._simulate(costs, part, wgrad_frac),
                           lower_bound_s=lower_bound(costs, part.m, part.dp_llm, part.dp_vision, p2p_s=self.p2p_s,
                                                     allreduce_s=self.allreduce_s))
        elif self.schedule == "zb-h1":
            plan = replace(plan, predicted_step_s=self._simulate(costs, part, wgrad_frac))
        corrected = float("nan")
        if corr is not None and corr.n_obs_ > 0 and buckets is not None:
            corrected = self._simulate(corr.corrected(costs, buckets), part, wgrad_frac) + corr.step_overhead_s_
        return replace(plan, corrected_step_s=corrected, correction_active=bool(active))

    def replan(self, plan: StepPlan, rows: np.ndarray) -> StepPlan:
        """`plan`'s step with the global batch `rows` instead (samples replaced after a load failure,
        `dflop.runtime.skipping`): partitioned now by the greedy portfolio (the baseline: fixed
        counts). The adaptive correction does not learn from such a step."""
        shapes = self.pool.iloc[rows].reset_index(drop=True)
        costs = self.costs_fn(rows)
        dp_vision = self.plan.vision_replicas
        if self.service is None:
            part = partition(costs, self.plan.microbatches, self.plan.llm.dp, dp_vision,
                             policy=self.policy.bins, p2p_s=self.p2p_s, allreduce_s=self.allreduce_s)
        else:
            part = greedy_partition(costs, self.plan.microbatches, self.plan.llm.dp, dp_vision, p2p_s=self.p2p_s,
                                    allreduce_s=self.allreduce_s)
        frac = self._wgrad_frac(rows)
        self._costs[plan.step] = (costs, None, None, frac)
        new = step_plan_from_partition(plan.step, rows, shapes, part, self.plan, self.feature_rows_fn(shapes),
                                       costs.vision_total())
        if self.schedule == "zb-h1":
            new = replace(new, predicted_step_s=self._simulate(costs, part, frac))
        return replace(new, member=f"replaced:{part.member}")

    def report(self, step: int, measured: MeasuredTimes, decide_every: int = 2, step_s: float | None = None) -> None:
        """Measured stage times of `step`, for the adaptive correction (dflop policy only; the
        first `WARMUP_STEPS` of a run are not learned from: they pay the warm-up, many times a
        later step).
        step_s: the step's wall seconds, for the correction's per-step overhead (`observe_step`)."""
        costs, buckets, part, frac = self._costs.pop(step, (None, None, None, 0.5))
        for old in [s for s in self._costs if s < step]:
            del self._costs[old]
        if self.correction is None or part is None:
            return
        if step < self._first + WARMUP_STEPS:  # warm-up (allocator, thread pools, first collectives)
            self.service.report(step, None, part)
            return
        self.service.report(step, measured, part)
        if step_s is not None and buckets is not None:
            self.correction.observe_step(step_s, self._simulate(self.correction.corrected(costs, buckets), part, frac))
        if self.correction.n_obs_ and self.correction.n_obs_ % decide_every == 0:
            dp_vision = self.plan.vision_replicas
            self.correction.decide(costs, buckets, self.plan.microbatches, self.plan.llm.dp, dp_vision)

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
