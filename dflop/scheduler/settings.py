"""The one settings type the online scheduler runs with (`SchedulerSettings`).

Translated once from the config's ``scheduler`` section (`SchedulerSettings.of_config`: its policy
words through `Policy.of_config`, ``ilp``, ``budget_ms``); the planner scores plans with its
deterministic derivation (`SchedulerSettings.for_planning`); the portfolio's gates, which have no
config key, ride along as `SchedulerSettings.portfolio`. ``scheduler.prefetch`` is the trainer's
queue depth, not how a batch is split: the trainer reads it from the section.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dflop.config import SchedulerSection
from dflop.scheduler.policy import Policy
from dflop.scheduler.portfolio import PortfolioSettings

# The planner's ILP budget per batch, recorded in plan.yaml (evaluation.scheduler.budget_s); the
# planner leaves the ILP off (`SchedulerSettings.planning`), so it bounds nothing that runs.
PLANNING_BUDGET_S = 0.05


@dataclass(frozen=True)
class SchedulerSettings:
    """How the online scheduler splits each global batch (see `dflop.scheduler.partition.partition`).

    policy: a `Policy`: the portfolio, the packed data-blind baseline or the padded one (its
    microbatches padded to their longest sample: `dflop.scheduler.padded`); ilp: "never", "auto"
    or "always", the portfolio's exact member; budget_s: wall seconds that ILP may use per batch;
    portfolio: where each portfolio member runs (`PortfolioSettings`: tuned on the benchmark grid,
    no config key).
    """

    policy: Policy
    ilp: str
    budget_s: float
    portfolio: PortfolioSettings = field(default_factory=PortfolioSettings)

    @classmethod
    def of_config(cls, section: SchedulerSection) -> "SchedulerSettings":
        """The config's ``scheduler`` section (the one translation; its defaults are the schema's)."""
        return cls(Policy.of_config(section), section.ilp, section.budget_ms / 1e3)

    @classmethod
    def planning(cls) -> "SchedulerSettings":
        """How the planner scores every candidate plan, whatever the config: the DFLOP portfolio
        (the baselines' evaluations swap in their own policy), its ILP off, `PLANNING_BUDGET_S`.

        Deliberately not the trainer's settings: the ILP stops at a wall-clock deadline, so with it
        the same inputs could give another plan under another machine load; online the ILP can only
        improve on the members the planner ran, so planning without it is conservative."""
        return cls(Policy.DFLOP, "never", PLANNING_BUDGET_S)

    def for_planning(self) -> "SchedulerSettings":
        """These settings as the planner scores with them (`planning`), the portfolio's gates kept."""
        return replace(self.planning(), portfolio=self.portfolio)

    def with_policy(self, policy: Policy | str) -> "SchedulerSettings":
        """The same settings splitting by `policy` (a baseline's evaluation, the quick LPT bound)."""
        return replace(self, policy=Policy(policy))
