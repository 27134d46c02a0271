"""Data-aware 3D parallelism optimizer (docs/design.md): search layouts, split layers by MILP, rank plans
by simulating sampled global batches through the online scheduler, write plan.yaml.

Entry points: `optimize` (rule optimize / `dflop optimize`) and `simulate_plan` (`dflop simulate`).
"""

from dflop.planner.optimize import optimize
from dflop.planner.whatif import simulate_plan

__all__ = ["optimize", "simulate_plan"]
