"""Split one global batch into m microbatches x dp_llm bins: the DFLOP portfolio and baselines.

Policy "dflop" runs the portfolio (`dflop.scheduler.portfolio`: a registry of members, each with
where it applies, the fastest by exact 1F1B simulation); "megatron", "llava_group" and "lpt1d" are
the baselines, run in batch order. The portfolio holds each baseline's split as a member (reordered
by simulation among candidate orders that include the order as built), so its result is never
slower (by the simulated 1F1B step) than any of them. Every member respects the memory guard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from dflop.costmodel.types import BatchCosts
from dflop.scheduler import baselines
from dflop.scheduler.evaluate import lower_bound, memory_ok, scalar_costs, stage_times
from dflop.scheduler.greedy import proxy
from dflop.scheduler.ordering import best_orders
from dflop.scheduler.policy import PARTITION_POLICIES
from dflop.scheduler.portfolio import ILP_MODES, Candidate, PortfolioSettings, candidates, context, fastest

POLICIES = PARTITION_POLICIES


@dataclass(frozen=True)
class Partition:
    """Assignment of one global batch's samples to microbatches and LLM replicas.

    Attributes:
        microbatch, replica: [n] microbatch id and LLM data-parallel replica of every sample.
        order: [m] microbatch ids in execution order.
        m, dp_llm, dp_vision: the layout partitioned for.
        step_s: simulated 1F1B step (seconds) of this partition in this order.
        lower_bound_s: max(T*, heaviest sample's critical path) (seconds), see `lower_bound`.
        proxy_s: bottleneck-stage seconds of the busiest bin or microbatch.
        policy: the policy asked for; member: the portfolio member that won ("greedy",
            "profile", "lpt1d", "sim_search", "ilp", ..., or the baseline's name).
        solve_s: wall seconds this partition took.
        ilp_status: "not_run", or the ILP's status ("optimal", "node_limit", "overrun",
            "failed: ...").
        memory_ok: no bin/microbatch exceeds a stage's memory limit (always True for "dflop").
        candidates: (member, step_s) of every member tried.
    """

    microbatch: np.ndarray
    replica: np.ndarray
    order: np.ndarray
    m: int
    dp_llm: int
    dp_vision: int
    step_s: float
    lower_bound_s: float
    proxy_s: float
    policy: str
    member: str
    solve_s: float
    ilp_status: str
    memory_ok: bool
    candidates: tuple[tuple[str, float], ...] = field(default=())

    @property
    def gap(self) -> float:
        """step_s / lower_bound_s (1.0 = at the bound)."""
        return self.step_s / self.lower_bound_s if self.lower_bound_s > 0 else float("nan")

    def bins(self) -> list[list[np.ndarray]]:
        """Sample indices of every bin: ``bins()[k][r]`` is replica r's share of the k-th
        microbatch to run (sorted indices into the global batch)."""
        out = []
        for j in self.order:
            in_mb = self.microbatch == j
            out.append([np.flatnonzero(in_mb & (self.replica == r)) for r in range(self.dp_llm)])
        return out

    def same_assignment(self, other: "Partition") -> bool:
        return (np.array_equal(self.microbatch, other.microbatch) and np.array_equal(self.replica, other.replica)
                and np.array_equal(self.order, other.order))


def _check_args(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int, policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    for name, val in (("m", m), ("dp_llm", dp_llm), ("dp_vision", dp_vision)):
        if int(val) != val or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    if costs.n_samples < m * dp_llm:
        raise ValueError(f"a global batch of {costs.n_samples} samples cannot fill m * dp_llm = "
                         f"{m} * {dp_llm} = {m * dp_llm} bins")



def partition(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int, *, budget_s: float = 0.5,
              seed: int = 0, policy: str = "dflop", p2p_s: float = 0.0, allreduce_s=0.0,
              lengths: np.ndarray | None = None, ilp: str = "never",
              settings: PortfolioSettings = PortfolioSettings()) -> Partition:
    """Partition one global batch: the fastest member of the portfolio (`dflop.scheduler.portfolio`)
    or one baseline.

    Args:
        costs: per-sample stage costs of the n samples of this global batch.
        m: microbatches; dp_llm, dp_vision: data-parallel replicas of the LLM and vision encoder.
        budget_s: wall seconds the ILP may use, counted from the call (only with ``ilp`` on).
        seed: seeds the ILP and the llava_group shuffle; same inputs + seed = same partition.
        policy: "dflop" (portfolio) or a baseline: "megatron", "llava_group", "lpt1d".
        p2p_s, allreduce_s: passed to the simulator (seconds).
        lengths: [n] lengths llava_group sorts by (LLaVA uses text length); default LLM cost.
        ilp: the exact 1F1B-aware ILP (`dflop.scheduler.ilp`) as an opt-in extra member,
            warm-started from the fastest member and kept only if its simulated step is faster:
            "never" (default: on the benchmark grid it won no batch, benchmarks/README.md), "auto"
            (where `PortfolioSettings` gates it: few samples per bin or high skew, small model) or
            "always".
        settings: where each member runs (`PortfolioSettings`).
    """
    t0 = time.perf_counter()
    _check_args(costs, m, dp_llm, dp_vision, policy)
    if ilp not in ILP_MODES:
        raise ValueError(f"ilp must be one of {ILP_MODES}, got {ilp!r}")
    n = costs.n_samples
    bound = lower_bound(costs, m, dp_llm, dp_vision, p2p_s=p2p_s, allreduce_s=allreduce_s)

    def result(cand: Candidate, cands: list[Candidate], ilp_status: str = "not_run") -> Partition:
        mb, rep = cand.bin_of // dp_llm, cand.bin_of % dp_llm
        return Partition(mb, rep, cand.order, m, dp_llm, dp_vision, cand.step_s, bound,
                         proxy(scalar_costs(costs, m, dp_llm, dp_vision), cand.bin_of, m, dp_llm), policy,
                         cand.member, time.perf_counter() - t0, ilp_status,
                         memory_ok(costs, mb, rep, m, dp_llm, dp_vision),
                         tuple((c.member, c.step_s) for c in cands))

    if policy != "dflop":
        if policy == "megatron":
            bin_of = baselines.megatron(n, m, dp_llm)
        elif policy == "lpt1d":
            bin_of = baselines.lpt1d(costs.llm_total(), m, dp_llm)
        else:
            length = np.asarray(lengths, dtype=np.float64) if lengths is not None else costs.llm_total()
            if length.shape != (n,):
                raise ValueError(f"lengths must have one entry per sample ({n}), got shape {length.shape}")
            bin_of = baselines.llava_group(length, costs.vision_total() > 0, m, dp_llm, seed)
        # Baselines run in batch order, as they would without us.
        (order, step), = best_orders([stage_times(costs, bin_of // dp_llm, bin_of % dp_llm, m, dp_llm, dp_vision)],
                                     p2p_s=p2p_s, allreduce_s=allreduce_s, keep_identity=True)
        cand = Candidate(policy, bin_of, order, step)
        return replace(result(cand, [cand]), candidates=())

    ctx, members = context(costs, m, dp_llm, dp_vision, settings, seed=seed, lengths=lengths, p2p_s=p2p_s,
                           allreduce_s=allreduce_s)
    cands, ilp_status = candidates(ctx, members, ilp=ilp, deadline=t0 + budget_s)
    return result(fastest(cands), cands, ilp_status)


def greedy_partition(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int, *, p2p_s: float = 0.0,
                     allreduce_s=0.0) -> Partition:
    """The portfolio's greedy-path members only (no ILP, no fluid-profile LP, no simulated-step
    search): what the online service falls back to (milliseconds; the others take tenths of a
    second or more where they run)."""
    return partition(costs, m, dp_llm, dp_vision, p2p_s=p2p_s, allreduce_s=allreduce_s, ilp="never",
                     settings=PortfolioSettings(greedy_path_only=True))
