"""Pipeline simulator: exact op timelines of 1F1B / GPipe steps with heterogeneous microbatches,
stages and data-parallel replicas, and a Gantt chart of a step."""

from dflop.sim.gantt import plot_gantt
from dflop.sim.pipeline import (SCHEDULES, SimResult, simulate, simulate_dp, simulate_dp_steps, simulate_rows,
                                 stage_op_order)

__all__ = ["SCHEDULES", "SimResult", "plot_gantt", "simulate", "simulate_dp", "simulate_dp_steps",
           "simulate_rows",
           "stage_op_order"]
