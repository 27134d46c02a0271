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
