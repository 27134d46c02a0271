"""Expected step time of a plan: simulate sampled global batches partitioned by the online scheduler.

Each global batch (B samples drawn from the data) is priced on the plan by the one pricing path
(`dflop.pricing.pricing`: the cost model's per-sample stage costs plus transfers); the online scheduler
(`dflop.scheduler.partition.partition`) splits the batch into m microbatches x dp_l bins under the
per-stage memory limits and simulates the exact 1F1B step with the per-stage gradient
all-reduces. Policy "padded" is the HF/LLaVA trainer: Megatron's fixed-count bins, but every
sample of an LLM bin padded to the bin's longest sequence (`dflop.scheduler.padded`), priced by the same path. The step time of the plan is the distribution of those simulated steps — variance and
DP stragglers included — not the mean-shape formula.

Utilisation of a step: busy GPU-seconds (the cost model's compute of every op, times the TP ranks
running it; transfers, bubbles, stragglers, all-reduce tails and unused GPUs are idle) divided by
(GPUs in the cluster x step seconds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from dflop.costmodel.model import CostModel
from dflop.plan import Plan
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool, TransferSizes
from dflop.pricing.pricing import PlanCosts, Pricing
from dflop.scheduler.evaluate import simulate_times, stage_times
from dflop.scheduler.greedy import MemoryGuardError
from dflop.scheduler.padded import price
from dflop.scheduler.partition import Partition, partition
from dflop.scheduler.policy import Policy
from dflop.scheduler.settings import SchedulerSettings
from dflop.sim import SimResult


@dataclass(frozen=True)
class Evaluation:
    """A plan simulated over sampled global batches.

    step_s: [K] simulated step seconds per batch (NaN after a failure); memory_bytes: [P] peak bytes
    per rank of each stage (vision stages first) over the batches; utilisation: [K];
    failure: None, or why the plan cannot run ("memory: ..."); wall_s: seconds the evaluation took.
    """

    plan: Plan
    policy: str
    step_s: np.ndarray
    memory_bytes: np.ndarray
    utilisation: np.ndarray
    failure: str | None
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def mean_s(self) -> float:
        return float(np.mean(self.step_s)) if self.ok else float("inf")

    @property
    def p10_s(self) -> float:
        return float(np.percentile(self.step_s, 10)) if self.ok else float("inf")

    @property
    def p50_s(self) -> float:
        return float(np.percentile(self.step_s, 50)) if self.ok else float("inf")

    @property
    def p90_s(self) -> float:
        return float(np.percentile(self.step_s, 90)) if self.ok else float("inf")

    @property
    def mean_utilisation(self) -> float:
        return float(np.mean(self.utilisation)) if self.ok else 0.0

    def extended(self, other: "Evaluation") -> "Evaluation":
        """This evaluation with `other`'s batches appended (same plan and policy)."""
        if not other.ok or not self.ok:
            return other if not other.ok else self
        return replace(self, step_s=np.r_[self.step_s, other.step_s],
                       memory_bytes=np.maximum(self.memory_bytes, other.memory_bytes),
                       utilisation=np.r_[self.utilisation, other.utilisation], wall_s=self.wall_s + other.wall_s)


def sample_batches(n_pool: int, k: int, global_batch: int, seed: int,
                   draw_p: np.ndarray | None = None) -> list[np.ndarray]:
    """`k` global batches of indices into the pool (without replacement inside a batch when possible),
    each in random order, as the trainer's shuffled batches come (`dflop.scheduler.online.GlobalBatches`).

    The order matters to the data-blind baselines, which cut microbatches from the batch in order:
    the pool lists its datasets one after the other, so a batch sorted by pool index would put one
    dataset's samples (say, the videos) in the same microbatches and price the baseline as more
    unbalanced than a shuffling trainer ever runs it.

    draw_p: [n_pool] probability of each sample (the datasets' mix, `Pool.draw_p`), so the plan is
    made for the mix that is trained; None: uniform. A mix draws with replacement, as its epochs
    repeat an upweighted dataset's samples."""
    rng = np.random.default_rng(seed)
    if draw_p is not None:
        return [rng.choice(n_pool, size=global_batch, replace=True, p=draw_p) for _ in range(k)]
    return [rng.choice(n_pool, size=global_batch, replace=n_pool < global_batch) for _ in range(k)]


def peak_memory(pc: PlanCosts, part: Partition, plan: Plan, memory_bytes: float) -> np.ndarray:
    """[P] peak bytes per rank of each stage under this partition.

    The cost model's limit is ``(memory - state - transient const) / in_flight - act_const``
    (`batch_costs`), so a stage whose heaviest bin sums to ``x`` (`BatchCosts.llm_mem_bytes`:
    activations and the transient's share) peaks at ``memory + in_flight * (x - limit)`` = state +
    in_flight x its activations + its transient (the bound of `StageTerms`).
    """
    c, lay = pc.costs, plan.layout
    in_flight = np.asarray(lay.in_flight(), dtype=np.float64)
    bins = part.microbatch * lay.dp_l + part.replica
    vision = [np.bincount(part.microbatch, weights=c.vision_mem_bytes[k], minlength=lay.m).max() / lay.dp_v
              - c.vision_mem_limit_bytes[k] for k in range(c.pp_vision)]
    llm = [np.bincount(bins, weights=c.llm_mem_bytes[k], minlength=lay.m * lay.dp_l).max() - c.llm_mem_limit_bytes[k]
           for k in range(c.pp_llm)]
    return memory_bytes + in_flight * np.array(vision + llm)


def evaluate_plan(plan: Plan, cost: CostModel, pool: Pool, batches: list[np.ndarray], cluster: Cluster,
                  sizes: TransferSizes, scheduler: SchedulerSettings = SchedulerSettings.planning(), *,
                  seed: int = 0) -> Evaluation:
    """Simulate `plan` on every batch; stop at the first batch that cannot run (memory)."""
    t0 = time.perf_counter()
    lay = plan.layout
    pricing = Pricing(plan, cost, cluster, sizes)
    steps, util, peak = [], [], np.zeros(lay.n_stages)
    for b, index in enumerate(batches):
        batch = pool.take(index)
        try:
            pc = price(pricing, batch, scheduler.policy)
            part = run_partition(pc, pricing, scheduler, seed=seed + b)
        except MemoryGuardError as exc:
            return _failed(plan, scheduler, f"memory: sampled batch {b}: {_name_sample(str(exc), batch)}", t0)
        mem = peak_memory(pc, part, plan, cluster.gpu_memory_bytes)
        if not part.memory_ok or not (mem <= cluster.gpu_memory_bytes * (1 + 1e-9)).all():  # NaN never fits
            s = int(np.argmax(np.where(np.isnan(mem), np.inf, mem) - cluster.gpu_memory_bytes))
            need = "an undefined (NaN) amount of memory" if np.isnan(mem[s]) else f"{mem[s] / 1e9:.3g} GB"
            return _failed(plan, scheduler, f"memory: sampled batch {b} needs {need} on "
                           f"{plan.stage_name(s)} under the {scheduler.policy} partition", t0)
        step = schedule_step_s(pricing, pc, part, batch)
        steps.append(step)
        util.append(pc.busy_gpu_s / (cluster.world_size * step))
        peak = np.maximum(peak, mem)
    return Evaluation(plan, scheduler.policy, np.array(steps), peak, np.array(util), None, time.perf_counter() - t0)


def schedule_timeline(pricing: Pricing, pc: PlanCosts, part: Partition, batch: Pool) -> SimResult:
    """The exact timeline of `part` under the plan's LLM pipeline schedule: interleaved plans on
    their chunks' own times (`BatchCosts.llm_chunks`, which `simulate_times` times interleaved),
    ZB-H1 with the batch's analytic W share (`Pricing.wgrad_frac`), 1F1B as the scheduler's."""
    lay = pricing.plan.layout
    frac = pricing.wgrad_frac(batch) if lay.schedule == "zb-h1" else 0.5
    times = stage_times(pc.costs, part.microbatch, part.replica, lay.m, lay.dp_l, lay.vision_replicas)
    return simulate_times(times, part.order, p2p_s=pricing.p2p_s, allreduce_s=pc.allreduce_s, schedule=lay.schedule,
                          wgrad_frac=frac)


def schedule_step_s(pricing: Pricing, pc: PlanCosts, part: Partition, batch: Pool) -> float:
    """Step seconds of `part` (`pc`: the plan's pricing of `batch`) under the plan's schedule: the
    scheduler's own step for 1F1B plans; otherwise `part` timed under the schedule
    (`schedule_timeline`). `part` may come from the plan's 1F1B twin (the planner's schedule
    screen); where it is the plan's own, an interleaved plan's step is the scheduler's (its
    simulations time the chunks, `BatchCosts.llm_chunks`), ZB-H1's the partition it scored as
    1F1B (possibly not the best for ZB-H1: a conservative step) timed under ZB-H1."""
    if pricing.plan.layout.schedule == "1f1b":
        return part.step_s
    return schedule_timeline(pricing, pc, part, batch).step_s


def schedule_priced(plan: Plan) -> bool:
    """Whether the planner may choose `plan`'s LLM schedule: False for ZB-H1 with an LLM rank under
    full recomputation, whose W recomputes the checkpointed forward (benchmarks/README.md,
    "Interleaved 1F1B and ZB-H1") while `schedule_timeline` prices B + W as the whole backward.
    Such a plan still trains correctly, only slower than predicted."""
    return plan.layout.schedule != "zb-h1" or "full" not in plan.llm_rank_recompute()


def run_partition(pc: PlanCosts, pricing: Pricing, scheduler: SchedulerSettings, *, seed: int = 0) -> Partition:
    """The online scheduler's partition of one priced batch (the step it simulates is the prediction);
    "padded" runs Megatron's bins on the padded costs (`price`)."""
    lay = pricing.plan.layout
    return partition(pc.costs, lay.m, lay.dp_l, lay.vision_replicas, budget_s=scheduler.budget_s,
                     seed=seed, policy=Policy(scheduler.policy).bins, p2p_s=pricing.p2p_s, allreduce_s=pc.allreduce_s,
                     ilp=scheduler.ilp, settings=scheduler.portfolio)


def quick_step_s(plan: Plan, cost: CostModel, batch: Pool, cluster: Cluster, sizes: TransferSizes) -> float:
    """Simulated step of `batch` split by 1-D LPT (the scheduler's "lpt1d" policy), memory unchecked.

    The online portfolio has an LPT member and orders its result by simulation, so on the same
    batch its step is at most this: a cheap upper bound for ranking many plans before the full
    scheduler runs on the best of them.
    """
    pricing = Pricing(plan, cost, cluster, sizes)
    pc = pricing.batch(batch)
    return schedule_step_s(pricing, pc, run_partition(pc, pricing, SchedulerSettings.planning().with_policy(Policy.LPT1D)), batch)


def simulate_batch(plan: Plan, cost: CostModel, batch: Pool, cluster: Cluster, sizes: TransferSizes,
                   scheduler: SchedulerSettings = SchedulerSettings.planning(), *, seed: int = 0) -> tuple[Partition, SimResult]:
    """The partition of one batch and its exact timeline under the plan's schedule (for the Gantt chart)."""
    pricing = Pricing(plan, cost, cluster, sizes)
    pc = price(pricing, batch, scheduler.policy)
    part = run_partition(pc, pricing, scheduler, seed=seed)
    return part, schedule_timeline(pricing, pc, part, batch)


def _name_sample(message: str, batch: Pool) -> str:
    """Replace the scheduler's 'sample index i' by the sample id."""
    import re

    match = re.search(r"sample (?:index )?(\d+)", message)
    if match and int(match.group(1)) < len(batch):
        return message.replace(match.group(0), f"sample {batch.sample_id[int(match.group(1))]!r}")
    return message


def _failed(plan: Plan, scheduler: SchedulerSettings, reason: str, t0: float) -> Evaluation:
    nan = np.array([np.nan])
    return Evaluation(plan, scheduler.policy, nan, np.full(plan.layout.n_stages, np.nan), nan, reason,
                      time.perf_counter() - t0)

