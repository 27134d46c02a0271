"""`SchedulerSettings`: the scheduler's one settings type, from the config's section, and the
planner's deterministic derivation of it."""

import dataclasses

import pytest

from dflop.config import Config
from dflop.scheduler.policy import Policy
from dflop.scheduler.portfolio import PortfolioSettings
from dflop.scheduler.settings import PLANNING_BUDGET_S, SchedulerSettings

SECTIONS = [{}, {"policy": "baseline"}, {"policy": "baseline", "pad_to_longest": True},
            {"ilp": "always", "budget_ms": 750}, {"ilp": "auto", "budget_ms": 1.5, "prefetch": 4}]


@pytest.mark.parametrize("keys", SECTIONS, ids=str)
def test_of_config_reads_every_key_of_the_section(keys):
    """The policy words as `Policy.of_config` reads them, the ILP mode as written, the budget in
    seconds (fails on a budget left in milliseconds or a dropped key)."""
    section = Config.from_dict({"scheduler": keys}).scheduler
    got = SchedulerSettings.of_config(section)
    want_policy = {"dflop": Policy.DFLOP}.get(section.policy, Policy.PADDED if section.pad_to_longest else Policy.MEGATRON)
    assert (got.policy, got.ilp, got.budget_s) == (want_policy, keys.get("ilp", "never"),
                                                   pytest.approx(keys.get("budget_ms", 200) / 1e3))
    assert got.portfolio == PortfolioSettings()


@pytest.mark.parametrize("keys", SECTIONS, ids=str)
def test_the_planner_scores_alike_whatever_the_section(keys):
    """The planner's derivation runs the DFLOP portfolio without the wall-clock ILP whatever the
    config asks of the trainer (fails if `for_planning` kept ``ilp: always``, which would make a
    plan depend on the machine's load, or a baseline policy), and keeps the portfolio's gates."""
    gates = PortfolioSettings(sim_starts=3)
    online = dataclasses.replace(SchedulerSettings.of_config(Config.from_dict({"scheduler": keys}).scheduler),
                                 portfolio=gates)
    planning = online.for_planning()
    assert (planning.policy, planning.ilp, planning.budget_s) == (Policy.DFLOP, "never", PLANNING_BUDGET_S)
    assert planning.portfolio is gates
    assert dataclasses.replace(planning, portfolio=PortfolioSettings()) == SchedulerSettings.planning()


def test_no_default_stands_for_a_config_key():
    """Policy, ILP and budget come from the section (or `planning`), never from a field default
    that could drift from the schema; only the portfolio's gates (no config key) have one."""
    for f in dataclasses.fields(SchedulerSettings):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        assert has_default == (f.name == "portfolio"), f.name
