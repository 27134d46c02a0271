"""HiGHS prints nothing into a stage's output: each solve site in a fresh process, stdout a pipe."""

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

MILP = """
import numpy as np
from dflop.planner.milp import solve_split
from planner_testlib import random_stage_model
sm = random_stage_model(np.random.default_rng(0), pp_v=0, pp_l=2, vision_layers=3, llm_layers=6, m=4, dp=1)
print(solve_split(sm).status)
"""

ILP = """
import numpy as np
from dflop.costmodel.types import BatchCosts
from dflop.scheduler import baselines
from dflop.scheduler.ilp import solve_ilp
rng = np.random.default_rng(0)
n = 7
vf, lf = rng.uniform(0, 1, (1, n)), rng.uniform(0.1, 1, (2, n))
costs = BatchCosts(vf, 2 * vf, lf, 2 * lf, np.full(1, 0.01), np.full(1, 0.02), np.full(2, 0.01), np.full(2, 0.02),
                   np.ones((2, n)), np.ones((1, n)), np.full(2, np.inf), np.full(1, np.inf))
print(solve_ilp(costs, 2, 2, 1, baselines.megatron(n, 2, 2), time_limit_s=30, max_nodes=100000).status)
"""


@pytest.mark.parametrize("script", [MILP, ILP], ids=["planner_milp", "scheduler_ilp"])
def test_a_solve_prints_only_what_the_caller_prints(script):
    env_path = f"{TESTS.parent}:{TESTS / 'planner'}"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "optimal\n"  # the solver ran to its end, and its banner is nowhere
    assert "HiGHS" not in out.stderr
