"""Microbatch execution order, chosen by simulating a few structured candidates.

In 1F1B a heavy microbatch in the middle of the steady phase costs about ``p`` times its excess,
while the first microbatch's forward and the last one's backward are paid ``p - 1`` times (fill and
drain). Which arrangement is best depends on the stages, so each candidate is simulated exactly and
the fastest kept; ties go to the earlier candidate, so the choice is deterministic.
"""

from __future__ import annotations

import numpy as np

from dflop.scheduler.evaluate import StageTimes, simulate_steps


def candidate_orders(weight: np.ndarray) -> list[np.ndarray]:
    """Orders to try, given each microbatch's weight [m] (seconds on its busiest stage)."""
    m = len(weight)
    asc = np.argsort(weight, kind="stable")
    desc = asc[::-1]
    orders = [np.arange(m), desc, asc]
    if m >= 3:
        # The two lightest microbatches at the ends (cheap fill and drain), either way round, the
        # rest heavy-to-light or light-to-heavy in between.
        middle_desc = desc[desc != asc[0]]
        middle_desc = middle_desc[middle_desc != asc[1]]
        for first, last in ((asc[0], asc[1]), (asc[1], asc[0])):
            orders.append(np.r_[first, middle_desc, last])
            orders.append(np.r_[first, middle_desc[::-1], last])
        # Alternate heavy and light so neighbours even each other out.
        zigzag = np.empty(m, dtype=np.int64)
        zigzag[0::2] = desc[: (m + 1) // 2]
        zigzag[1::2] = asc[: m // 2]
        orders.append(np.r_[zigzag[1:], zigzag[:1]] if m % 2 == 0 else zigzag)
        # A mountain: every other microbatch rising from the lightest, the rest falling back, so
        # both ends are light and neighbours are alike all the way (sorted, similar microbatches
        # then follow each other through the stages without stalls).
        orders.append(np.r_[asc[0::2], asc[1::2][::-1]])
    unique, seen = [], set()
    for o in orders:
        key = o.tobytes()
        if key not in seen:
            seen.add(key)
            unique.append(o)
    return unique


def best_orders(members: list[StageTimes], *, p2p_s: float = 0.0, allreduce_s=0.0,
                keep_identity: bool = False) -> list[tuple[np.ndarray, float]]:
    """For each member's stage times, the candidate order with the shortest simulated step and
    that step (seconds). Every member's candidates are simulated in one batched pass.

    keep_identity: only score the order as built (for baselines, which run in batch order).
    """
    if not members:
        return []
    m = members[0].llm_fwd.shape[2]
    per_member = [[np.arange(m)] if keep_identity else candidate_orders(t.microbatch_weight()) for t in members]
    flat_times = [t for t, orders in zip(members, per_member) for _ in orders]
    steps = simulate_steps(flat_times, [o for orders in per_member for o in orders], p2p_s=p2p_s,
                           allreduce_s=allreduce_s).tolist()
    out, pos = [], 0
    for orders in per_member:
        best = None
        for order, step in zip(orders, steps[pos:pos + len(orders)]):
            if best is None or step < best[1] * (1 - 1e-12):
                best = (order, step)
        out.append(best)
        pos += len(orders)
    return out

