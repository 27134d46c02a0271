"""The layer split of one layout as a MILP solved by HiGHS (highspy, no modelling layer).

Given a layout (placement, degrees, m) the only choice left is how many layers each stage runs.
Variables: integer ``n_s >= 1`` per stage, continuous bottleneck ``T`` and all-reduce tail ``A``
(seconds). With several recompute modes, each stage also picks one (binary ``x_sr``; ``n_s`` is
split into ``n_sr <= L x_sr``, so every cost stays linear: a mode changes a stage's per-layer
seconds and activation bytes, and for a colocated stage 0 the vision tower's fixed terms). Constraints: the layers of each module add up to its layer count; ``T >= t_s(n_s)`` on
every stage; ``A >= ar_s(n_s) - sum_{s' < s} b_s'(n_s')`` (a stage's all-reduce overlaps the
backwards still running upstream); per-stage memory for the mean microbatch and for the one holding
the heaviest sample, each ``static + in_flight * activations <= GPU memory`` (rows scaled to GPU
memory = 1 for numerical sanity). Objective: ``(m - 1) T + sum_s t_s + A`` plus constant latency,
the mean-shape 1F1B step of `dflop.planner.stages`. Every other choice is fixed by the layout, so no
binary variables are needed beyond the modes.

HiGHS runs single-threaded with ``time_limit`` and ``mip_rel_gap``; a solve stopped by the time
limit keeps its incumbent and reports ``time_limit``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import highspy
import numpy as np

from dflop.highs import quiet_highs
from dflop.planner.stages import StageModel

_S = highspy.HighsModelStatus
_STATUS = {
    _S.kOptimal: "optimal",
    _S.kTimeLimit: "time_limit",
    _S.kIterationLimit: "iteration_limit",
    _S.kInfeasible: "infeasible",
    _S.kUnboundedOrInfeasible: "infeasible",
}


@dataclass(frozen=True)
class SplitResult:
    """Outcome of one MILP.

    status: "optimal", "time_limit" (incumbent kept), "infeasible", "cutoff" (no split at or below the
    cutoff asked for; bound_s is that cutoff) or "error: <what>";
    split: [P] layers per stage, or None without a solution; modes: [P] recompute mode per stage
    (None without a solution); objective_s: the mean-shape step of the split
    (`StageModel.objective_s`); bound_s: HiGHS's lower bound on it; solve_s: wall seconds of
    build + solve.
    """

    status: str
    split: np.ndarray | None
    objective_s: float | None
    bound_s: float | None
    solve_s: float
    modes: tuple | None = None

    @property
    def has_solution(self) -> bool:
        return self.split is not None


def build_model(sm: StageModel) -> tuple[highspy.Highs, dict]:
    """The HiGHS model of `sm`'s layer split and per-stage recompute modes (module docstring), and
    its columns by variable: ("n", s, r), ("x", s, r), ("T",), ("A",).

    Built directly as columns and rows, without a modelling layer (Pyomo's expression trees, its
    solver interface and its import), and laid out as Pyomo laid out the same model before:
    columns in order of first appearance, each row ``body <= / == rhs`` with its terms in the order
    written, a fixed ``x`` (one mode) kept as a fixed column with its terms moved into the bounds.
    Branch and bound stops at ``mip_rel_gap``, so which split within the gap it returns depends on
    that layout; keeping it kept every plan of the paper's searches as it was.
    """
    P, modes, M = sm.n_stages, sm.modes, float(sm.memory_bytes)
    single = len(modes) == 1
    c = sm.by_mode
    upper = [float(sm.vision_layers if sm.is_vision[s] else sm.llm_layers) for s in range(P)]
    inf = highspy.kHighsInf
    cols: dict = {}          # variable key -> column
    col_lo: list = []
    col_hi: list = []
    col_int: list = []
    lower, upper_b, starts, index, value = [], [], [], [], []

    def column(key) -> int:
        if key not in cols:
            cols[key] = len(cols)
            kind = key[0]
            if kind == "n":
                lo, hi, integral = (1.0 if single else 0.0), upper[key[1]], True
            elif kind == "x":
                lo, hi, integral = (1.0 if single else 0.0), 1.0, True
            else:
                lo, hi, integral = 0.0, inf, False
            col_lo.append(lo)
            col_hi.append(hi)
            col_int.append(integral)
        return cols[key]

    def collect(terms, const: float = 0.0) -> tuple[dict, float]:
        """{column: coefficient} and the constant of a linear expression (fixed x = 1 folded in,
        summed in the order written, after `const`)."""
        linear = {}
        for key, coef in terms:
            j = column(key)
            if single and key[0] == "x":
                const += coef * 1.0
            else:
                linear[j] = linear.get(j, 0.0) + coef
        return linear, const

    def row(terms, lo: float, hi: float) -> None:
        linear, const = collect(terms)
        starts.append(len(index))
        index.extend(linear)
        value.extend(linear.values())
        lower.append(lo - const if lo > -inf else -inf)
        upper_b.append(hi - const if hi < inf else inf)

    def coef(r: str, name: str, s: int) -> float:
        return float(getattr(c[r], name)[s])

    def linear(fixed: str, layer: str, s: int, scale: float = 1.0) -> list:
        return [t for r in modes for t in ((("x", s, r), scale * coef(r, fixed, s)),
                                           (("n", s, r), scale * coef(r, layer, s)))]

    if not single:
        for s in range(P):                                                   # one mode per stage
            row([(("x", s, r), 1.0) for r in modes], 1.0, 1.0)
        for s in range(P):                                                   # n <= L x
            for r in modes:
                row([(("n", s, r), 1.0), (("x", s, r), -upper[s])], -inf, 0.0)
        for s in range(P):                                                   # x <= n
            for r in modes:
                row([(("x", s, r), 1.0), (("n", s, r), -1.0)], -inf, 0.0)
    for is_vision, total in ((True, sm.vision_layers), (False, sm.llm_layers)):
        stages = [s for s in range(P) if bool(sm.is_vision[s]) == is_vision]
        if stages:
            row([(("n", s, r), 1.0) for s in stages for r in modes], float(total), float(total))
    for s in range(P):                                                       # t_s - T <= 0
        row(linear("time_fixed", "time_layer", s) + [(("T",), -1.0)], -inf, 0.0)
    for fixed, layer in (("mem_mean_fixed", "mem_mean_layer"), ("mem_max_fixed", "mem_max_layer")):
        for s in range(P):                                                   # memory / M <= 1
            row(linear(fixed, layer, s, 1.0 / M), -inf, 1.0)
    for s in range(P):                          # ar_s(n_s) - sum_{q<s} b_q(n_q) - A <= 0
        ahead = [t for q in range(s) for t in linear("bwd_fixed", "bwd_layer", q)]
        _, ahead_const = collect(ahead)  # the upstream backwards' constant, summed on its own
        terms = [(("n", s, r), float(sm.ar_layer[s])) for r in modes] + [(k, -v) for k, v in ahead] + [(("A",), -1.0)]
        linear_s, _ = collect(terms)
        const = float(sm.ar_fixed[s]) - ahead_const
        starts.append(len(index))
        index.extend(linear_s)
        value.extend(linear_s.values())
        lower.append(-inf)
        upper_b.append(0.0 - const)
    objective = [(("T",), float(sm.layout.m - 1))] + \
        [t for s in range(P) for t in linear("time_fixed", "time_layer", s)] + [(("A",), 1.0)]
    cost_of, offset = collect(objective)
    offset += 2 * (P - 1) * sm.latency_s
    n_cols = len(cols)
    cost = np.zeros(n_cols)
    for j, v in cost_of.items():
        cost[j] = v
    h = quiet_highs()
    h.addVars(n_cols, np.array(col_lo), np.array(col_hi))
    h.changeColsCost(n_cols, np.arange(n_cols, dtype=np.int32), cost)
    h.changeObjectiveOffset(float(offset))
    integer = np.flatnonzero(col_int).astype(np.int32)
    h.changeColsIntegrality(len(integer), integer, np.full(len(integer), highspy.HighsVarType.kInteger))
    h.addRows(len(lower), np.array(lower), np.array(upper_b), len(index), np.array(starts, dtype=np.int32),
              np.array(index, dtype=np.int32), np.array(value, dtype=np.float64))
    return h, cols


def solve_split(sm: StageModel, *, time_limit_s: float = 10.0, rel_gap: float = 0.01,
                cutoff_s: float | None = None) -> SplitResult:
    """Solve the layer split (and recompute modes) of `sm` on HiGHS (single thread, no output).

    cutoff_s: first ask whether any split has an objective <= cutoff_s (the model plus that row);
    when none does, return status "cutoff" (no split; bound_s = cutoff_s, the optimum is above it)
    at the price of that proof, usually a fraction of the solve. Otherwise the model is solved
    without the row, so the split returned is the one the plain solve finds (HiGHS's options have
    no MIP cutoff: ``objective_bound`` only ends the dual simplex early). The proof and the solve
    share `time_limit_s`: the solve gets what the proof left, and when that is too little for it
    to find a split, the split the proof found (at or below the cutoff) is returned instead.

    "Infeasible with the row" is also what a model no split fits says, so it is "cutoff" only when
    `some_split_fits` (numpy, no solve); else the plain solve reports it. The search never pays that
    solve: it cuts only layouts with a finite `objective_bound_s`, i.e. a fitting split."""
    t0 = time.perf_counter()
    proof = None  # the cutoff proof's result when it found a split at or below the cutoff
    if cutoff_s is not None:
        try:
            h, cols = build_model(sm)
            lp = h.getLp()
            cost = np.asarray(lp.col_cost_)
            nz = np.flatnonzero(cost).astype(np.int32)
            h.addRow(-highspy.kHighsInf, float(cutoff_s) - float(lp.offset_), len(nz), nz, cost[nz])
            for key, value in (("threads", 1), ("time_limit", float(time_limit_s)), ("mip_rel_gap", float(rel_gap))):
                h.setOptionValue(key, value)
            h.run()
            if _STATUS.get(h.getModelStatus()) == "infeasible" and some_split_fits(sm):
                return SplitResult("cutoff", None, None, float(cutoff_s), time.perf_counter() - t0)
            proof = _read_result(h, cols, sm, t0)
        except Exception:  # noqa: BLE001 (the plain solve below reports whatever goes wrong)
            pass
    res = _solve(sm, max(0.0, time_limit_s - (time.perf_counter() - t0)), rel_gap)
    if res.status == "time_limit" and res.split is None and proof is not None and proof.split is not None:
        # the proof used up the time, and found a split at or below the cutoff: keep that one
        # (its dual bound holds for the whole model, whose optimum also lies below the cutoff)
        res = replace(proof, status="time_limit")
    return replace(res, solve_s=time.perf_counter() - t0)


def _solve(sm: StageModel, time_limit_s: float, rel_gap: float) -> SplitResult:
    t0 = time.perf_counter()
    try:
        h, cols = build_model(sm)
        for key, value in (("threads", 1), ("time_limit", float(time_limit_s)), ("mip_rel_gap", float(rel_gap))):
            h.setOptionValue(key, value)
        h.run()
        return _read_result(h, cols, sm, t0)
    except Exception as exc:  # a solver failure must not kill the search: report it on this layout
        return SplitResult(f"error: {type(exc).__name__}: {exc}".splitlines()[0], None, None, None,
                           time.perf_counter() - t0)


def _read_result(h, cols: dict, sm: StageModel, t0: float) -> SplitResult:
    """The status, split, modes and dual bound of a solved `build_model` model (with rows added or not)."""
    P, R = sm.n_stages, len(sm.modes)
    model_status, info = h.getModelStatus(), h.getInfo()
    status = _STATUS.get(model_status, str(model_status.name))
    split = objective = modes = None
    if info.primal_solution_status == 2 and status != "infeasible":
        col = np.asarray(h.getSolution().col_value)
        n = np.array([[col[cols["n", s, r]] for r in sm.modes] for s in range(P)])
        if R == 1:
            modes = (sm.modes[0],) * P
        else:
            x = np.array([[col[cols["x", s, r]] for r in sm.modes] for s in range(P)])
            modes = tuple(sm.modes[int(np.argmax(x[s]))] for s in range(P))
        split = np.rint(n.sum(axis=1)).astype(int)
        objective = sm.objective_s(split, modes)
    bound = float(info.mip_dual_bound) if info.mip_node_count != -1 else None
    bound = bound if bound is not None and np.isfinite(bound) else None
    return SplitResult(status, split, objective, bound, time.perf_counter() - t0, modes)


def tail_bound_s(sm: StageModel, iters: int = 60) -> float:
    """Lower bound of the all-reduce tail ``A`` over every split and choice of modes (memory ignored).

    ``A >= ar_s(n_s) - sum_{q<s} b_q(n_q)`` for each stage; a stage's backward is at most its slowest
    mode's, so with those the least feasible ``A`` of the continuous relaxation (``n_s >= 1`` real,
    each module's layers summing to its count) bounds the MILP's from below. For a given ``A`` a
    split exists iff the greedy one does: in pipeline order each stage takes as many layers as ``A``
    allows while leaving one per later stage of its module (more layers upstream only add overlap
    downstream). Feasibility is monotone in ``A``: bisection, returning an infeasible end (so < the
    least ``A``)."""
    P = sm.n_stages
    # Python floats: the bisection calls `feasible` ~30 times per layout and numpy scalars' arithmetic
    # is several times slower than floats' (the same IEEE operations, so the same result)
    bwd_fixed = (np.max([c.bwd_fixed for c in sm.by_mode.values()], axis=0) * np.ones(P)).tolist()
    bwd_layer = (np.max([c.bwd_layer for c in sm.by_mode.values()], axis=0) * np.ones(P)).tolist()
    ar_fixed = (np.asarray(sm.ar_fixed, float) * np.ones(P)).tolist()
    ar_layer = (np.asarray(sm.ar_layer, float) * np.ones(P)).tolist()
    vis = [bool(v) for v in sm.is_vision]
    total = {True: float(sm.vision_layers), False: float(sm.llm_layers)}
    later = [sum(1 for q in range(s + 1, P) if vis[q] == vis[s]) for s in range(P)]
    inf = float("inf")

    def feasible(a: float) -> bool:
        left, ahead = dict(total), 0.0
        for s in range(P):
            room = left[vis[s]] - later[s]  # the most this stage may take
            if ar_layer[s] > 0:
                cap = (a - ar_fixed[s] + ahead) / ar_layer[s]
            else:
                cap = inf if ar_fixed[s] - ahead <= a else -inf
            n = room if later[s] == 0 else min(cap, room)
            if n < 1 or cap < n:
                return False
            left[vis[s]] -= n
            ahead += bwd_fixed[s] + bwd_layer[s] * n
        return True

    if feasible(0.0):
        return 0.0
    lo, hi = 0.0, float(np.max(np.array(ar_fixed) + np.array(ar_layer) * np.array([total[v] for v in vis])))
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if feasible(mid):
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-7 * hi:
            break
    return lo


def stage_times_by_layers(sm: StageModel) -> np.ndarray:
    """[P, L] seconds per microbatch of stage s holding n = 1..L layers in its fastest mode that fits
    in memory at n (inf where none fits or n exceeds its module's layers). Non-decreasing in n: a
    mode's seconds and bytes grow with n, so the fitting modes only thin out."""
    P = sm.n_stages
    L = max(sm.vision_layers if sm.is_vision.any() else 0, sm.llm_layers)
    n = np.arange(1, L + 1, dtype=np.float64)
    names = ("time_fixed", "time_layer", "mem_mean_fixed", "mem_mean_layer", "mem_max_fixed", "mem_max_layer")
    coeffs = list(sm.by_mode.values())
    k = np.empty((len(coeffs), len(names), P, 1))  # [modes, coefficient, P, 1]
    for i, c in enumerate(coeffs):
        for j, f in enumerate(names):  # assignment broadcasts a scalar field (np.broadcast_to per field cost more)
            k[i, j, :, 0] = getattr(c, f)
    t = k[:, 0] + k[:, 1] * n
    mem = np.maximum(k[:, 2] + k[:, 3] * n, k[:, 4] + k[:, 5] * n)
    out = np.where(mem <= sm.memory_bytes * (1 + 1e-9), t, np.inf).min(axis=0)
    module = np.where(sm.is_vision, sm.vision_layers, sm.llm_layers)[:, None]
    return np.where(n[None, :] <= module, out, np.inf)


def some_split_fits(sm: StageModel) -> bool:
    """Whether some split and choice of modes fits in memory (the MILP is feasible): a stage that
    fits n layers fits fewer (`stage_times_by_layers`), so each module's stages must fit one layer
    each and together all of its layers. At the memory test's 1e-9 tolerance, below HiGHS's: True
    means HiGHS's model is feasible too."""
    f = np.isfinite(stage_times_by_layers(sm))
    return all(f[sm.is_vision == v, 0].all() and f[sm.is_vision == v].sum() >= layers
               for v, layers in ((True, sm.vision_layers), (False, sm.llm_layers)) if (sm.is_vision == v).any())


def _min_max(f: np.ndarray, total: int) -> float:
    """min over n (>= 1 each, summing to `total`) of max_s f[s, n_s - 1], f non-decreasing per row:
    the least threshold under which the stages can hold `total` layers together."""
    values = np.unique(f[np.isfinite(f)])
    values = values[values >= f[:, 0].max()]
    if not len(values):
        return float("inf")
    held = sum(np.searchsorted(row, values, side="right") for row in f)
    ok = np.flatnonzero(held >= total)
    return float(values[ok[0]]) if len(ok) else float("inf")


def _min_sums(f: np.ndarray, total: int) -> np.ndarray:
    """[total] g[j]: min over n (>= 1 each, summing to j + 1) of sum_s f[s, n_s - 1] (min-plus convolution)."""
    g = f[0, :total]  # g[j]: least sum of the stages so far holding j + 1 layers
    n = len(g)
    for row in f[1:]:
        # z[i, j] = g[i] + row[j] holds i + j + 2 layers; shifting row i right by i (a flat view of
        # an [n, 2n] array as [n, 2n - 1]) puts equal totals in one column: out[c] holds c + 2 layers
        z = np.full((n, 2 * n), np.inf)
        z[:, :n] = np.add.outer(g, row[:n])
        out = z.ravel()[:n * (2 * n - 1)].reshape(n, 2 * n - 1).min(axis=0)
        g = np.concatenate(((np.inf,), out[:n - 1]))  # g[j] = out[j - 1]: j + 1 layers (np.r_'s parsing cost more)
    return g


def _min_sum(f: np.ndarray, total: int) -> float:
    """min over n (>= 1 each, summing to `total`) of sum_s f[s, n_s - 1]: the stages before the last
    by `_min_sums`, then only the one column of the last convolution that holds `total` layers."""
    if len(f) == 1:
        return float(f[0, total - 1])
    if total < len(f):
        return float("inf")
    g = _min_sums(f[:-1], total)
    return float(np.min(g[:total - 1] + f[-1, :total - 1][::-1]))  # g[i]: i + 1 layers, the last the rest


def objective_bound_s(sm: StageModel) -> float:
    """Lower bound of `sm`'s MILP optimum: of `StageModel.objective_s` over every split and choice of
    recompute modes that fits in memory.

    Each stage at n layers costs at least its fastest fitting mode (`stage_times_by_layers`); the
    bottleneck's least value and the stage sum's least value are minimised apart, per module (exact
    for each: a threshold search, a min-plus convolution), and so is the all-reduce tail
    (`tail_bound_s`); a sum of separate minima is <= the minimum of the sum."""
    f = stage_times_by_layers(sm)
    worst, total = 0.0, 0.0
    for is_vision, layers in ((True, sm.vision_layers), (False, sm.llm_layers)):
        rows = f[sm.is_vision == is_vision]
        if not len(rows):
            continue
        worst = max(worst, _min_max(rows, layers))
        total += _min_sum(rows, layers)
    if not np.isfinite(worst + total):
        return float("inf")
    return float((sm.layout.m - 1) * worst + total + tail_bound_s(sm) + 2 * (sm.n_stages - 1) * sm.latency_s)
