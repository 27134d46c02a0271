"""The layer split of one layout as a Pyomo MILP solved by HiGHS.

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

Pyomo's ``highs`` interface (pyomo.contrib.solver) takes ``time_limit`` and ``rel_gap`` in
``solve()``; a solve stopped by the time limit keeps its incumbent and reports ``time_limit``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyomo.environ as pyo
from pyomo.contrib.solver.common.factory import SolverFactory
from pyomo.contrib.solver.common.results import TerminationCondition

from dflop.highs import silence_banner
from dflop.planner.stages import StageModel

_STATUS = {
    TerminationCondition.convergenceCriteriaSatisfied: "optimal",
    TerminationCondition.maxTimeLimit: "time_limit",
    TerminationCondition.iterationLimit: "iteration_limit",
    TerminationCondition.provenInfeasible: "infeasible",
    TerminationCondition.locallyInfeasible: "infeasible",
    TerminationCondition.infeasibleOrUnbounded: "infeasible",
}


@dataclass(frozen=True)
class SplitResult:
    """Outcome of one MILP.

    status: "optimal", "time_limit" (incumbent kept), "infeasible" or "error: <what>";
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


def build_model(sm: StageModel) -> pyo.ConcreteModel:
    """The Pyomo model of `sm`'s layer split and per-stage recompute modes (module docstring)."""
    P, M, modes = sm.n_stages, sm.memory_bytes, sm.modes
    c = sm.by_mode
    vision = [s for s in range(P) if sm.is_vision[s]]
    llm = [s for s in range(P) if not sm.is_vision[s]]
    model = pyo.ConcreteModel("layer_split")
    model.S = pyo.RangeSet(0, P - 1)
    model.R = pyo.Set(initialize=list(modes), ordered=True)
    upper = {s: (sm.vision_layers if sm.is_vision[s] else sm.llm_layers) for s in range(P)}
    single = len(modes) == 1
    # n[s, r]: layers stage s runs in mode r; x[s, r] = 1 for the stage's one mode (fixed when only one)
    model.n = pyo.Var(model.S, model.R, domain=pyo.Integers,
                      bounds=lambda _, s, r: (1 if single else 0, upper[s]))
    model.x = pyo.Var(model.S, model.R, domain=pyo.Binary)
    if single:
        for s in range(P):
            model.x[s, modes[0]].fix(1)
    else:
        model.one_mode = pyo.Constraint(model.S, rule=lambda mdl, s: sum(mdl.x[s, r] for r in modes) == 1)
        model.mode_on = pyo.Constraint(model.S, model.R, rule=lambda mdl, s, r: mdl.n[s, r] <= upper[s] * mdl.x[s, r])
        model.mode_min = pyo.Constraint(model.S, model.R, rule=lambda mdl, s, r: mdl.n[s, r] >= mdl.x[s, r])
    model.T = pyo.Var(domain=pyo.NonNegativeReals)
    model.A = pyo.Var(domain=pyo.NonNegativeReals)

    def linear(fixed: str, layer: str, s: int):
        return sum(float(getattr(c[r], fixed)[s]) * model.x[s, r] + float(getattr(c[r], layer)[s]) * model.n[s, r]
                   for r in modes)

    layers = {s: sum(model.n[s, r] for r in modes) for s in range(P)}
    time_s = {s: linear("time_fixed", "time_layer", s) for s in range(P)}
    bwd_s = {s: linear("bwd_fixed", "bwd_layer", s) for s in range(P)}
    if vision:
        model.vision_layers = pyo.Constraint(expr=sum(layers[s] for s in vision) == sm.vision_layers)
    model.llm_layers = pyo.Constraint(expr=sum(layers[s] for s in llm) == sm.llm_layers)
    model.bottleneck = pyo.Constraint(model.S, rule=lambda mdl, s: mdl.T >= time_s[s])
    model.mem_mean = pyo.Constraint(
        model.S, rule=lambda mdl, s: linear("mem_mean_fixed", "mem_mean_layer", s) / M <= 1.0)
    model.mem_heaviest = pyo.Constraint(
        model.S, rule=lambda mdl, s: linear("mem_max_fixed", "mem_max_layer", s) / M <= 1.0)

    def tail(mdl, s):
        ahead = sum(bwd_s[q] for q in range(s)) if s else 0.0
        return mdl.A >= float(sm.ar_fixed[s]) + float(sm.ar_layer[s]) * layers[s] - ahead

    model.tail = pyo.Constraint(model.S, rule=tail)
    const = 2 * (P - 1) * sm.latency_s
    model.step = pyo.Objective(expr=(sm.layout.m - 1) * model.T + sum(time_s.values()) + model.A + const,
                               sense=pyo.minimize)
    return model


def solve_split(sm: StageModel, *, time_limit_s: float = 10.0, rel_gap: float = 0.01) -> SplitResult:
    """Solve the layer split (and recompute modes) of `sm` on HiGHS (single thread, no output)."""
    t0 = time.perf_counter()
    model = build_model(sm)
    silence_banner()
    solver = SolverFactory("highs")
    try:
        res = solver.solve(model, time_limit=float(time_limit_s), rel_gap=float(rel_gap), load_solutions=False,
                           raise_exception_on_nonoptimal_result=False, solver_options={"threads": 1})
    except Exception as exc:  # a solver failure must not kill the search: report it on this layout
        return SplitResult(f"error: {type(exc).__name__}: {exc}".splitlines()[0], None, None, None,
                           time.perf_counter() - t0)
    status = _STATUS.get(res.termination_condition, str(res.termination_condition.name))
    split = objective = modes = None
    if res.incumbent_objective is not None and status not in ("infeasible",):
        res.solution_loader.load_vars()
        modes = tuple(max(sm.modes, key=lambda r: pyo.value(model.x[s, r])) for s in range(sm.n_stages))
        split = np.array([int(round(sum(pyo.value(model.n[s, r]) for r in sm.modes))) for s in range(sm.n_stages)])
        objective = sm.objective_s(split, modes)
    bound = res.objective_bound if res.objective_bound is not None and np.isfinite(res.objective_bound) else None
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
    bwd_fixed = np.max([c.bwd_fixed for c in sm.by_mode.values()], axis=0) * np.ones(P)
    bwd_layer = np.max([c.bwd_layer for c in sm.by_mode.values()], axis=0) * np.ones(P)
    ar_fixed, ar_layer = np.asarray(sm.ar_fixed, float) * np.ones(P), np.asarray(sm.ar_layer, float) * np.ones(P)
    vis = [bool(v) for v in sm.is_vision]
    total = {True: float(sm.vision_layers), False: float(sm.llm_layers)}
    later = [sum(1 for q in range(s + 1, P) if vis[q] == vis[s]) for s in range(P)]

    def feasible(a: float) -> bool:
        left, ahead = dict(total), 0.0
        for s in range(P):
            room = left[vis[s]] - later[s]  # the most this stage may take
            if ar_layer[s] > 0:
                cap = (a - ar_fixed[s] + ahead) / ar_layer[s]
            else:
                cap = np.inf if ar_fixed[s] - ahead <= a else -np.inf
            n = room if later[s] == 0 else min(cap, room)
            if n < 1 or cap < n:
                return False
            left[vis[s]] -= n
            ahead += bwd_fixed[s] + bwd_layer[s] * n
        return True

    if feasible(0.0):
        return 0.0
    lo, hi = 0.0, float(np.max(ar_fixed + ar_layer * np.array([total[v] for v in vis])))
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
    k = np.array([[np.broadcast_to(getattr(c, f), (P,)) for f in names] for c in sm.by_mode.values()],
                 dtype=np.float64)[..., None]  # [modes, coefficient, P, 1]
    t = k[:, 0] + k[:, 1] * n
    mem = np.maximum(k[:, 2] + k[:, 3] * n, k[:, 4] + k[:, 5] * n)
    out = np.where(mem <= sm.memory_bytes * (1 + 1e-9), t, np.inf).min(axis=0)
    module = np.where(sm.is_vision, sm.vision_layers, sm.llm_layers)[:, None]
    return np.where(n[None, :] <= module, out, np.inf)


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


def _min_sum(f: np.ndarray, total: int) -> float:
    """min over n (>= 1 each, summing to `total`) of sum_s f[s, n_s - 1] (min-plus convolution)."""
    g = f[0, :total]  # g[j]: least sum of the stages so far holding j + 1 layers
    n = len(g)
    for row in f[1:]:
        # z[i, j] = g[i] + row[j] holds i + j + 2 layers; shifting row i right by i (a flat view of
        # an [n, 2n] array as [n, 2n - 1]) puts equal totals in one column: out[c] holds c + 2 layers
        z = np.full((n, 2 * n), np.inf)
        z[:, :n] = np.add.outer(g, row[:n])
        out = z.ravel()[:n * (2 * n - 1)].reshape(n, 2 * n - 1).min(axis=0)
        g = np.r_[np.inf, out[:n - 1]]  # g[j] = out[j - 1]: j + 1 layers
    return float(g[total - 1])


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
