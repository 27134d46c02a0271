"""The DFLOP portfolio as a registry: cheap candidate partitions, the fastest by exact 1F1B simulation.

Every member is one `Member` in `REGISTRY`: its name, where it applies (a predicate on the batch's
`Situation`: samples, microbatches, replicas, samples per bin, pipeline bubble, cost skew), and how
it builds ``bin_of`` ([n] bin ``j * dp_llm + r`` of every sample) from the shared `Context`, which
computes what several members start from (the searched greedy, its regroupings) once. `candidates`
builds every member that applies, scores each in its best order (`dflop.scheduler.ordering`: all
members and candidate orders in one batched simulation) and then runs the refiners, which start from
the scored members: the simulated-step search (`sim_search`) and, only when asked for, the ILP
(opt-in: it never won on the benchmark grid, see `PortfolioSettings`).
Every threshold is a field of `PortfolioSettings`, with where its number comes from.

A member stays in the registry only if it earns its place on the benchmark grid
(`benchmarks/bench_portfolio.py` prints the win table; benchmarks/README.md records the one that
justified this set): removing it must slow some grid row down by more than 0.1 %.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np

from dflop.costmodel.types import BatchCosts
from dflop.scheduler import baselines
from dflop.scheduler.evaluate import ScalarCosts, memory_ok, scalar_costs, stage_times
from dflop.scheduler.greedy import MemoryGuard, MemoryGuardError, greedy_2d_many, local_search, lockstep_search
from dflop.scheduler.ilp import solve_ilp
from dflop.scheduler.ordering import best_orders
from dflop.scheduler.profile import profile_partition
from dflop.scheduler.simsearch import sim_search

ILP_MODES = ("never", "auto", "always")


@dataclass(frozen=True)
class PortfolioSettings:
    """Where each member runs and how hard the expensive ones work.

    Each gate's cost is measured by `benchmarks/bench_portfolio.py --open-gates` (every gated
    member also run outside its gate, on the recorded benchmark's batches; benchmarks/README.md,
    "Portfolio registry"): the rows listed there are what a gate gives up.

    lockstep_max_items_per_bin: the lockstep members run with dp_llm > 1 and at most this many
        samples per bin (the value they were introduced with): with more samples per bin the bins
        even out and a microbatch no longer costs its heaviest bin, so opening it gains little.
    profile_items_per_bin: (low, high) samples per bin where the fluid-profile member runs (dp_llm >
        1). A cost decision, not a quality one: it costs an LP and a fit per batch (seconds' tenths,
        growing with the bins; off the greedy path), and opened above 4 it would make some mix rows
        faster (8-64 samples per bin); below 2 it gains nothing.
    ends_min_bubble: the light-ends greedy members run when the 1F1B bubble (p - 1) / (m + p - 1)
        is at least this (m <= 12 at p = 4; the value they were introduced with). Opened (0), they
        would make some mix rows at m = 16 and 64 faster for more CPU on the greedy path: kept at
        0.2 so that the registry changed the recorded table only where a removed member won;
        opening it is the next step.
    sim_max_items_per_bin, sim_max_evals, sim_starts: `sim_search` runs with at most this many
        samples per bin (one: nothing to pack, the order and lockstep decide), from the `sim_starts`
        fastest distinct members, scoring at most `sim_max_evals` candidate x microbatch simulations
        each (deterministic: an evaluation count, not a wall-clock budget).
    ilp_max_vars, ilp_max_items_per_bin, ilp_min_skew, ilp_max_nodes: the ILP is opt-in
        (`partition`'s ``ilp``, default "never": on the benchmark grid it won no batch, even
        warm-started from the fastest member with 20x the budget). With ``ilp="auto"`` it runs
        where n * bins <= ilp_max_vars (HiGHS spends its budget on root cuts beyond that) and bins
        hold at most ilp_max_items_per_bin samples or the vision/LLM skew is at least
        ilp_min_skew; HiGHS stops after ilp_max_nodes branch-and-bound nodes.
    exclude: member names left out (the win table's leave-one-out; tests).
    greedy_path_only: only the members marked ``greedy_path`` (milliseconds): the online service's
        fallback, `greedy_partition`.
    """

    lockstep_max_items_per_bin: float = 4.0
    profile_items_per_bin: tuple[float, float] = (2.0, 4.0)
    ends_min_bubble: float = 0.2
    sim_max_items_per_bin: float = 1.0
    sim_max_evals: int = 150_000
    sim_starts: int = 2
    ilp_max_vars: int = 4096
    ilp_max_items_per_bin: float = 4.0
    ilp_min_skew: float = 0.3
    ilp_max_nodes: int = 200
    exclude: frozenset[str] = field(default_factory=frozenset)
    greedy_path_only: bool = False


@dataclass(frozen=True)
class Situation:
    """What the members' predicates see of one batch and layout.

    n: samples; m: microbatches; dp_llm, dp_vision: replicas; p: pipeline stages (vision + LLM);
    skew: `cost_skew` of the batch, in [0, 1].
    """

    n: int
    m: int
    dp_llm: int
    dp_vision: int
    p: int
    skew: float

    @property
    def n_bins(self) -> int:
        return self.m * self.dp_llm

    @property
    def items_per_bin(self) -> float:
        return self.n / self.n_bins

    @property
    def bubble(self) -> float:
        """Share of an ideal 1F1B step spent filling and draining: (p - 1) / (m + p - 1)."""
        return (self.p - 1) / (self.m + self.p - 1)


def cost_skew(costs: BatchCosts) -> float:
    """How differently the samples' vision and LLM costs are distributed, in [0, 1].

    Total-variation distance between each sample's share of the batch's vision cost and its share
    of the LLM cost: 0 when vision cost is proportional to LLM cost for every sample (1-D problem),
    1 when no sample is heavy in both.
    """
    v, l = costs.vision_total(), costs.llm_total()
    if v.sum() <= 0 or l.sum() <= 0:
        return 0.0
    return float(0.5 * np.abs(v / v.sum() - l / l.sum()).sum())


def balance_replicas(bin_of: np.ndarray, llm_cost: np.ndarray, m: int, dp_llm: int) -> np.ndarray:
    """Keep every microbatch's bins but re-deal them over the replicas so replica totals even
    out: microbatches by decreasing heaviest bin, each one's heaviest bin to the replica with the
    least LLM load so far (LPT). Lockstep-minded members fill microbatches with bins of similar
    load and leave which replica runs which to chance; with one sample per bin an unlucky deal
    gives one replica several percent more work than the rest."""
    n_bins = m * dp_llm
    loads = np.bincount(bin_of, weights=llm_cost, minlength=n_bins).reshape(m, dp_llm)
    new_bin = np.empty(n_bins, dtype=np.int64)
    replica_load = np.zeros(dp_llm)
    for j in np.argsort(-loads.max(axis=1), kind="stable"):
        bins = np.argsort(-loads[j], kind="stable")            # old replicas, heaviest bin first
        replicas = np.argsort(replica_load, kind="stable")     # least loaded first
        new_bin[j * dp_llm + bins] = j * dp_llm + replicas
        replica_load[replicas] += loads[j, bins]
    return new_bin[bin_of]


def regroup_bins(bin_of: np.ndarray, llm_cost: np.ndarray, vision_cost: np.ndarray, m: int, dp_llm: int,
                 window: int = 4) -> np.ndarray:
    """Keep the bins' contents but regroup them into microbatches of dp_llm bins of similar LLM
    load, with vision load evened out among neighbouring microbatches.

    Replicas run a microbatch in lockstep (its vision work is shared), so a microbatch costs about
    its heaviest bin: bins are ranked by LLM load and every `window` * dp_llm consecutive ones are
    dealt to `window` microbatches, largest vision load first to the microbatch with the least
    vision so far (each takes dp_llm bins). Replicas are dealt in snake order to even their totals.
    ``llm_cost`` and ``vision_cost`` are [n] per-sample seconds.
    """
    n_bins = m * dp_llm
    l_bin = np.bincount(bin_of, weights=llm_cost, minlength=n_bins)
    v_bin = np.bincount(bin_of, weights=vision_cost, minlength=n_bins)
    ranked = np.argsort(-l_bin, kind="stable")
    new_bin = np.empty(n_bins, dtype=np.int64)
    j0 = 0
    for start in range(0, n_bins, window * dp_llm):
        chunk = ranked[start:start + window * dp_llm]
        k = len(chunk) // dp_llm
        vis, members = np.zeros(k), [[] for _ in range(k)]
        for b in chunk[np.argsort(-v_bin[chunk], kind="stable")]:
            open_ = [g for g in range(k) if len(members[g]) < dp_llm]
            g = min(open_, key=lambda g: (vis[g], g))
            members[g].append(b)
            vis[g] += v_bin[b]
        for g in range(k):
            group = sorted(members[g], key=lambda b: -l_bin[b])
            j = j0 + g
            reps = range(dp_llm) if j % 2 == 0 else range(dp_llm - 1, -1, -1)
            for b, r in zip(group, reps):
                new_bin[b] = j * dp_llm + r
        j0 += k
    return new_bin[bin_of]


class Context:
    """One batch and layout, with what several members build on computed once, on first use.

    costs: the batch; sc: its bottleneck-stage scalars; guard: the memory limits; lengths: [n] what
    LLaVA's length grouping sorts by; ends: the light-ends weightings of the members that run,
    which share one batched greedy pass with the unweighted greedy.
    """

    def __init__(self, costs: BatchCosts, sit: Situation, settings: PortfolioSettings, *, seed: int,
                 lengths: np.ndarray, p2p_s: float, allreduce_s, guard: MemoryGuard,
                 ends: tuple[tuple[float, float], ...] = ()):
        self.costs, self.sit, self.settings = costs, sit, settings
        self.seed, self.lengths, self.p2p_s, self.allreduce_s = seed, lengths, p2p_s, allreduce_s
        self.guard = guard
        self.sc: ScalarCosts = scalar_costs(costs, sit.m, sit.dp_llm, sit.dp_vision)
        self.ends = ends

    @staticmethod
    def end_weight(m: int, ends: tuple[float, float]) -> np.ndarray:
        weight = np.ones(m)
        weight[0], weight[-1] = ends
        return weight

    @cached_property
    def first_pass(self) -> np.ndarray:
        """[1 + len(ends), n]: the 2-D greedy unweighted, then with each light-ends weighting."""
        weights = [None] + [self.end_weight(self.sit.m, w) for w in self.ends]
        return greedy_2d_many(self.sc, self.sit.m, self.sit.dp_llm, self.guard, weights)

    @cached_property
    def greedy(self) -> np.ndarray:
        """The 2-D greedy followed by the move/swap local search on the bottleneck proxy."""
        return local_search(self.sc, self.first_pass[0], self.sit.m, self.sit.dp_llm, self.guard)

    def greedy_ends(self, ends: tuple[float, float]) -> np.ndarray:
        weight = self.end_weight(self.sit.m, ends)
        return local_search(self.sc, self.first_pass[1 + self.ends.index(ends)], self.sit.m, self.sit.dp_llm,
                            self.guard, mb_weight=weight)

    @cached_property
    def regrouped1(self) -> np.ndarray:
        return regroup_bins(self.greedy, self.sc.llm, self.sc.vision, self.sit.m, self.sit.dp_llm, 1)


@dataclass(frozen=True)
class Member:
    """One portfolio member.

    name: as reported in `Partition.member`; applies: ``(situation, settings) -> bool``, where it
    runs; build: ``context -> bin_of`` ([n]) or None when it has nothing to offer; greedy_path: cheap
    enough (milliseconds) for the online service's fallback; ends: the light-ends weighting
    (first, last microbatch capacity) this member's greedy runs with, if any.
    """

    name: str
    applies: Callable[[Situation, PortfolioSettings], bool]
    build: Callable[[Context], np.ndarray | None]
    greedy_path: bool = True
    ends: tuple[float, float] | None = None


def _always(sit: Situation, s: PortfolioSettings) -> bool:
    return True


def _replicated(sit: Situation, s: PortfolioSettings) -> bool:
    return sit.dp_llm > 1


def _lockstep(sit: Situation, s: PortfolioSettings) -> bool:
    return sit.dp_llm > 1 and sit.items_per_bin <= s.lockstep_max_items_per_bin


def _profile(sit: Situation, s: PortfolioSettings) -> bool:
    low, high = s.profile_items_per_bin
    return sit.dp_llm > 1 and low <= sit.items_per_bin <= high


def _light_ends(sit: Situation, s: PortfolioSettings) -> bool:
    return sit.m >= 2 and sit.bubble >= s.ends_min_bubble


def _ends_member(w_first: float, w_last: float) -> Member:
    return Member(f"greedy_ends{w_first:g}/{w_last:g}", _light_ends, lambda c: c.greedy_ends((w_first, w_last)),
                  ends=(w_first, w_last))


REGISTRY: tuple[Member, ...] = (
    # 2-D vector LPT + move/swap local search on the bottleneck proxy.
    Member("greedy", _always, lambda c: c.greedy),
    # The greedy bins regrouped into microbatches of dp_llm bins of similar LLM load (replicas run
    # a microbatch in lockstep, so it costs its heaviest bin), vision evened out (`regroup_bins`).
    Member("greedy_regrouped1", _replicated, lambda c: c.regrouped1),
    # Swaps on the sum over microbatches of max(vision load, heaviest bin): replicas run a
    # microbatch together, so it costs its heaviest bin. From the greedy bins (where the profile
    # member runs it is overshadowed; it earns its place on the greedy-path fallback), and from the
    # regrouped ones with the replicas re-dealt afterwards (`balance_replicas`; rarely the fastest
    # itself, but with one sample per bin the start from which sim_search finds the fastest).
    Member("lockstep", _lockstep, lambda c: lockstep_search(c.sc, c.greedy, c.sit.m, c.sit.dp_llm)),
    Member("lockstep_regrouped", _lockstep, lambda c: balance_replicas(
        lockstep_search(c.sc, c.regrouped1, c.sit.m, c.sit.dp_llm), c.sc.llm, c.sit.m, c.sit.dp_llm)),
    # Microbatches shaped like the fastest fluid 1F1B schedule (an LP), filled against those
    # targets (`dflop.scheduler.profile`).
    Member("profile", _profile, lambda c: profile_partition(c.costs, c.sc, c.sit.m, c.sit.dp_llm, c.sit.dp_vision,
                                                            c.guard, p2p_s=c.p2p_s, allreduce_s=c.allreduce_s),
           greedy_path=False),
    # 1-D LPT on LLM cost (also the "lpt1d" baseline: the portfolio never loses to it).
    Member("lpt1d", _always, lambda c: baselines.lpt1d(c.costs.llm_total(), c.sit.m, c.sit.dp_llm)),
    # The greedy with the first and last microbatch filled to only this share of the others:
    # 1F1B pays the first forward and the last backward p - 1 times.
    _ends_member(0.9, 0.7),
    _ends_member(0.8, 0.6),
    # LLaVA's modality/length grouping (also the "llava_group" baseline).
    Member("length_grouped", _always, lambda c: baselines.llava_group(
        c.lengths, c.costs.vision_total() > 0, c.sit.m, c.sit.dp_llm, c.seed)),
    # Contiguous slices in batch order (also the "megatron" baseline).
    Member("batch_order", _always, lambda c: baselines.megatron(c.sit.n, c.sit.m, c.sit.dp_llm)),
)


def sim_applies(sit: Situation, s: PortfolioSettings) -> bool:
    return 0 < s.sim_max_items_per_bin and sit.items_per_bin <= s.sim_max_items_per_bin and s.sim_max_evals > 0


def ilp_applies(sit: Situation, s: PortfolioSettings) -> bool:
    return sit.n * sit.n_bins <= s.ilp_max_vars and (sit.items_per_bin <= s.ilp_max_items_per_bin
                                                     or sit.skew >= s.ilp_min_skew)


@dataclass(frozen=True)
class Candidate:
    """A member's partition in its best order: bin_of [n], order [m], step_s (simulated seconds)."""

    member: str
    bin_of: np.ndarray
    order: np.ndarray
    step_s: float


def active_members(sit: Situation, settings: PortfolioSettings, registry=None) -> list[Member]:
    """The members of `registry` (default `REGISTRY`) that run on this situation, in registry order."""
    return [mem for mem in (REGISTRY if registry is None else registry) if mem.name not in settings.exclude and mem.applies(sit, settings)
            and (mem.greedy_path or not settings.greedy_path_only)]


def score(ctx: Context, named_bins: list[tuple[str, np.ndarray]]) -> list[Candidate]:
    """Each (member, bin_of) in its fastest candidate order (one batched simulation); members that
    break an active memory limit are dropped first."""
    sit, costs = ctx.sit, ctx.costs
    m, dp = sit.m, sit.dp_llm
    if ctx.guard.active:
        named_bins = [(name, b) for name, b in named_bins
                      if memory_ok(costs, b // dp, b % dp, m, dp, sit.dp_vision)]
    orders = best_orders([stage_times(costs, b // dp, b % dp, m, dp, sit.dp_vision) for _, b in named_bins],
                         p2p_s=ctx.p2p_s, allreduce_s=ctx.allreduce_s)
    return [Candidate(name, b, order, step) for (name, b), (order, step) in zip(named_bins, orders)]


def build(ctx: Context, members: list[Member], errors: list | None = None) -> list[tuple[str, np.ndarray]]:
    """(name, bin_of) of every member that offers a partition.

    A member whose packing order runs out of room under the memory guard is skipped, not the
    batch: another order (batch order, length-grouped) may still fit it. Its error goes to
    `errors`; `candidates` raises the first one when no member's partition fits.
    """
    out = []
    for mem in members:
        try:
            bin_of = mem.build(ctx)
        except MemoryGuardError as exc:
            if errors is None:
                raise
            errors.append(exc)
            continue
        if bin_of is not None:
            out.append((mem.name, bin_of))
    return out


def sim_starts(scored: list[Candidate], k: int) -> list[Candidate]:
    """The `k` fastest candidates with different assignments (ties: registry order)."""
    starts, seen = [], set()
    for cand in sorted(scored, key=lambda c: c.step_s):
        key = cand.bin_of.tobytes()
        if key not in seen and len(starts) < k:
            seen.add(key)
            starts.append(cand)
    return starts


def run_sim_search(ctx: Context, start: Candidate) -> Candidate:
    """`sim_search` from one scored candidate (deterministic: capped by evaluations, not time)."""
    sit = ctx.sit
    bin_of, order, step = sim_search(ctx.costs, start.bin_of, start.order, sit.m, sit.dp_llm, sit.dp_vision,
                                     max_evals=ctx.settings.sim_max_evals, p2p_s=ctx.p2p_s,
                                     allreduce_s=ctx.allreduce_s)
    return Candidate("sim_search", bin_of, order, step)


def fastest(cands: list[Candidate]) -> Candidate:
    """The candidate with the shortest step; ties go to the earlier one."""
    best = cands[0]
    for cand in cands[1:]:
        if cand.step_s < best.step_s * (1 - 1e-12):
            best = cand
    return best


def sim_refine(ctx: Context, scored: list[Candidate], search=run_sim_search) -> list[Candidate]:
    """`sim_search` from the `sim_starts` fastest distinct candidates: the results strictly faster
    than everything before them (and within the memory limits), in the order found. Local search
    ends where its start leads it, hence several starts."""
    sit = ctx.sit
    found, best = [], fastest(scored).step_s
    for start in sim_starts(scored, ctx.settings.sim_starts):
        cand = search(ctx, start)
        ok = memory_ok(ctx.costs, cand.bin_of // sit.dp_llm, cand.bin_of % sit.dp_llm, sit.m, sit.dp_llm,
                       sit.dp_vision)
        if cand.step_s < best * (1 - 1e-12) and (ok or not ctx.guard.active):
            found.append(cand)
            best = cand.step_s
    return found


def ilp_refine(ctx: Context, warm_bin_of: np.ndarray, *, deadline: float) -> tuple[list[Candidate], str]:
    """The 1F1B-aware ILP warm-started from `warm_bin_of`, scored by simulation: ([the ILP's
    candidate] or [], its status). HiGHS stops at `deadline` (perf_counter seconds) at the latest."""
    sit = ctx.sit
    res = solve_ilp(ctx.costs, sit.m, sit.dp_llm, sit.dp_vision, warm_bin_of,
                    time_limit_s=max(deadline - time.perf_counter(), 1e-3), seed=ctx.seed,
                    max_nodes=ctx.settings.ilp_max_nodes)
    if res.status in ("optimal", "node_limit") and res.bin_of is not None:
        return score(ctx, [("ilp", res.bin_of)]), res.status
    return [], res.status


def candidates(ctx: Context, members: list[Member], *, ilp: str = "never",
               deadline: float = float("inf")) -> tuple[list[Candidate], str]:
    """Every member's scored candidate, then the ILP's (``ilp``: "never", "auto": where
    `ilp_applies`, "always"; warm-started from the fastest candidate so far) and `sim_search`'s
    where they run: (candidates, the ILP's status or "not_run"). The fastest of them is the
    portfolio's answer."""
    errors: list[MemoryGuardError] = []
    scored = score(ctx, build(ctx, members, errors))
    if not scored and errors:  # no member's partition fits: the batch cannot run on this layout
        raise errors[0]
    ilp_status = "not_run"
    settings = ctx.settings
    if "ilp" not in settings.exclude and not settings.greedy_path_only and (
            ilp == "always" or (ilp == "auto" and ilp_applies(ctx.sit, settings))):
        found, ilp_status = ilp_refine(ctx, fastest(scored).bin_of, deadline=deadline)
        scored += found
    if "sim_search" not in settings.exclude and not settings.greedy_path_only and sim_applies(ctx.sit, settings):
        scored += sim_refine(ctx, scored)
    return scored, ilp_status


def context(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int, settings: PortfolioSettings, *,
            seed: int = 0, lengths: np.ndarray | None = None, p2p_s: float = 0.0,
            allreduce_s=0.0, registry=None) -> tuple[Context, list[Member]]:
    """The shared context of one batch and the members of `registry` (default `REGISTRY`) that run
    on it."""
    sit = Situation(costs.n_samples, m, dp_llm, dp_vision, costs.pp_vision + costs.pp_llm, cost_skew(costs))
    members = active_members(sit, settings, registry)
    guard = MemoryGuard.from_costs(costs, dp_vision)
    guard.check_samples()
    length = np.asarray(lengths, dtype=np.float64) if lengths is not None else costs.llm_total()
    if length.shape != (sit.n,):
        raise ValueError(f"lengths must have one entry per sample ({sit.n}), got shape {length.shape}")
    ends = tuple(mem.ends for mem in members if mem.ends is not None)
    return Context(costs, sit, settings, seed=seed, lengths=length, p2p_s=p2p_s, allreduce_s=allreduce_s,
                   guard=guard, ends=ends), members
