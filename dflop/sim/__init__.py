"""Pipeline simulator: exact op timelines of 1F1B / GPipe / interleaved 1F1B / ZB-H1 steps with
heterogeneous microbatches, stages and data-parallel replicas, and a Gantt chart of a step."""

from dflop.sim.pipeline import SimResult, simulate, simulate_dp, simulate_dp_steps, simulate_rows
from dflop.sim.schedules import (SCHEDULES, SPLIT_BACKWARD, first_chunk_peak, interleaved_op_order,
                                 interleaved_warmup, llm_rank_op_order, stage_op_order, vision_op_order,
                                 zb_h1_op_order)

__all__ = ["SCHEDULES", "SPLIT_BACKWARD", "SimResult", "first_chunk_peak", "interleaved_op_order",
           "interleaved_warmup", "llm_rank_op_order", "vision_op_order",
           "plot_gantt", "simulate", "simulate_dp", "simulate_dp_steps", "simulate_rows",
           "stage_op_order", "zb_h1_op_order"]


def __getattr__(name: str):
    """`plot_gantt` on first use: dflop.sim.gantt imports matplotlib (about a CPU-second), which the
    processes that only simulate (the planner, every training rank's scheduler) never draw with."""
    if name == "plot_gantt":
        from dflop.sim.gantt import plot_gantt

        return plot_gantt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
