"""The config's planner section forces memory techniques into the plan and its baseline; `auto`
means off until the planner chooses them (issue: the planner chooses the memory techniques)."""

from __future__ import annotations

import pytest

from dflop.config import Config
from dflop.plan import Layout, Plan, Techniques
from dflop.planner.planfile import forced_techniques


def _plan(tp_l: int = 2) -> Plan:
    return Plan(Layout("disjoint", 1, 2, 1, tp_l, 2, 1, 4), (1, 1), (1, 1))


def _planner(**keys):
    return Config.from_dict({"planner": keys}).planner


def test_auto_means_off():
    assert forced_techniques(_plan(), _planner()) == _plan()


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_a_forced_recompute_mode_applies_to_every_stage_of_both_modules(mode):
    plan = forced_techniques(_plan(), _planner(recompute=mode, shard_optimizer=True))
    assert plan.vision_techniques == Techniques((mode, mode), shard_optimizer=True)
    assert plan.llm_techniques == Techniques((mode, mode), shard_optimizer=True)


def test_sequence_parallel_only_for_the_llm_and_where_there_is_tensor_parallelism():
    plan = forced_techniques(Plan(Layout("disjoint", 2, 2, 1, 2, 2, 1, 4), (1, 1), (1, 1)),
                             _planner(sequence_parallel=True))
    assert plan.llm_techniques.sequence_parallel and not plan.vision_techniques.sequence_parallel
    assert not forced_techniques(_plan(tp_l=1), _planner(sequence_parallel=True)).llm_techniques.sequence_parallel
    assert not forced_techniques(_plan(tp_l=2), _planner(sequence_parallel=False)).llm_techniques.sequence_parallel


def test_config_refuses_unknown_values():
    from dflop.errors import UserError
    with pytest.raises(UserError, match="planner.recompute"):
        _planner(recompute="some")
    with pytest.raises(UserError, match="planner.shard_optimizer"):
        _planner(shard_optimizer="yes")
