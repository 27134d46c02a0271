"""Split one global batch into m microbatches x dp_llm bins: the DFLOP portfolio and baselines.

Portfolio (policy "dflop"), each member's bins then ordered by simulation (see `ordering`):
  - greedy: 2-D vector LPT + move/swap local search on the bottleneck proxy (always; ms);
  - greedy_aligned: the same bins, permuted within each replica so that the k-th heaviest bin of
    every replica runs in the same microbatch (one heavy microbatch instead of several out of
    step; only when dp_llm > 1);
  - greedy_regrouped<w>: the same bins regrouped so each microbatch holds dp_llm bins of similar
    LLM load, vision evened over windows of w microbatches (`regroup_bins`; dp_llm > 1 only);
  - lockstep: with few samples per bin and dp_llm > 1, the greedy bins improved by swaps on the
    sum over microbatches of max(vision load, heaviest bin) (`lockstep_search`): replicas run a
    microbatch together, so it costs its heaviest bin;
  - lockstep_regrouped: the same swaps started from greedy_regrouped1 (microbatches of bins of
    similar LLM load), then each microbatch's bins re-dealt over the replicas to even their
    totals (`balance_replicas`); with one sample per bin often the fastest member before the search;
  - profile: with 2-4 samples per bin and dp_llm > 1, microbatches shaped like the fastest fluid
    1F1B schedule (an LP: light first and last microbatches, a plateau raised to hold the heaviest
    samples) and filled against those targets (`dflop.scheduler.profile`); its simulated step is
    at most (worst load / target) times the LP's;
  - lpt1d: 1-D LPT on LLM cost, a cheap second opinion when vision is light;
  - greedy_ends<w>: when the pipeline bubble is a large share of the step (few microbatches),
    greedy with the first and last microbatch filled to only w of the others: 1F1B pays the first
    forward and the last backward p - 1 times, so light ends can beat equal microbatches;
  - length_grouped: LLaVA's grouping by modality and length, reordered by simulation; its uneven
    vision/LLM profiles sometimes fit the fill and drain better (cheap, always tried);
  - batch_order: contiguous slices in batch order (the data-blind split), reordered by simulation;
    a cheap safety net, it only wins when nothing is left to balance (e.g. one sample per bin).
  - sim_search: with at most `sim_items_per_bin` samples per bin (default: one), the two fastest
    members above each improved by a local search on the exact simulated step (microbatch moves
    in the order, sample swaps between nearby microbatches; `dflop.scheduler.simsearch`); kept
    only if strictly faster, so never worse than its start (0.3-1.4 s where it runs).
With lpt1d, length_grouped and batch_order in the portfolio, and every member's order chosen
among candidates that include the order as built, the result is never slower (by the simulated
1F1B step) than the megatron, llava_group and lpt1d baselines.
  - ilp: the exact 1F1B-aware MILP (`ilp`) warm-started from greedy, within the time budget,
    when items per bin are few or the vision/LLM cost skew is high and the model is small enough.
The member with the shortest simulated 1F1B step wins; every member respects the memory guard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from dflop.costmodel.types import BatchCosts
from dflop.scheduler import baselines
from dflop.scheduler.evaluate import lower_bound, memory_ok, scalar_costs, stage_times
from dflop.scheduler.greedy import MemoryGuard, greedy_2d_many, local_search, lockstep_search, proxy
from dflop.scheduler.ilp import solve_ilp
from dflop.scheduler.ordering import best_orders
from dflop.scheduler.profile import profile_partition
from dflop.scheduler.simsearch import sim_search

POLICIES = ("dflop", "megatron", "llava_group", "lpt1d")


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
            "greedy_aligned", "profile", "lpt1d", "ilp", ..., or the baseline's name).
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


def align_replicas(bin_of: np.ndarray, llm_cost: np.ndarray, m: int, dp_llm: int) -> np.ndarray:
    """Permute each replica's bins over the microbatch ids so that microbatch k holds every
    replica's k-th heaviest bin (by `llm_cost`, [n] seconds)."""
    n_bins = m * dp_llm
    loads = np.bincount(bin_of, weights=llm_cost, minlength=n_bins).reshape(m, dp_llm)
    new_bin = np.empty(n_bins, dtype=np.int64)
    for r in range(dp_llm):
        ranked = np.argsort(-loads[:, r], kind="stable")  # old microbatch ids, heaviest first
        new_bin[ranked * dp_llm + r] = np.arange(m) * dp_llm + r
    return new_bin[bin_of]


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
              lengths: np.ndarray | None = None, ilp: str = "auto", ilp_max_vars: int = 4096,
              ilp_items_per_bin: float = 4.0, ilp_skew: float = 0.3, ilp_max_nodes: int = 200,
              end_weights: tuple[tuple[float, float], ...] = ((0.9, 0.7), (0.8, 0.6)),
              end_weights_min_bubble: float = 0.2, lockstep_items_per_bin: float = 4.0,
              profile_items_per_bin: float = 4.0, sim_items_per_bin: float = 1.0,
              sim_max_evals: int = 150_000, sim_starts: int = 2) -> Partition:
    """Partition one global batch (see module docstring for the portfolio).

    Args:
        costs: per-sample stage costs of the n samples of this global batch.
        m: microbatches; dp_llm, dp_vision: data-parallel replicas of the LLM and vision encoder.
        budget_s: wall seconds the ILP may use (greedy members always run).
        seed: seeds the ILP and the llava_group shuffle; same inputs + seed = same partition.
        policy: "dflop" (portfolio) or a baseline: "megatron", "llava_group", "lpt1d".
        p2p_s, allreduce_s: passed to the simulator (seconds).
        lengths: [n] lengths llava_group sorts by (LLaVA uses text length); default LLM cost.
        ilp: "auto" (when items per bin <= ilp_items_per_bin or skew >= ilp_skew, and
            n * m * dp_llm <= ilp_max_vars), "always" or "never".
        lockstep_items_per_bin: with dp_llm > 1 and at most this many samples per bin, also run
            `lockstep_search` from the greedy result ("lockstep").
        profile_items_per_bin: with dp_llm > 1 and 2 to this many samples per bin, also run the
            fluid-profile member ("profile"; an LP plus a fit, ~0.1 s at 128 bins, ~0.3 s at 512);
            0 turns it off.
        sim_items_per_bin: with at most this many samples per bin, run `sim_search` from each of
            the `sim_starts` fastest members (at most `sim_max_evals` candidate x microbatch
            simulations each); 0 turns it off.
        end_weights: when the pipeline bubble (p - 1) / (m + p - 1) is at least
            end_weights_min_bubble, also try greedy members whose first and last microbatch are
            filled to only this share of the others (cheaper fill and drain; "greedy_ends<w>").
    """
    t0 = time.perf_counter()
    _check_args(costs, m, dp_llm, dp_vision, policy)
    n, n_bins = costs.n_samples, m * dp_llm
    bound = lower_bound(costs, m, dp_llm, dp_vision, p2p_s=p2p_s, allreduce_s=allreduce_s)
    sc = scalar_costs(costs, m, dp_llm, dp_vision)

    def finish(named_bins, ilp_status: str = "not_run", keep_identity: bool = False) -> list[Partition]:
        """Partitions of (member, bin_of) pairs, each in its best order (one batched simulation)."""
        split = [(bin_of // dp_llm, bin_of % dp_llm) for _, bin_of in named_bins]
        orders = best_orders([stage_times(costs, mb, rep, m, dp_llm, dp_vision) for mb, rep in split],
                             p2p_s=p2p_s, allreduce_s=allreduce_s, keep_identity=keep_identity)
        return [Partition(mb, rep, order, m, dp_llm, dp_vision, step, bound, proxy(sc, bin_of, m, dp_llm), policy,
                          member, time.perf_counter() - t0, ilp_status, memory_ok(costs, mb, rep, m, dp_llm, dp_vision))
                for (member, bin_of), (mb, rep), (order, step) in zip(named_bins, split, orders)]

    if policy == "megatron":
        return finish([("megatron", baselines.megatron(n, m, dp_llm))], keep_identity=True)[0]
    if policy == "llava_group":
        length = np.asarray(lengths, dtype=np.float64) if lengths is not None else costs.llm_total()
        if length.shape != (n,):
            raise ValueError(f"lengths must have one entry per sample ({n}), got shape {length.shape}")
        return finish([("llava_group", baselines.llava_group(length, costs.vision_total() > 0, m, dp_llm, seed))],
                      keep_identity=True)[0]
    if policy == "lpt1d":
        return finish([("lpt1d", baselines.lpt1d(costs.llm_total(), m, dp_llm))], keep_identity=True)[0]

    guard = MemoryGuard.from_costs(costs, dp_vision)
    guard.check_samples()
    # The light-ends weightings (see module docstring) run in the same batched greedy pass.
    p = costs.pp_vision + costs.pp_llm
    end_members = []
    if m >= 2 and (p - 1) / (m + p - 1) >= end_weights_min_bubble:
        for w_first, w_last in end_weights:
            weight = np.ones(m)
            weight[0], weight[-1] = w_first, w_last
            end_members.append((f"greedy_ends{w_first:g}/{w_last:g}", weight))
    first_pass = greedy_2d_many(sc, m, dp_llm, guard, [None] + [w for _, w in end_members])
    greedy = local_search(sc, first_pass[0], m, dp_llm, guard)
    members = [("greedy", greedy)]
    if dp_llm > 1:
        members.append(("greedy_aligned", align_replicas(greedy, sc.llm, m, dp_llm)))
        regrouped = {w: regroup_bins(greedy, sc.llm, sc.vision, m, dp_llm, w) for w in (1, 4)}
        members.extend((f"greedy_regrouped{w}", bins) for w, bins in regrouped.items())
        if n / n_bins <= lockstep_items_per_bin:
            members.append(("lockstep", lockstep_search(sc, greedy, m, dp_llm)))
            members.append(("lockstep_regrouped", balance_replicas(
                lockstep_search(sc, regrouped[1], m, dp_llm), sc.llm, m, dp_llm)))
        if 2 <= n / n_bins <= profile_items_per_bin:
            shaped = profile_partition(costs, sc, m, dp_llm, dp_vision, guard, p2p_s=p2p_s, allreduce_s=allreduce_s)
            if shaped is not None:
                members.append(("profile", shaped))
    members.append(("lpt1d", baselines.lpt1d(costs.llm_total(), m, dp_llm)))
    for (name, weight), bins_w in zip(end_members, first_pass[1:]):
        members.append((name, local_search(sc, bins_w, m, dp_llm, guard, mb_weight=weight)))
    length = np.asarray(lengths, dtype=np.float64) if lengths is not None else costs.llm_total()
    if length.shape != (n,):
        raise ValueError(f"lengths must have one entry per sample ({n}), got shape {length.shape}")
    members.append(("length_grouped", baselines.llava_group(length, costs.vision_total() > 0, m, dp_llm, seed)))
    members.append(("batch_order", baselines.megatron(n, m, dp_llm)))

    ilp_status = "not_run"
    few_items = n / n_bins <= ilp_items_per_bin
    run_ilp = ilp == "always" or (ilp == "auto" and n * n_bins <= ilp_max_vars
                                  and (few_items or cost_skew(costs) >= ilp_skew))
    if ilp not in ("auto", "always", "never"):
        raise ValueError(f"ilp must be 'auto', 'always' or 'never', got {ilp!r}")
    if run_ilp:
        remaining = budget_s - (time.perf_counter() - t0)
        res = solve_ilp(costs, m, dp_llm, dp_vision, greedy, time_limit_s=max(remaining, 1e-3), seed=seed,
                        max_nodes=ilp_max_nodes)
        ilp_status = res.status
        if res.status in ("optimal", "node_limit") and res.bin_of is not None:
            members.append(("ilp", res.bin_of))

    fitting = [(name, bin_of) for name, bin_of in members
               if not guard.active or memory_ok(costs, bin_of // dp_llm, bin_of % dp_llm, m, dp_llm, dp_vision)]
    best = None
    candidates = finish(fitting, ilp_status)
    for cand in candidates:
        if best is None or cand.step_s < best.step_s * (1 - 1e-12):
            best = cand
    if 0 < sim_items_per_bin and n / n_bins <= sim_items_per_bin and sim_max_evals > 0:
        # Local search ends where its start leads it: search from the `sim_starts` fastest members
        # with different assignments and keep the fastest result.
        starts, seen = [], set()
        for cand in sorted(candidates, key=lambda c: c.step_s):
            key = (cand.microbatch * dp_llm + cand.replica).tobytes()
            if key not in seen and len(starts) < sim_starts:
                seen.add(key)
                starts.append(cand)
        for start in starts:
            bin_of, order, step = sim_search(costs, start.microbatch * dp_llm + start.replica, start.order, m,
                                             dp_llm, dp_vision, max_evals=sim_max_evals, p2p_s=p2p_s,
                                             allreduce_s=allreduce_s)
            mb, rep = bin_of // dp_llm, bin_of % dp_llm
            ok = memory_ok(costs, mb, rep, m, dp_llm, dp_vision)
            if step < best.step_s * (1 - 1e-12) and (ok or not guard.active):
                searched = replace(start, microbatch=mb, replica=rep, order=order, step_s=step,
                                   proxy_s=proxy(sc, bin_of, m, dp_llm), member="sim_search", memory_ok=ok)
                candidates.append(searched)
                best = searched
    return replace(best, solve_s=time.perf_counter() - t0,
                   candidates=tuple((c.member, c.step_s) for c in candidates))


def greedy_partition(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int, *, p2p_s: float = 0.0,
                     allreduce_s=0.0) -> Partition:
    """The portfolio without the ILP, the fluid-profile LP and the simulated-step search: what the
    online service falls back to (milliseconds; the LP and the search take 0.1-1.4 s where they run)."""
    return partition(costs, m, dp_llm, dp_vision, p2p_s=p2p_s, allreduce_s=allreduce_s, ilp="never",
                     profile_items_per_bin=0, sim_items_per_bin=0)
