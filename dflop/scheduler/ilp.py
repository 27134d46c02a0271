"""Exact bin assignment as a MILP on HiGHS (highspy), warm-started from the greedy result.

Objective (1F1B-aware): in a 1F1B pipeline of ``p`` stages a replica's step is about the sum of its
microbatch times plus ``p - 1`` times its heaviest one (fill/drain and the ~p-fold cost of an
outlier). So with binary ``x[i, b]`` (sample ``i`` in bin ``b = j * dp_llm + r``), per-replica
maxima ``z_r``, the vision maximum ``z_v`` and the estimate ``y`` (seconds), minimise ``y`` subject
to: every sample in exactly one bin; on every LLM stage ``k`` each bin's time
``llm_const[k] + sum_i llm[k, i] x[i, b] <= z_r``; on every vision stage each microbatch's time
``vision_const[k] + sum_{i, r} vision[k, i] / dp_vision x[i, (j, r)] <= z_v``; ``y >=`` each
replica's per-stage sum of bin times ``+ (p - 1) z_r`` and the vision stages' sum ``+ (p - 1) z_v``;
every finite per-stage memory limit (activations and transients, `BatchCosts.llm_mem_bytes`); and no empty bin. Unlike the greedy it uses the exact per-stage
costs rather than the bottleneck-stage scalars.

Determinism: HiGHS runs single-threaded with a fixed seed and stops at a node limit, so the same
input gives the same answer; the wall-clock limit is only a safety net, and a solve stopped by it
is reported as an overrun (the caller then keeps the greedy result).
"""

import time
from dataclasses import dataclass

import highspy
import numpy as np

from dflop.costmodel.types import BatchCosts
from dflop.highs import quiet_highs


@dataclass(frozen=True)
class IlpResult:
    """Outcome of one ILP solve.

    bin_of: [n] bins of the best solution HiGHS holds (the warm start if it found nothing better),
        or None when it failed. objective_s: its bottleneck z (seconds). warm_objective_s: z of the
        warm start. status: "optimal", "node_limit", "overrun" (wall-clock limit hit),
        "infeasible" or "failed: <reason>". solve_s: wall seconds including model build.
        n_vars: binary variables in the model.
    """

    bin_of: np.ndarray | None
    objective_s: float | None
    warm_objective_s: float
    status: str
    solve_s: float
    n_vars: int


def pipeline_estimate(costs: BatchCosts, bin_of: np.ndarray, m: int, dp_llm: int, dp_vision: int) -> float:
    """The ILP's objective for an assignment (seconds): the largest, over LLM replicas and stages,
    of (sum of bin times + (p - 1) * that replica's heaviest bin), and the same for vision."""
    n_bins, p = m * dp_llm, costs.pp_vision + costs.pp_llm
    loads = np.stack([np.bincount(bin_of, weights=costs.llm_fwd[k] + costs.llm_bwd[k], minlength=n_bins)
                      + costs.llm_fwd_const[k] + costs.llm_bwd_const[k] for k in range(costs.pp_llm)])
    per_rep = loads.reshape(costs.pp_llm, m, dp_llm)                 # [Sl, m, dp]
    worst = float((per_rep.sum(axis=1) + (p - 1) * per_rep.max(axis=(0, 1))[None, :]).max())
    if costs.pp_vision:
        vis = np.stack([np.bincount(bin_of // dp_llm, weights=costs.vision_fwd[k] + costs.vision_bwd[k], minlength=m)
                        / dp_vision + costs.vision_fwd_const[k] + costs.vision_bwd_const[k]
                        for k in range(costs.pp_vision)])              # [Sv, m]
        worst = max(worst, float((vis.sum(axis=1) + (p - 1) * vis.max()).max()))
    return worst


def _build(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int) -> highspy.HighsLp:
    """Columns: x[i, b] at i * B + b, then z_r (dp_llm), z_v, y. Rows as in the module docstring."""
    n, n_bins = costs.n_samples, m * dp_llm
    p = costs.pp_vision + costs.pp_llm
    llm = costs.llm_fwd + costs.llm_bwd                      # [Sl, n]
    vis = (costs.vision_fwd + costs.vision_bwd) / dp_vision  # [Sv, n]
    llm_c = costs.llm_fwd_const + costs.llm_bwd_const
    vis_c = costs.vision_fwd_const + costs.vision_bwd_const
    mb_of_bin = np.arange(n_bins) // dp_llm
    rep_of_bin = np.arange(n_bins) % dp_llm
    llm_lim, vis_lim = costs.llm_mem_limit_bytes, costs.vision_mem_limit_bytes
    mem_l = np.flatnonzero(np.isfinite(llm_lim))
    mem_v = np.flatnonzero(np.isfinite(vis_lim))
    n_x = n * n_bins
    c_zr, c_y = n_x, n_x + dp_llm + 1  # z_r: dp_llm columns from c_zr; z_v follows them, then y

    # Row blocks: assign [n] | bin time [Sl, B] | mb vision time [Sv, m] | replica estimate
    # [Sl, dp] | vision estimate [Sv] | LLM memory [.., B] | vision memory [.., m] | bin not
    # empty [B].
    r_bin = n
    r_mbv = r_bin + costs.pp_llm * n_bins
    r_rep = r_mbv + costs.pp_vision * m
    r_vest = r_rep + costs.pp_llm * dp_llm
    r_ml = r_vest + costs.pp_vision
    r_mv = r_ml + len(mem_l) * n_bins
    r_fill = r_mv + len(mem_v) * m
    n_rows = r_fill + n_bins

    bins = np.arange(n_bins)
    shape = (n, n_bins)
    rows = [np.broadcast_to(np.arange(n)[:, None], shape), np.broadcast_to(r_fill + bins, shape)]
    vals = [np.ones(shape), np.ones(shape)]
    for k in range(costs.pp_llm):
        rows += [np.broadcast_to(r_bin + k * n_bins + bins, shape), np.broadcast_to(r_rep + k * dp_llm + rep_of_bin, shape)]
        vals += [np.broadcast_to(llm[k][:, None], shape)] * 2
    for k in range(costs.pp_vision):
        rows.append(np.broadcast_to(r_mbv + k * m + mb_of_bin, shape))
        vals.append(np.broadcast_to(vis[k][:, None], shape))
    for q, k in enumerate(mem_l):
        rows.append(np.broadcast_to(r_ml + q * n_bins + bins, shape))
        vals.append(np.broadcast_to(costs.llm_mem_bytes[k][:, None], shape))
    for q, k in enumerate(mem_v):
        rows.append(np.broadcast_to(r_mv + q * m + mb_of_bin, shape))
        vals.append(np.broadcast_to((costs.vision_mem_bytes[k] / dp_vision)[:, None], shape))
    rows_x = np.stack(rows, axis=2)   # [n, B, K]: column i*B + b lists its rows
    vals_x = np.stack(vals, axis=2)
    keep = vals_x != 0
    counts = [keep.reshape(n_x, -1).sum(axis=1)]
    index = [rows_x[keep]]
    value = [vals_x[keep]]
    for r in range(dp_llm):  # z_r: -1 in its bins' time rows, (p - 1) in its estimate rows
        zr_rows = np.r_[(r_bin + np.arange(costs.pp_llm)[:, None] * n_bins + bins[rep_of_bin == r][None, :]).ravel(),
                        r_rep + np.arange(costs.pp_llm) * dp_llm + r]
        counts.append([len(zr_rows)])
        index.append(zr_rows)
        value.append(np.r_[-np.ones(costs.pp_llm * m), np.full(costs.pp_llm, p - 1.0)])
    zv_rows = np.r_[np.arange(r_mbv, r_rep), np.arange(r_vest, r_ml)]
    counts.append([len(zv_rows)])
    index.append(zv_rows)
    value.append(np.r_[-np.ones(costs.pp_vision * m), np.full(costs.pp_vision, p - 1.0)])
    y_rows = np.arange(r_rep, r_ml)
    counts.append([len(y_rows)])
    index.append(y_rows)
    value.append(-np.ones(len(y_rows)))
    counts = np.concatenate(counts)

    lp = highspy.HighsLp()
    lp.num_col_ = n_x + dp_llm + 2
    lp.num_row_ = n_rows
    cost = np.zeros(lp.num_col_)
    cost[c_y] = 1.0
    cost[c_zr:c_y] = 1e-3 / (dp_llm + 1)  # among equal estimates, prefer lower maxima
    lp.col_cost_ = cost
    lp.col_lower_ = np.zeros(lp.num_col_)
    upper = np.ones(lp.num_col_)
    upper[n_x:] = highspy.kHighsInf
    lp.col_upper_ = upper
    row_lower = np.full(n_rows, -highspy.kHighsInf)
    row_upper = np.empty(n_rows)
    row_lower[:n] = 1.0
    row_upper[:n] = 1.0
    row_upper[r_bin:r_mbv] = -np.repeat(llm_c, n_bins)
    row_upper[r_mbv:r_rep] = -np.repeat(vis_c, m)
    row_upper[r_rep:r_vest] = -np.repeat(m * llm_c, dp_llm)
    row_upper[r_vest:r_ml] = -(vis.sum(axis=1) + m * vis_c)
    row_upper[r_ml:r_mv] = np.repeat(llm_lim[mem_l], n_bins)
    row_upper[r_mv:r_fill] = np.repeat(vis_lim[mem_v], m)
    row_lower[r_fill:] = 1.0  # no empty bin: every replica runs every microbatch
    row_upper[r_fill:] = highspy.kHighsInf
    lp.row_lower_ = row_lower
    lp.row_upper_ = row_upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    lp.a_matrix_.index_ = np.concatenate(index).astype(np.int32)
    lp.a_matrix_.value_ = np.concatenate(value).astype(np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n_x + [highspy.HighsVarType.kContinuous] * (dp_llm + 2)
    return lp


def _warm_columns(costs: BatchCosts, bin_of: np.ndarray, m: int, dp_llm: int, dp_vision: int) -> np.ndarray:
    """Column values of an assignment: x one-hot, z_r, z_v and y at their tightest."""
    n, n_bins = costs.n_samples, m * dp_llm
    p = costs.pp_vision + costs.pp_llm
    col = np.zeros(n * n_bins + dp_llm + 2)
    col[np.arange(n) * n_bins + bin_of] = 1.0
    loads = np.stack([np.bincount(bin_of, weights=costs.llm_fwd[k] + costs.llm_bwd[k], minlength=n_bins)
                      + costs.llm_fwd_const[k] + costs.llm_bwd_const[k] for k in range(costs.pp_llm)])
    per_rep = loads.reshape(costs.pp_llm, m, dp_llm)
    z_r = per_rep.max(axis=(0, 1))
    y = float((per_rep.sum(axis=1) + (p - 1) * z_r[None, :]).max())
    z_v = 0.0
    if costs.pp_vision:
        vis = np.stack([np.bincount(bin_of // dp_llm, weights=costs.vision_fwd[k] + costs.vision_bwd[k], minlength=m)
                        / dp_vision + costs.vision_fwd_const[k] + costs.vision_bwd_const[k]
                        for k in range(costs.pp_vision)])
        z_v = float(vis.max())
        y = max(y, float((vis.sum(axis=1) + (p - 1) * z_v).max()))
    col[n * n_bins: n * n_bins + dp_llm] = z_r
    col[-2] = z_v
    col[-1] = y
    return col


def solve_ilp(costs: BatchCosts, m: int, dp_llm: int, dp_vision: int, warm_bin_of: np.ndarray, *,
              time_limit_s: float, seed: int = 0, max_nodes: int = 200) -> IlpResult:
    """Solve the bin assignment ILP from the warm start `warm_bin_of` ([n] bins).

    Never returns an assignment worse (by the ILP objective) than the warm start.
    """
    t0 = time.perf_counter()
    n, n_bins = costs.n_samples, m * dp_llm
    warm_obj = pipeline_estimate(costs, warm_bin_of, m, dp_llm, dp_vision)
    n_vars = n * n_bins

    def result(bin_of, obj, status):
        return IlpResult(bin_of, obj, warm_obj, status, time.perf_counter() - t0, n_vars)

    try:
        h = quiet_highs()
        h.setOptionValue("threads", 1)
        h.setOptionValue("random_seed", int(seed) % 2147483647)
        h.setOptionValue("mip_max_nodes", int(max_nodes))
        h.setOptionValue("mip_rel_gap", 1e-6)
        h.setOptionValue("time_limit", max(float(time_limit_s) - (time.perf_counter() - t0), 1e-3))
        h.passModel(_build(costs, m, dp_llm, dp_vision))
        sol = highspy.HighsSolution()
        sol.col_value = _warm_columns(costs, warm_bin_of, m, dp_llm, dp_vision).tolist()
        h.setSolution(sol)
        h.run()
        status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kTimeLimit:
            return result(warm_bin_of, warm_obj, "overrun")
        if status == highspy.HighsModelStatus.kInfeasible:
            return result(None, None, "infeasible")
        if h.getInfo().primal_solution_status != 2:  # 2 = feasible
            return result(warm_bin_of, warm_obj, f"failed: no feasible solution ({h.modelStatusToString(status)})")
        x = np.asarray(h.getSolution().col_value[:n_vars]).reshape(n, n_bins)
        bin_of = np.argmax(x, axis=1).astype(np.int64)
        if not np.allclose(x.sum(axis=1), 1.0, atol=1e-6) or (x.max(axis=1) < 0.5).any():
            return result(warm_bin_of, warm_obj, "failed: fractional assignment")
        obj = pipeline_estimate(costs, bin_of, m, dp_llm, dp_vision)
        name = "optimal" if status == highspy.HighsModelStatus.kOptimal else "node_limit"
        if obj > warm_obj:
            return result(warm_bin_of, warm_obj, name)
        return result(bin_of, obj, name)
    except Exception as exc:  # noqa: BLE001 — any solver failure falls back to the warm start
        return result(warm_bin_of, warm_obj, f"failed: {type(exc).__name__}: {exc}")
