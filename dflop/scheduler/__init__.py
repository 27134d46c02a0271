"""Online microbatch scheduler: split each global batch into m microbatches x dp_llm bins
(a registry of portfolio members, the best picked by exact 1F1B simulation; baselines; an opt-in
1F1B-aware ILP), a certified lower bound, a background prefetching service, and adaptive
correction of the cost model. Its benchmarks and synthetic inputs live in benchmarks/."""

from dflop.scheduler.correction import AdaptiveCorrection, CorrectionDecision, MeasuredTimes, ShapeBuckets
from dflop.scheduler.evaluate import StageTimes, lower_bound, stage_times
from dflop.scheduler.greedy import MemoryGuardError
from dflop.scheduler.partition import POLICIES, Partition, greedy_partition, partition
from dflop.scheduler.profile import fluid_lower_bound
from dflop.scheduler.service import SchedulerService

__all__ = ["POLICIES", "AdaptiveCorrection", "CorrectionDecision", "MeasuredTimes", "MemoryGuardError", "Partition",
           "SchedulerService", "ShapeBuckets", "StageTimes", "fluid_lower_bound", "greedy_partition", "lower_bound",
           "partition", "stage_times"]
