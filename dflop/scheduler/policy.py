"""The scheduler's policies, one vocabulary for the trainer, the planner and the partitioner.

How a global batch becomes microbatches and bins:

- ``dflop``: the portfolio (cost-balanced microbatches and bins, best order; `dflop.scheduler.partition`);
- ``megatron``: data-blind, a fixed sample count per microbatch in batch order, samples packed into
  one sequence (the Megatron-style baseline);
- ``padded``: ``megatron``'s bins with every sample padded to its bin's longest (the HF/LLaVA
  trainer; priced by `dflop.scheduler.padded.price`);
- ``llava_group``, ``lpt1d``: further baselines the benchmarks and the planner's quick bound use.

The config names them in its own words (``scheduler.policy``: dflop | baseline, with
``scheduler.pad_to_longest``); `Policy.of_config` is the one translation.
"""

from __future__ import annotations

from enum import StrEnum

from dflop.config import SchedulerSection


class Policy(StrEnum):
    """A scheduler policy (module docstring); equal to its name as a string, as files write it."""

    DFLOP = "dflop"
    MEGATRON = "megatron"
    PADDED = "padded"
    LLAVA_GROUP = "llava_group"
    LPT1D = "lpt1d"

    @classmethod
    def of_config(cls, section: SchedulerSection) -> "Policy":
        """The config's ``scheduler.policy`` (dflop | baseline) with ``scheduler.pad_to_longest``."""
        if section.policy == "dflop":
            return cls.DFLOP
        return cls.PADDED if section.pad_to_longest else cls.MEGATRON

    @property
    def bins(self) -> "Policy":
        """The policy that forms this one's bins: the padded baseline cuts Megatron's."""
        return Policy.MEGATRON if self is Policy.PADDED else self

    @property
    def data_blind(self) -> bool:
        return self is not Policy.DFLOP


PARTITION_POLICIES = tuple(p.value for p in Policy if p.bins is p)  # what `partition` forms bins by
