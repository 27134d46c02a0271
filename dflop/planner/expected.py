"""Expected step time of a plan: simulate sampled global batches partitioned by the online scheduler.

For each global batch (B samples drawn from the data) the fitted cost model gives every sample's
cost on every stage of the plan (`CostModel.batch_costs`); the transfers are added to the
receiving stages per sample (vision features into LLM stage 0 and their gradients back, hidden
states between stages, bandwidths from `dflop.planner.cluster`); the online scheduler
(`dflop.scheduler.partition.partition`) splits the batch into m microbatches x dp_l bins under the
per-stage memory limits and simulates the exact 1F1B step with the per-stage gradient
all-reduces. The step time of the plan is the distribution of those simulated steps — variance and
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
from dflop.costmodel.types import BatchCosts
from dflop.errors import UserError
from dflop.plan import Plan
from dflop.planner.cluster import Cluster
from dflop.planner.means import Pool, TransferSizes
from dflop.planner.stages import links
from dflop.scheduler.evaluate import simulate_times, stage_times
from dflop.scheduler.greedy import MemoryGuardError
from dflop.scheduler.partition import Partition, partition
from dflop.sim import SimResult


@dataclass(frozen=True)
class SchedulerSettings:
    """How the online scheduler partitions each sampled batch (see `partition`).

    policy: "dflop" (the portfolio) or "megatron" (data-blind, fixed-count contiguous microbatches);
    budget_s: wall seconds its exact ILP may use per batch; ilp: "auto", "always" or "never".
    The default leaves the ILP out: its wall-clock budget makes results depend on machine load, and
    the same inputs must give the same plan. Online the ILP can only improve on the greedy members,
    so planning without it is conservative.
    """

    policy: str = "dflop"
    budget_s: float = 0.05
    ilp: str = "never"


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


def sample_batches(n_pool: int, k: int, global_batch: int, seed: int) -> list[np.ndarray]:
    """`k` global batches of indices into the pool (without replacement inside a batch when possible)."""
    rng = np.random.default_rng(seed)
    return [np.sort(rng.choice(n_pool, size=global_batch, replace=n_pool < global_batch)) for _ in range(k)]


@dataclass(frozen=True)
class PlanCosts:
    """One global batch on one plan: costs with transfers (what the scheduler sees), the per-stage
    all-reduce seconds [P], and the busy GPU-seconds of its compute."""

    costs: BatchCosts
    allreduce_s: np.ndarray
    busy_gpu_s: float


def plan_costs(plan: Plan, cost: CostModel, batch: Pool, cluster: Cluster, sizes: TransferSizes) -> PlanCosts:
    """Per-sample costs of `batch` on `plan` (module docstring)."""
    lay = plan.layout
    base = cost.batch_costs(batch.n_tiles, batch.seq_len, vision_layers_per_stage=list(plan.vision_layers),
                            llm_layers_per_stage=list(plan.llm_layers), tp_v=lay.tp_v, tp_l=lay.tp_l,
                            mem_limit_bytes=cluster.gpu_memory_bytes, in_flight_per_stage=lay.in_flight(),
                            colocated=lay.colocated)
    link = links(cluster, colocated=lay.colocated, tp_v=lay.tp_v, pp_v=lay.pp_v, dp_v=lay.dp_v, tp_l=lay.tp_l,
                 pp_l=lay.pp_l, dp_l=lay.dp_l)
    llm_fwd, llm_bwd = base.llm_fwd.copy(), base.llm_bwd.copy()
    vis_fwd, vis_bwd = base.vision_fwd.copy(), base.vision_bwd.copy()
    hop = batch.seq_len * sizes.llm_token_bytes / float(link.llm_hop_bps)
    llm_fwd[1:] += hop
    llm_bwd[:-1] += hop
    if not lay.colocated:
        features = batch.vision_tokens * sizes.llm_token_bytes / float(link.vision_to_llm_bps)
        llm_fwd[0] += features
        vis_bwd[-1] += features
        vhop = batch.n_tiles * sizes.vision_tile_bytes / float(link.vision_hop_bps)
        vis_fwd[1:] += vhop
        vis_bwd[:-1] += vhop
    costs = replace(base, llm_fwd=llm_fwd, llm_bwd=llm_bwd, vision_fwd=vis_fwd, vision_bwd=vis_bwd)

    grads = _stage_grad_bytes(plan, cost)
    n_v = lay.n_vision_stages
    allreduce = np.r_[cluster.allreduce_s(grads[:n_v], lay.dp_v, link.vision_allreduce_intra),
                      cluster.allreduce_s(grads[n_v:], lay.dp_l, link.llm_allreduce_intra)]
    n_bins = lay.m * lay.dp_l
    busy = lay.tp_l * float((base.llm_fwd + base.llm_bwd).sum() + n_bins * (base.llm_fwd_const + base.llm_bwd_const).sum())
    busy += lay.tp_v * float((base.vision_fwd + base.vision_bwd).sum()
                             + lay.m * lay.dp_v * (base.vision_fwd_const + base.vision_bwd_const).sum())
    return PlanCosts(costs, allreduce, busy)


def _stage_grad_bytes(plan: Plan, cost: CostModel) -> np.ndarray:
    """[P] gradient bytes per rank of every stage (what its data-parallel all-reduce moves)."""
    lay = plan.layout
    vision = [cost.vision_stage_terms([0], n_layers=n, first=k == 0, last=k == lay.pp_v - 1, tp=lay.tp_v).static
              for k, n in enumerate(plan.vision_layers)]
    llm = [cost.llm_stage_terms([1], n_layers=n, first=j == 0, last=j == lay.pp_l - 1, tp=lay.tp_l).static
           for j, n in enumerate(plan.llm_layers)]
    if lay.colocated:
        llm[0] = llm[0] + vision[0]
        vision = []
    return np.array([s.grad_bytes for s in vision + llm], dtype=np.float64)


def peak_memory(pc: PlanCosts, part: Partition, plan: Plan, memory_bytes: float) -> np.ndarray:
    """[P] peak bytes per rank of each stage under this partition.

    The cost model's limit is ``(memory - state) / in_flight - act_const`` (`batch_costs`), so a
    stage holding ``in_flight`` microbatches of at most ``x`` activation bytes peaks at
    ``memory + in_flight * (x - limit)``.
    """
    c, lay = pc.costs, plan.layout
    in_flight = np.asarray(lay.in_flight(), dtype=np.float64)
    bins = part.microbatch * lay.dp_l + part.replica
    vision = [np.bincount(part.microbatch, weights=c.vision_act_bytes[k], minlength=lay.m).max() / lay.dp_v
              - c.vision_mem_limit_bytes[k] for k in range(c.pp_vision)]
    llm = [np.bincount(bins, weights=c.llm_act_bytes[k], minlength=lay.m * lay.dp_l).max() - c.llm_mem_limit_bytes[k]
           for k in range(c.pp_llm)]
    return memory_bytes + in_flight * np.array(vision + llm)


def evaluate_plan(plan: Plan, cost: CostModel, pool: Pool, batches: list[np.ndarray], cluster: Cluster,
                  sizes: TransferSizes, scheduler: SchedulerSettings = SchedulerSettings(), *,
                  seed: int = 0) -> Evaluation:
    """Simulate `plan` on every batch; stop at the first batch that cannot run (memory)."""
    t0 = time.perf_counter()
    lay = plan.layout
    steps, util, peak = [], [], np.zeros(lay.n_stages)
    for b, index in enumerate(batches):
        batch = pool.take(index)
        try:
            pc = plan_costs(plan, cost, batch, cluster, sizes)
            part = run_partition(pc, plan, scheduler, cluster, seed=seed + b)
        except MemoryGuardError as exc:
            return _failed(plan, scheduler, f"memory: sampled batch {b}: {_name_sample(str(exc), batch)}", t0)
        mem = peak_memory(pc, part, plan, cluster.gpu_memory_bytes)
        if not part.memory_ok or (mem > cluster.gpu_memory_bytes * (1 + 1e-9)).any():
            s = int(np.argmax(mem - cluster.gpu_memory_bytes))
            return _failed(plan, scheduler, f"memory: sampled batch {b} needs {mem[s] / 1e9:.3g} GB on "
                           f"{plan.stage_name(s)} under the {scheduler.policy} partition", t0)
        steps.append(part.step_s)
        util.append(pc.busy_gpu_s / (cluster.world_size * part.step_s))
        peak = np.maximum(peak, mem)
    return Evaluation(plan, scheduler.policy, np.array(steps), peak, np.array(util), None, time.perf_counter() - t0)


def run_partition(pc: PlanCosts, plan: Plan, scheduler: SchedulerSettings, cluster: Cluster, *,
                  seed: int = 0) -> Partition:
    lay = plan.layout
    return partition(pc.costs, lay.m, lay.dp_l, lay.vision_replicas, budget_s=scheduler.budget_s,
                     seed=seed, policy=scheduler.policy, p2p_s=cluster.p2p_latency_s, allreduce_s=pc.allreduce_s,
                     ilp=scheduler.ilp)


def quick_step_s(plan: Plan, cost: CostModel, batch: Pool, cluster: Cluster, sizes: TransferSizes) -> float:
    """Simulated step of `batch` split by 1-D LPT (the scheduler's "lpt1d" policy), memory unchecked.

    The online portfolio has an LPT member and orders its result by simulation, so on the same
    batch its step is at most this: a cheap upper bound for ranking many plans before the full
    scheduler runs on the best of them.
    """
    pc = plan_costs(plan, cost, batch, cluster, sizes)
    return run_partition(pc, plan, SchedulerSettings(policy="lpt1d"), cluster).step_s


def simulate_batch(plan: Plan, cost: CostModel, batch: Pool, cluster: Cluster, sizes: TransferSizes,
                   scheduler: SchedulerSettings = SchedulerSettings(), *, seed: int = 0) -> tuple[Partition, SimResult]:
    """The partition of one batch and its exact 1F1B timeline (for the Gantt chart)."""
    pc = plan_costs(plan, cost, batch, cluster, sizes)
    part = run_partition(pc, plan, scheduler, cluster, seed=seed)
    lay = plan.layout
    times = stage_times(pc.costs, part.microbatch, part.replica, lay.m, lay.dp_l, lay.vision_replicas)
    return part, simulate_times(times, part.order, p2p_s=cluster.p2p_latency_s, allreduce_s=pc.allreduce_s)


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


def check_batch_fits(global_batch: int, plan: Plan) -> None:
    lay = plan.layout
    if global_batch < lay.m * lay.dp_l:
        raise UserError(f"global batch {global_batch} cannot fill m x dp_l = {lay.m} x {lay.dp_l} bins")
