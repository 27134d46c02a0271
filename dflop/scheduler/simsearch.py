"""The "sim_search" portfolio member: local search directly on the exact simulated 1F1B step.

With one sample per bin there is nothing to pack, and the proxies the other members balance
(bin loads, per-microbatch loads) say little: what decides the step is which microbatch runs
where in the 1F1B schedule (light ones first for a cheap fill, heavy vision microbatches early
where the vision stage has slack, a slow descent to a light one last) and which samples share a
microbatch (replicas run it in lockstep through the shared vision stages). There the structured
members land well over the benchmark's bound, and this search closes much of the gap
(benchmarks/README.md, "Scheduler" and "Modality mix").

Starting from a scored partition and order, two neighbourhoods alternate, each searched by best
improvement with every candidate scored exactly in one batched simulation
(`dflop.sim.simulate_dp_steps`):
  - order: move one microbatch from position a to position b (all a != b);
  - swaps: exchange two samples between bins whose microbatches run at most `span` positions
    apart (the same microbatch included: that changes which replica runs which sample).
A move is taken only if it strictly shortens the simulated step, so the result is never slower
than the start. Work is capped by `max_evals` (candidates x microbatches scored, about 2.6 us
each on one core), never by wall time, so the result is deterministic.
"""

from __future__ import annotations

import numpy as np

from dflop.costmodel.types import BatchCosts
from dflop.scheduler.evaluate import StageTimes, stage_times
from dflop.sim import simulate_dp_steps


def _best_improvement(n_candidates: int, score, step: float, chunk: int, evals_left: int,
                      evals_per_candidate: int) -> tuple[int | None, float, int]:
    """(index of the fastest candidate strictly faster than `step` or None, its step, evaluations
    used), scoring candidates `chunk` at a time with ``score(start, stop) -> [stop - start]`` and
    stopping once `evals_left` is spent."""
    best, used = None, 0
    for start in range(0, n_candidates, chunk):
        if used >= evals_left:
            break
        steps = score(start, min(start + chunk, n_candidates))
        used += len(steps) * evals_per_candidate
        a = int(np.argmin(steps))
        if steps[a] < step * (1 - 1e-12):
            best, step = start + a, float(steps[a])
    return best, step, used


def order_moves(order: np.ndarray) -> np.ndarray:
    """[m (m - 1), m] every order obtained by moving one position a to position b != a."""
    m = len(order)
    out = []
    for a in range(m):
        rest = np.delete(order, a)
        for b in range(m):
            if b != a:
                out.append(np.insert(rest, b, order[a]))
    return np.asarray(out, dtype=np.int64).reshape(-1, m)


def swap_pairs(bin_of: np.ndarray, order: np.ndarray, dp_llm: int, span: int) -> np.ndarray:
    """[K, 2] sample pairs (i < k) in different bins whose microbatches run at most `span`
    positions apart, in a fixed order (by i, then k)."""
    pos = np.empty(len(order), dtype=np.int64)
    pos[order] = np.arange(len(order))
    p = pos[bin_of // dp_llm]
    i, k = np.triu_indices(len(bin_of), 1)
    keep = (np.abs(p[i] - p[k]) <= span) & (bin_of[i] != bin_of[k])
    return np.c_[i[keep], k[keep]]


def _swapped_times(costs: BatchCosts, t: StageTimes, bin_of: np.ndarray, pairs: np.ndarray, dp_llm: int,
                   dp_vision: int):
    """Stage times [C, ...] of the partition with each pair of samples exchanged (one per candidate)."""
    c = len(pairs)
    i, k = pairs[:, 0], pairs[:, 1]
    bi, bk = bin_of[i], bin_of[k]
    ji, ri, jk, rk = bi // dp_llm, bi % dp_llm, bk // dp_llm, bk % dp_llm
    ar = np.arange(c)
    out = []
    for base, per in ((t.vision_fwd, costs.vision_fwd), (t.vision_bwd, costs.vision_bwd)):
        x = np.repeat(base[None], c, axis=0)                   # [C, Sv, m]
        d = (per[:, k] - per[:, i]).T / dp_vision            # [C, Sv]: sample k joins i's microbatch
        np.add.at(x, (ar, slice(None), ji), d)
        np.add.at(x, (ar, slice(None), jk), -d)
        out.append(x)
    for base, per in ((t.llm_fwd, costs.llm_fwd), (t.llm_bwd, costs.llm_bwd)):
        x = np.repeat(base[None], c, axis=0)                   # [C, R, Sl, m]
        d = (per[:, k] - per[:, i]).T                        # [C, Sl]
        x[ar, ri, :, ji] += d
        x[ar, rk, :, jk] -= d
        out.append(x)
    return out


def sim_search(costs: BatchCosts, bin_of: np.ndarray, order: np.ndarray, m: int, dp_llm: int, dp_vision: int, *,
               max_evals: int = 150_000, span: int = 1, chunk: int = 2048, p2p_s: float = 0.0,
               allreduce_s=0.0) -> tuple[np.ndarray, np.ndarray, float]:
    """(bin_of, order, step_s) after local search on the simulated step (module docstring).

    Args:
        bin_of: [n] start bin of every sample (b = microbatch * dp_llm + replica); order: [m] its
            microbatch order. The returned step is `simulate_dp`'s for the returned pair and never
            exceeds the start's.
        max_evals: cap on candidates x m scored (0: just score the start).
        span: swap partners run at most this many positions apart.
    Bin counts are kept (swaps exchange one sample for one); no memory guard: callers check.
    """
    bin_of = np.asarray(bin_of, dtype=np.int64).copy()
    order = np.asarray(order, dtype=np.int64).copy()

    def times_of(b):
        return stage_times(costs, b // dp_llm, b % dp_llm, m, dp_llm, dp_vision)

    def simulate(vf, vb, lf, lb, orders):
        return simulate_dp_steps(vf, vb, lf, lb, orders, p2p_s=p2p_s, allreduce_s=allreduce_s)

    def repeated(t, c):
        return [np.repeat(x[None], c, 0) for x in (t.vision_fwd, t.vision_bwd, t.llm_fwd, t.llm_bwd)]

    t = times_of(bin_of)
    step = float(simulate(*repeated(t, 1), order[None])[0])
    used = m
    stalled = 0                                   # neighbourhoods in a row without improvement
    phase = 0
    while used < max_evals and stalled < 2:
        improved = False
        if phase == 0 and m >= 2:
            moves = order_moves(order)
            best, best_step, spent = _best_improvement(
                len(moves), lambda a, b: simulate(*repeated(t, b - a), moves[a:b]), step, chunk, max_evals - used, m)
            if best is not None:
                order, step, improved = moves[best].copy(), best_step, True
        elif phase == 1:
            pairs = swap_pairs(bin_of, order, dp_llm, span)
            best, best_step, spent = _best_improvement(
                len(pairs), lambda a, b: simulate(*_swapped_times(costs, t, bin_of, pairs[a:b], dp_llm, dp_vision),
                                                  np.repeat(order[None], b - a, 0)),
                step, chunk, max_evals - used, m)
            if best is not None:
                i, k = (int(x) for x in pairs[best])
                bin_of[i], bin_of[k] = bin_of[k], bin_of[i]
                t = times_of(bin_of)
                step, improved = best_step, True
        else:
            spent = 0
        used += spent
        stalled = 0 if improved else stalled + 1
        if not improved:                    # each neighbourhood until it is stuck, then the other
            phase = 1 - phase
    return bin_of, order, step
