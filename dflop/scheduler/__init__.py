"""Online microbatch scheduler: split each global batch into m microbatches x dp_llm bins
(a registry of members: 2-D greedy + local search, fluid-profile LP, simulated-step search, an
opt-in 1F1B-aware ILP; ordering by simulation), a certified lower bound, baselines, a background prefetching service, and adaptive
correction of the cost model."""

from dflop.scheduler.bench import bench_scheduler
from dflop.scheduler.correction import AdaptiveCorrection, CorrectionDecision, MeasuredTimes, ShapeBuckets
from dflop.scheduler.costs import AnalyticCostModel, StageLayout, batch_costs_from_shapes
from dflop.scheduler.evaluate import StageTimes, lower_bound, stage_times
from dflop.scheduler.greedy import MemoryGuardError
from dflop.scheduler.partition import POLICIES, Partition, greedy_partition, partition
from dflop.scheduler.portfolio import PortfolioSettings
from dflop.scheduler.profile import fluid_lower_bound
from dflop.scheduler.service import SchedulerService
from dflop.scheduler.synthetic import llava_ov_mix

__all__ = ["POLICIES", "AdaptiveCorrection", "AnalyticCostModel", "CorrectionDecision", "MeasuredTimes",
           "MemoryGuardError", "Partition", "PortfolioSettings", "SchedulerService", "ShapeBuckets", "StageLayout",
           "StageTimes", "batch_costs_from_shapes", "bench_scheduler", "fluid_lower_bound", "greedy_partition", "llava_ov_mix",
           "lower_bound", "partition", "stage_times"]
