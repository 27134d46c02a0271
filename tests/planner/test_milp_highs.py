"""The layer-split MILP built directly in highspy (`milp.build_model`) against the Pyomo model it
replaced, array by array.

Branch and bound stops within ``mip_rel_gap``, so which split within the gap HiGHS returns depends
on the exact model it is given: the direct model keeps Pyomo's layout (column order, row order and
orientation, constants folded in Pyomo's order) so that the searches choose what they chose with
Pyomo. A row written the other way round, a column moved, or a constant summed in another order
fails here; that the model's optimum is right is held to brute force in test_milp.py and
test_technique_choice.py.

Bit for bit on Python <= 3.11 only: Python 3.12's ``sum()`` of floats is compensated (Neumaier),
and Pyomo folds some constants with it, so there the Pyomo model's folded constants (the tail rows'
bounds, the objective's offset) move by 1-16 ulps while the direct model, which adds in the order
written on every Python, keeps the 3.11 values. On 3.12+ the floats are compared within 1e-14
(relative and absolute): a row turned round or a column moved still fails, the summation order no
longer can.
"""

import itertools
import sys

import numpy as np
import pytest

from dflop.planner.milp import build_model
from planner_testlib import random_stage_model

pyo = pytest.importorskip("pyomo.environ")


def pyomo_model(sm):
    """The Pyomo formulation the planner solved until 2026-11-25 (dflop/planner/milp.py at 8bf09a2)."""
    P, M, modes = sm.n_stages, sm.memory_bytes, sm.modes
    c = sm.by_mode
    vision = [s for s in range(P) if sm.is_vision[s]]
    llm = [s for s in range(P) if not sm.is_vision[s]]
    model = pyo.ConcreteModel("layer_split")
    model.S = pyo.RangeSet(0, P - 1)
    model.R = pyo.Set(initialize=list(modes), ordered=True)
    upper = {s: (sm.vision_layers if sm.is_vision[s] else sm.llm_layers) for s in range(P)}
    single = len(modes) == 1
    model.n = pyo.Var(model.S, model.R, domain=pyo.Integers, bounds=lambda _, s, r: (1 if single else 0, upper[s]))
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

    def linear(fixed, layer, s):
        return sum(float(getattr(c[r], fixed)[s]) * model.x[s, r] + float(getattr(c[r], layer)[s]) * model.n[s, r]
                   for r in modes)

    layers = {s: sum(model.n[s, r] for r in modes) for s in range(P)}
    time_s = {s: linear("time_fixed", "time_layer", s) for s in range(P)}
    bwd_s = {s: linear("bwd_fixed", "bwd_layer", s) for s in range(P)}
    if vision:
        model.vision_layers = pyo.Constraint(expr=sum(layers[s] for s in vision) == sm.vision_layers)
    model.llm_layers = pyo.Constraint(expr=sum(layers[s] for s in llm) == sm.llm_layers)
    model.bottleneck = pyo.Constraint(model.S, rule=lambda mdl, s: mdl.T >= time_s[s])
    model.mem_mean = pyo.Constraint(model.S, rule=lambda mdl, s: linear("mem_mean_fixed", "mem_mean_layer", s) / M <= 1.0)
    model.mem_heaviest = pyo.Constraint(model.S, rule=lambda mdl, s: linear("mem_max_fixed", "mem_max_layer", s) / M <= 1.0)

    def tail(mdl, s):
        ahead = sum(bwd_s[q] for q in range(s)) if s else 0.0
        return mdl.A >= float(sm.ar_fixed[s]) + float(sm.ar_layer[s]) * layers[s] - ahead

    model.tail = pyo.Constraint(model.S, rule=tail)
    model.step = pyo.Objective(expr=(sm.layout.m - 1) * model.T + sum(time_s.values()) + model.A
                               + 2 * (P - 1) * sm.latency_s, sense=pyo.minimize)
    return model


def lp_arrays(lp) -> dict:
    a = lp.a_matrix_
    return {"cost": lp.col_cost_, "col_lower": lp.col_lower_, "col_upper": lp.col_upper_, "row_lower": lp.row_lower_,
            "row_upper": lp.row_upper_, "start": a.start_, "index": a.index_, "value": a.value_,
            "integrality": [int(v) for v in lp.integrality_], "offset": [lp.offset_]}


def pyomo_lp(sm):
    """The HiGHS LP Pyomo's highs interface passes for `pyomo_model(sm)` (its persistent model).

    It reads Pyomo's private ``_active_config`` / ``_solver_model`` (pyproject leaves pyomo
    unpinned): a Pyomo without them skips this test, naming why, instead of erroring."""
    model = pyomo_model(sm)
    try:
        from pyomo.contrib.solver.common.factory import SolverFactory

        solver = SolverFactory("highs")
        solver._active_config = solver.config  # what solve() sets before set_instance
        solver.set_instance(model)
        highs = solver._solver_model
    except (ImportError, AttributeError) as exc:
        from pyomo.version import version

        pytest.skip(f"Pyomo {version}'s highs interface lacks the internals this comparison reads: {exc}")
    return highs.getLp()


# Python's sum() of floats is a plain left fold up to 3.11 (module docstring)
FOLD_TOLERANCE = 0.0 if sys.version_info < (3, 12) else 1e-14


def assert_same_array(got, want, key: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype.kind == "f" or want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=FOLD_TOLERANCE, atol=FOLD_TOLERANCE, err_msg=key)
    else:
        assert np.array_equal(got, want), key


CASES = list(itertools.product((0, 1, 3), (1, 2, 4), (("none",), ("none", "full"), ("none", "selective", "full"))))


@pytest.mark.parametrize("pp_v,pp_l,modes", CASES)
def test_direct_model_is_pyomos_model(pp_v, pp_l, modes):
    for seed in range(2):
        sm = random_stage_model(np.random.default_rng(seed), pp_v=pp_v, pp_l=pp_l, vision_layers=5, llm_layers=9,
                                m=8, dp=2 + seed, latency=0.01, modes=modes, memory=0.7)
        want, (h, cols) = lp_arrays(pyomo_lp(sm)), build_model(sm)
        got = lp_arrays(h.getLp())
        for key in want:
            assert_same_array(got[key], want[key], key)
        assert sorted(cols.values()) == list(range(len(got["cost"])))
