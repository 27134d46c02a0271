"""`dflop train` refuses a plan whose LLM schedule the executor does not run, in one line naming
plan.yaml and llm.schedule, before any process starts (and the Trainer, where a plan enters the
runtime another way); 1F1B, interleaved 1F1B and ZB-H1 plans pass. Every schedule a plan may name
now runs, so the refusal is tested as it would meet a schedule the planner knows and the executor
not (the executor without ZB-H1, as before it had one)."""

import pytest

from dflop.config import Config
from dflop.errors import UserError
from dflop.plan import write_plan
from dflop.runtime.launch import check_before_launch, check_trainable_schedule


def doc(**llm):
    return {"vision": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]},
            "llm": {"tp": 1, "pp": 2, "dp": 1, "layers_per_stage": [1, 1], **llm},
            "placement": "disjoint", "microbatches": 4, "global_batch_size": 16, "world_size": 3}


@pytest.fixture
def without_zb_h1(monkeypatch):
    from dflop.runtime import launch

    monkeypatch.setattr(launch, "TRAINABLE_SCHEDULES", ("1f1b", "interleaved"))


def test_zb_h1_plan_is_refused_before_launch(tmp_path, without_zb_h1):
    """Bug caught: the check missing from `check_before_launch` (the plan would reach torchrun)."""
    path = tmp_path / "plan.yaml"
    write_plan(doc(schedule="zb-h1", chunks=1), path)
    with pytest.raises(UserError, match=r"plan.yaml: llm.schedule is zb-h1 .*planner.schedules: \[1f1b, interleaved\]"
                       ) as err:
        check_before_launch(Config.from_dict({}), path)
    assert "\n" not in str(err.value)


def test_1f1b_interleaved_zb_h1_and_older_plans_pass_the_schedule_check(tmp_path):
    from dflop.plan import read_plan

    path = tmp_path / "plan.yaml"
    write_plan(doc(), path)  # no schedule keys: an older plan
    check_trainable_schedule(read_plan(path).plan)
    write_plan(doc(schedule="1f1b", chunks=1), path)
    check_trainable_schedule(read_plan(path).plan)
    write_plan(doc(schedule="interleaved", chunks=2, layers_per_stage=[1, 0, 0, 1]), path)
    check_trainable_schedule(read_plan(path).plan)
    write_plan(doc(schedule="zb-h1", chunks=1), path)
    check_trainable_schedule(read_plan(path).plan)


def test_trainer_refuses_before_building_anything(without_zb_h1):
    """Bug caught: the Trainer (the HF integration's and the tests' way in) running a zb-h1 plan as
    1F1B. It refuses before reading its settings or joining a process group (none exists here)."""
    from dflop.plan import plan_from_dict
    from dflop.runtime.trainer import Trainer

    plan = plan_from_dict(doc(schedule="zb-h1"), "plan.yaml").plan
    with pytest.raises(UserError, match="plan.yaml: llm.schedule is zb-h1"):
        Trainer(None, plan, None, [])
