"""The "profile" portfolio member: shape the microbatches like the best fluid 1F1B schedule, then
fill them with the real samples.

Equal microbatches are not what a 1F1B step wants. With perfectly divisible work, the fastest
step (an LP, `fluid_profile`) ramps the first microbatches up from light to full (cheap fill),
keeps a flat plateau, and ramps the last ones down (cheap drain), under T* by a margin that
shrinks as m grows (benchmarks/README.md, "Certified lower bound"). Two sample-level facts are built into
the LP so that its profile can actually be filled:

- samples are grouped into a few classes by their vision/LLM mix, and every microbatch's vision
  and LLM loads must come from fractions of these classes (a vision-only profile that no sample
  mix can produce is not allowed);
- the heaviest samples are placed, ``dp_llm`` at a time, in "slot" microbatches whose per-bin LLM
  load must be at least the group's heaviest sample: with 1-2 samples per bin a heavy sample sets
  its bin, and the LP then raises the plateau around it instead of pretending it can be split.

The profile gives every microbatch a vision target and every bin an LLM target (seconds). The
2-D greedy fills bins against those capacities and `fit_profile` improves the worst load/target
ratio. Why that is the right thing to minimise: if every bin's LLM load and every microbatch's
vision load is at most rho times its target, every op of the coupled simulation is at most rho
times the profile's op (all replicas at most the profile's bin), so by monotonicity of the
longest path the simulated step is at most rho times the LP's step (exact when each sample's
costs are proportional across stages and forward/backward, as `ScalarCosts` assumes).

The same LP without classes, slots or tie-break is a certified lower bound on the step of any
partition (`fluid_lower_bound`); T* (equal microbatches) is not one.
"""

from __future__ import annotations

from dataclasses import dataclass

import highspy
import numpy as np
import scipy.sparse as sp

from dflop.costmodel.types import BatchCosts
from dflop.highs import quiet_highs
from dflop.scheduler.evaluate import ScalarCosts
from dflop.scheduler.greedy import MemoryGuard, MemoryGuardError, greedy_2d
from dflop.sim import stage_op_order


@dataclass(frozen=True)
class FluidProfile:
    """Optimum of the fluid 1F1B LP.

    step_s: its simulated step (seconds); vision_share, llm_share: [m] share of the batch's vision
    work in each microbatch and of the LLM work in each of its bins (each sums to 1 over m).
    """

    step_s: float
    vision_share: np.ndarray
    llm_share: np.ndarray


def _pipeline_edges(p: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(to, from, crosses_stages) op ids of the single-pipeline 1F1B dependency graph.

    Op id = stage * 2m + kind * m + position (kind 0 forward, 1 backward), as in `dflop.sim`.
    """
    def op(s, kind, j):
        return s * 2 * m + kind * m + j

    to, fr, cross = [], [], []
    for s in range(p):
        prev = -1
        for kind, j in stage_op_order("1f1b", s, p, m):
            o = op(s, kind, j)
            if prev >= 0:
                to.append(o), fr.append(prev), cross.append(False)
            prev = o
            if kind == 0 and s > 0:
                to.append(o), fr.append(op(s - 1, 0, j)), cross.append(True)
            elif kind == 1 and s < p - 1:
                to.append(o), fr.append(op(s + 1, 1, j)), cross.append(True)
            elif kind == 1:
                to.append(o), fr.append(op(s, 0, j)), cross.append(False)
    return np.asarray(to), np.asarray(fr), np.asarray(cross)


def sample_classes(sc: ScalarCosts, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """[K] share of the batch's vision and of its LLM work in each of K equal-count classes of
    samples ranked by how vision-heavy they are."""
    v_tot, l_tot = float(sc.vision.sum()), float(sc.llm.sum())
    a = sc.vision / v_tot if v_tot > 0 else np.zeros_like(sc.vision)
    b = sc.llm / l_tot if l_tot > 0 else np.zeros_like(sc.llm)
    vision_heavy = a / np.maximum(a + b, 1e-300)
    cls = np.empty(len(a), dtype=np.int64)
    for k, chunk in enumerate(np.array_split(np.argsort(vision_heavy, kind="stable"), n_classes)):
        cls[chunk] = k
    return np.bincount(cls, weights=a, minlength=n_classes), np.bincount(cls, weights=b, minlength=n_classes)


def heavy_slots(sc: ScalarCosts, m: int, dp_llm: int) -> tuple[np.ndarray, np.ndarray]:
    """[m] lower bounds on each microbatch's vision share and per-bin LLM share.

    Samples heavier than a mean bin, heaviest first, are grouped dp_llm at a time (one per bin)
    into consecutive microbatches from m // 3 on; a slot's bins must hold its heaviest sample and
    its vision share its samples' vision.
    """
    v_tot, l_tot = float(sc.vision.sum()), float(sc.llm.sum())
    lo_v, lo_l = np.zeros(m), np.zeros(m)
    if l_tot <= 0:
        return lo_v, lo_l
    llm_share = sc.llm * dp_llm / l_tot          # a bin holding only sample i needs this share
    heavy = np.argsort(-llm_share, kind="stable")[: int((llm_share > 1.0 / m).sum())]
    for g, j in enumerate(range(m // 3, m)):
        group = heavy[g * dp_llm:(g + 1) * dp_llm]
        if len(group) == 0:
            break
        lo_l[j] = llm_share[group].max()
        lo_v[j] = sc.vision[group].sum() / v_tot if v_tot > 0 else 0.0
    return lo_v, lo_l


def _proportional_groups(fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """[2p] group id of every (stage, direction), row stage * 2 + direction: rows whose per-sample
    costs are proportional (within 1e-9, or all zero) share a group, because every partition puts
    the same share of their batch total in each microbatch."""
    rows = np.stack([fwd, bwd], axis=1).reshape(-1, fwd.shape[1])
    sums = rows.sum(axis=1)
    unit = rows / np.where(sums > 0, sums, 1.0)[:, None]
    group = np.zeros(len(rows), dtype=np.int64)   # an all-zero row's share multiplies 0: any group
    reps: list[int] = []
    for r in np.flatnonzero(sums > 0):
        match = [g for g, q in enumerate(reps) if np.allclose(unit[r], unit[q], rtol=1e-9, atol=1e-12)]
        if match:
            group[r] = match[0]
        else:
            group[r] = len(reps)
            reps.append(r)
    return group


def fluid_profile(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int, *, classes=None,
                  lower=None, p2p_s: float = 0.0, allreduce_s=0.0, smooth: float = 1e-4) -> FluidProfile | None:
    """The fastest 1F1B step when the batch's work is divisible: an LP on HiGHS.

    Every LLM replica carries the same per-bin load in a microbatch (replicas differing can only
    lengthen the coupled step), so one pipeline of pp_vision + pp_llm stages stands for all.
    Variables: start of every op, the vision share x_j and per-bin LLM share y_j of each
    microbatch, and the step C. Stage k's op on microbatch j lasts its constant plus x_j (vision)
    or y_j (LLM) times the batch's total on that stage (over dp_vision / dp_llm); every op starts
    after the ops it depends on (as `dflop.sim` runs them), and C >= each stage's last op end plus
    its all-reduce. Minimise C.

    Args:
        classes: optional ([K], [K]) vision and LLM shares of sample classes (`sample_classes`):
            then x_j = sum_k z_jk vs_k, y_j = sum_k z_jk ls_k with each class's fractions z_.k
            summing to 1, so the profile is made of the batch's actual mix.
        lower: optional ([m], [m]) lower bounds on x and y (`heavy_slots`).
        smooth: tie-break weight on the distance of x and y from uniform (each unit of share
            moved costs smooth * m * the batch's summed stage work): among (nearly) equally fast
            profiles prefer the most even one, which real samples fill more easily. Keep it small
            against the step: it is a tie-break, not an objective.
    Returns None when HiGHS fails or does not report an optimum.
    """
    solved = _fluid_lp(costs, m, dp_llm, dp_vision, independent=False, classes=classes, lower=lower, p2p_s=p2p_s,
                       allreduce_s=allreduce_s, smooth=smooth)
    if solved is None:
        return None
    step, shares = solved
    return FluidProfile(step, np.clip(shares[0], 0.0, None), np.clip(shares[1], 0.0, None))


def fluid_lower_bound(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int, *, p2p_s: float = 0.0,
                      allreduce_s=0.0) -> float | None:
    """A certified lower bound (seconds) on the simulated 1F1B step of ANY partition of this batch
    into m x dp_llm bins, in any microbatch order (`dflop.sim.simulate_dp`, same p2p/all-reduce).

    The LP of `fluid_profile` with one free share vector per group of (stage, forward/backward)
    whose per-sample costs are proportional (`_proportional_groups`; with the analytic model: one
    for vision, one for the LLM), no classes, no slots and no tie-break. Why it is <= every
    partition's step:
    1. For fixed op durations the simulated step is the longest path through the schedule's
       dependency graph, which is exactly the least C of the LP "every op starts after the ends
       of the ops it depends on (+ p2p), C >= each stage's last end + its all-reduce".
    2. A partition in any order fixes, for every stage and direction, each microbatch's vision
       time and each bin's LLM time as the constant plus the sum of its samples' costs, i.e. the
       constant plus a non-negative share of that stage's batch total, the shares summing to 1
       (an order only relabels microbatches); ops whose per-sample costs are proportional get
       equal shares. So it is a feasible point of that LP written per bin, with the coupled graph;
       forgetting which sample is where only enlarges the set.
    3. That per-bin LP is convex and unchanged by relabelling the LLM replicas, so averaging an
       optimum over all relabellings is an optimum whose bins in a microbatch are equal; with
       equal replicas the coupled graph's longest paths are those of one pipeline, which is the
       LP solved here. Hence LP optimum <= min over partitions of the simulated step.
    Needs stage times additive over samples (as `BatchCosts` defines). Returns None when HiGHS
    fails.
    """
    solved = _fluid_lp(costs, m, dp_llm, dp_vision, independent=True, classes=None, lower=None, p2p_s=p2p_s,
                       allreduce_s=allreduce_s, smooth=0.0)
    return None if solved is None else solved[0]


def _fluid_lp(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int, *, independent: bool, classes, lower,
              p2p_s: float, allreduce_s, smooth: float) -> tuple[float, np.ndarray] | None:
    """(C, share vectors) of the fluid LP; shares [2, m] (vision, LLM) or, ``independent``,
    one per proportional group of (stage, direction). See `fluid_profile` and `fluid_lower_bound`."""
    pv, pl = costs.pp_vision, costs.pp_llm
    p = pv + pl
    f_const = np.r_[costs.vision_fwd_const, costs.llm_fwd_const]
    b_const = np.r_[costs.vision_bwd_const, costs.llm_bwd_const]
    f_tot = np.r_[costs.vision_fwd.sum(axis=1) / dp_vision, costs.llm_fwd.sum(axis=1) / dp_llm]
    b_tot = np.r_[costs.vision_bwd.sum(axis=1) / dp_vision, costs.llm_bwd.sum(axis=1) / dp_llm]
    allreduce = np.broadcast_to(np.asarray(allreduce_s, dtype=np.float64), (p,))
    n_ops = p * 2 * m
    stage, rest = np.divmod(np.arange(n_ops), 2 * m)
    kind, pos = np.divmod(rest, m)
    const = np.where(kind == 0, f_const[stage], b_const[stage])
    total = np.where(kind == 0, f_tot[stage], b_tot[stage])
    # Columns: op starts | share vectors (n_vec x m) | C | extras
    if independent:
        group = _proportional_groups(np.r_[costs.vision_fwd, costs.llm_fwd], np.r_[costs.vision_bwd, costs.llm_bwd])
        n_vec, vec = int(group.max()) + 1, group[stage * 2 + kind]
    else:
        n_vec, vec = 2, (stage >= pv).astype(np.int64)
    c_s = n_ops
    c_c = c_s + n_vec * m
    share_col = c_s + vec * m + pos
    n_col = c_c + 1

    rows, cols, vals, lo, hi = [], [], [], [], []

    def add_rows(r_cols, r_vals, r_lo, r_hi):
        """Rows given as [R, k] columns/values; bounds [R]."""
        base = sum(len(x) for x in lo)
        rows.append(np.repeat(base + np.arange(len(r_lo)), r_cols.shape[1]))
        cols.append(r_cols.ravel())
        vals.append(r_vals.ravel())
        lo.append(np.asarray(r_lo, dtype=np.float64))
        hi.append(np.asarray(r_hi, dtype=np.float64))

    # start[to] - start[from] - total[from] * share[from] >= const[from] (+ p2p across stages)
    to, fr, cross = _pipeline_edges(p, m)
    add_rows(np.c_[to, fr, share_col[fr]], np.c_[np.ones(len(to)), -np.ones(len(to)), -total[fr]],
             const[fr] + np.where(cross, p2p_s, 0.0), np.full(len(to), np.inf))
    # C >= end of each stage's last op (its last backward) + that stage's all-reduce
    last = np.arange(p) * 2 * m + 2 * m - 1
    add_rows(np.c_[np.full(p, c_c), last, share_col[last]], np.c_[np.ones(p), -np.ones(p), -total[last]],
             const[last] + allreduce, np.full(p, np.inf))
    shares = (c_s + np.arange(n_vec * m)).reshape(n_vec, m)
    if classes is None:
        add_rows(shares, np.ones((n_vec, m)), np.ones(n_vec), np.ones(n_vec))
    else:
        vs, ls = (np.asarray(x, dtype=np.float64) for x in classes)
        n_cls = len(vs)
        z = n_col + np.arange(m * n_cls).reshape(m, n_cls)
        n_col += m * n_cls
        add_rows(np.c_[shares[0], z], np.c_[np.ones(m), -np.tile(vs, (m, 1))], np.zeros(m), np.zeros(m))
        add_rows(np.c_[shares[1], z], np.c_[np.ones(m), -np.tile(ls, (m, 1))], np.zeros(m), np.zeros(m))
        add_rows(z.T, np.ones((n_cls, m)), np.ones(n_cls), np.ones(n_cls))
    cost = np.zeros(n_col)
    cost[c_c] = 1.0
    if smooth > 0:  # d >= |share - 1/m| for every share
        k = n_vec * m
        d = n_col + np.arange(k)
        n_col += k
        flat = shares.ravel()
        add_rows(np.c_[flat, d], np.c_[np.ones(k), -np.ones(k)], np.full(k, -np.inf), np.full(k, 1.0 / m))
        add_rows(np.c_[flat, d], np.ones((k, 2)), np.full(k, 1.0 / m), np.full(k, np.inf))
        cost = np.r_[cost, np.full(k, smooth * m * float(f_tot.sum() + b_tot.sum()))]
    lo_all, hi_all = np.concatenate(lo), np.concatenate(hi)
    a = sp.csc_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(len(lo_all), n_col))
    col_lo = np.zeros(n_col)
    if lower is not None:
        col_lo[shares[0]], col_lo[shares[1]] = lower

    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n_col, len(lo_all)
    lp.col_cost_ = cost
    lp.col_lower_, lp.col_upper_ = col_lo, np.full(n_col, highspy.kHighsInf)
    lp.row_lower_ = np.where(np.isinf(lo_all), -highspy.kHighsInf, lo_all)
    lp.row_upper_ = np.where(np.isinf(hi_all), highspy.kHighsInf, hi_all)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = a.indptr.astype(np.int32)
    lp.a_matrix_.index_ = a.indices.astype(np.int32)
    lp.a_matrix_.value_ = a.data
    try:
        h = quiet_highs()
        h.setOptionValue("threads", 1)
        h.passModel(lp)
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        col = np.asarray(h.getSolution().col_value)
    except Exception:  # noqa: BLE001 — a solver failure only drops this member, never the portfolio
        return None
    return float(col[c_c]), col[c_s:c_c].reshape(n_vec, m)


def profile_targets(sc: ScalarCosts, profile: FluidProfile, dp_llm: int) -> np.ndarray:
    """[2, m] target seconds (bottleneck stage, as `ScalarCosts`): each microbatch's vision load
    and each of its bins' LLM load under the profile, constants included."""
    return np.stack([sc.vision_const + profile.vision_share * float(sc.vision.sum()),
                     sc.llm_const + profile.llm_share * float(sc.llm.sum()) / dp_llm])


def worst_ratio(sc: ScalarCosts, bin_of: np.ndarray, m: int, dp_llm: int, targets: np.ndarray) -> float:
    """Largest load / target over every bin's LLM load and every microbatch's vision load."""
    L = np.bincount(bin_of, weights=sc.llm, minlength=m * dp_llm) + sc.llm_const
    V = np.bincount(bin_of // dp_llm, weights=sc.vision, minlength=m) + sc.vision_const
    return float(max((L / np.repeat(targets[1], dp_llm)).max(), (V / targets[0]).max()))


def fit_profile(sc: ScalarCosts, bin_of: np.ndarray, m: int, dp_llm: int, targets: np.ndarray, *,
                max_iters: int = 600, n_sources: int = 16, tol: float = 2e-2) -> np.ndarray:
    """Move/swap search on load / target ratios (``targets`` from `profile_targets`).

    Each step takes the worst ratio (a bin's LLM load or a microbatch's vision load) and applies
    the move of one of its samples to any bin, or its swap with any sample, that most lowers the
    largest ratio it touches, if that is below the current worst. A worst element no such step can
    lower is set aside and the search goes on with the next one (min-max alone would stop at the
    first heavy sample that cannot move, leaving every other microbatch as the greedy left it);
    accepted steps never raise a ratio above the current worst. Stops when every ratio not set
    aside is within `tol` of 1 (tighter buys little step for much more time)
    or after `max_iters` steps. No memory guard: callers check the result.
    """
    bin_of = bin_of.copy()
    n_bins = m * dp_llm
    mb_of_bin = np.arange(n_bins) // dp_llm
    tv, tl = targets[0], np.repeat(targets[1], dp_llm)
    v, l = sc.vision, sc.llm
    L = np.bincount(bin_of, weights=l, minlength=n_bins) + sc.llm_const
    V = np.bincount(bin_of // dp_llm, weights=v, minlength=m) + sc.vision_const
    set_aside_bin, set_aside_mb = np.zeros(n_bins, dtype=bool), np.zeros(m, dtype=bool)
    for _ in range(max_iters):
        rl = np.where(set_aside_bin, -np.inf, L / tl)
        rv = np.where(set_aside_mb, -np.inf, V / tv)
        b_max, j_max = int(np.argmax(rl)), int(np.argmax(rv))
        worst = max(rl[b_max], rv[j_max])
        if not np.isfinite(worst) or worst <= 1 + tol:
            break
        llm_side = rl[b_max] >= rv[j_max]
        src = np.flatnonzero(bin_of == b_max) if llm_side else np.flatnonzero((bin_of // dp_llm == j_max) & (v > 0))
        if len(src) > n_sources:  # big, medium and small ones
            ranked = src[np.argsort(-(l[src] if llm_side else v[src]), kind="stable")]
            src = ranked[np.linspace(0, len(ranked) - 1, n_sources).round().astype(np.int64)]
        if len(src) == 0:
            break
        bi, ji = bin_of[src], bin_of[src] // dp_llm
        li, vi = l[src][:, None], v[src][:, None]
        # Moves: sample src[a] -> bin c.
        same = mb_of_bin[None, :] == ji[:, None]
        mv = np.maximum.reduce([
            np.broadcast_to((L[bi] - l[src])[:, None] / tl[bi][:, None], same.shape),
            (L[None, :] + li) / tl[None, :],
            np.where(same, V[ji][:, None], V[ji][:, None] - vi) / tv[ji][:, None],
            np.where(same, V[ji][:, None] / tv[ji][:, None], (V[mb_of_bin][None, :] + vi) / tv[mb_of_bin][None, :]),
        ])
        mv[np.arange(len(src)), bi] = np.inf
        # Swaps: sample src[a] <-> any sample q in another bin.
        bq, jq = bin_of, bin_of // dp_llm
        dl = li - l[None, :]
        dv = np.where(ji[:, None] == jq[None, :], 0.0, vi - v[None, :])
        sw = np.maximum.reduce([(L[bi][:, None] - dl) / tl[bi][:, None], (L[bq][None, :] + dl) / tl[bq][None, :],
                                (V[ji][:, None] - dv) / tv[ji][:, None], (V[jq][None, :] + dv) / tv[jq][None, :]])
        sw[bi[:, None] == bq[None, :]] = np.inf
        best_mv, best_sw = mv.min(), sw.min()
        if min(best_mv, best_sw) >= worst * (1 - 1e-9):
            if llm_side:
                set_aside_bin[b_max] = True
            else:
                set_aside_mb[j_max] = True
            continue
        if best_mv <= best_sw:
            a, c = np.unravel_index(int(np.argmin(mv)), mv.shape)
            moves = [(int(src[a]), int(c))]
        else:
            a, q = np.unravel_index(int(np.argmin(sw)), sw.shape)
            i, k = int(src[a]), int(q)
            moves = [(i, int(bin_of[k])), (k, int(bin_of[i]))]
        for i, c in moves:
            b = int(bin_of[i])
            L[b] -= l[i]
            L[c] += l[i]
            V[b // dp_llm] -= v[i]
            V[c // dp_llm] += v[i]
            bin_of[i] = c
    return bin_of


def fill_empty_bins(sc: ScalarCosts, bin_of: np.ndarray, m: int, dp_llm: int, targets: np.ndarray) -> np.ndarray:
    """Give every empty bin one sample (a partition never leaves a bin empty: that replica would
    idle through the whole microbatch): the move, from a bin holding two or more, that keeps the
    largest load / target ratio it touches lowest."""
    bin_of = bin_of.copy()
    n_bins = m * dp_llm
    tv, tl = targets[0], np.repeat(targets[1], dp_llm)
    v, l = sc.vision, sc.llm
    for b in np.flatnonzero(np.bincount(bin_of, minlength=n_bins) == 0):
        count = np.bincount(bin_of, minlength=n_bins)
        L = np.bincount(bin_of, weights=l, minlength=n_bins) + sc.llm_const
        V = np.bincount(bin_of // dp_llm, weights=v, minlength=m) + sc.vision_const
        src, j = bin_of // dp_llm, b // dp_llm
        same = src == j
        worst = np.maximum.reduce([(L[bin_of] - l) / tl[bin_of], (sc.llm_const + l) / tl[b],
                                   np.where(same, V[j], V[src] - v) / tv[src], np.where(same, V[j], V[j] + v) / tv[j]])
        worst[count[bin_of] < 2] = np.inf
        i = int(np.argmin(worst))
        bin_of[i] = b
    return bin_of


def profile_partition(costs: BatchCosts, sc: ScalarCosts, m: int, dp_llm: int, dp_vision: int, guard: MemoryGuard, *,
                      p2p_s: float = 0.0, allreduce_s=0.0, n_classes: int = 4) -> np.ndarray | None:
    """bin_of of the "profile" member (module docstring; no bin left empty), or None when the LP
    fails or the guarded greedy finds no room for a sample."""
    classes = sample_classes(sc, n_classes)
    profile = fluid_profile(costs, m, dp_llm, dp_vision, classes=classes, lower=heavy_slots(sc, m, dp_llm),
                            p2p_s=p2p_s, allreduce_s=allreduce_s)
    if profile is None:  # the slots can be infeasible (one sample heavier than a replica's share)
        profile = fluid_profile(costs, m, dp_llm, dp_vision, classes=classes, p2p_s=p2p_s, allreduce_s=allreduce_s)
    if profile is None:
        return None
    targets = profile_targets(sc, profile, dp_llm)
    if sc.vision_const == 0 and not sc.vision.any():
        targets[0] = 1.0  # no vision work at all (text-only batch): its load / target is 0 whatever the target
    if not (targets > 0).all():
        return None
    try:
        start = greedy_2d(sc, m, dp_llm, guard, targets)
    except MemoryGuardError:  # this packing order ran out of room: skip the member, not the batch
        return None
    fitted = fit_profile(sc, start, m, dp_llm, targets, max_iters=max(300, 10 * m))
    return fill_empty_bins(sc, fitted, m, dp_llm, targets)
