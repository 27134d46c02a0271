"""plan.yaml loading: the DESIGN keys into frozen dataclasses, one-line errors naming the key."""

from __future__ import annotations

import pytest

from dflop.errors import UserError
from dflop.runtime.plan import ModuleLayout, Placement, load_plan, plan_from_dict, write_plan


def raw(**changes) -> dict:
    base = {"vision": {"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2]},
            "llm": {"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [1, 1]},
            "placement": "disjoint", "microbatches": 4, "global_batch_size": 16, "world_size": 6,
            "predicted": {"step_s": {"mean": 1.0}}}
    base.update(changes)
    return base


def test_valid_plan_loads_into_dataclasses(tmp_path):
    path = tmp_path / "plan.yaml"
    write_plan(plan_from_dict(raw()), path)
    plan = load_plan(path)
    assert plan.vision == ModuleLayout(1, 1, 2, (2,)) and plan.llm == ModuleLayout(2, 2, 1, (1, 1))
    assert plan.placement is Placement.DISJOINT and not plan.colocated
    assert (plan.microbatches, plan.global_batch_size, plan.world_size, plan.n_vision_ranks) == (4, 16, 6, 2)
    assert plan.llm.layer_ranges() == [(0, 1), (1, 2)]


def test_extra_optimizer_keys_are_kept_not_interpreted():
    assert plan_from_dict(raw()).extra == {"predicted": {"step_s": {"mean": 1.0}}}


def test_colocated_plan_counts_only_llm_ranks():
    plan = plan_from_dict(raw(placement="colocated", vision={"tp": 2, "pp": 1, "dp": 1, "layers_per_stage": [2]},
                              world_size=4))
    assert plan.colocated and plan.n_vision_ranks == 0


def test_uniform_layer_split_for_the_baseline():
    plan = plan_from_dict(raw(llm={"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [3, 1]}))
    assert plan.with_uniform_layers(2, 4).llm.layers_per_stage == (2, 2)


@pytest.mark.parametrize("changes,message", [
    (dict(world_size=4), r"world_size is 4 but the layout needs 6 ranks \(vision tp\*pp\*dp \+ llm"),
    (dict(placement="mixed"), "placement: expected disjoint or colocated, got 'mixed'"),
    (dict(microbatches=0), r"microbatches: expected an integer >= 1, got 0"),
    (dict(global_batch_size=3), r"global_batch_size 3 cannot fill microbatches \* llm.dp = 4 \* 1 = 4 bins"),
    (dict(llm={"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [2]}),
     r"llm.layers_per_stage: expected a list of 2 layer counts"),
    (dict(llm={"tp": 2, "pp": 2, "dp": 1}), "llm: missing key\\(s\\) layers_per_stage"),
    (dict(vision={"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2], "sp": 2}), r"vision.sp: unknown key"),
    (dict(vision={"tp": 1, "pp": 1, "dp": True, "layers_per_stage": [2]}), r"vision.dp: expected an integer"),
    (dict(placement="colocated", world_size=4), "vision dp/tp equal to the LLM's"),
])
def test_bad_plans_are_one_line_errors(changes, message):
    with pytest.raises(UserError, match=message) as info:
        plan_from_dict(raw(**changes), "p.yaml")
    assert "\n" not in str(info.value) and str(info.value).startswith("p.yaml")


def test_colocated_needs_one_vision_stage():
    bad = raw(placement="colocated", vision={"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [1, 1]}, world_size=4)
    with pytest.raises(UserError, match="vision.pp is 2 but colocated placement"):
        plan_from_dict(bad)


def test_missing_keys_and_files(tmp_path):
    with pytest.raises(UserError, match="missing key\\(s\\) world_size"):
        plan_from_dict({k: v for k, v in raw().items() if k != "world_size"})
    with pytest.raises(UserError, match=r"nope\.yaml: no such file \(run the optimize stage"):
        load_plan(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("vision: [1, 2\n")
    with pytest.raises(UserError, match="bad.yaml:2: not valid YAML"):
        load_plan(bad)


def test_world_size_and_model_checks_name_both_numbers():
    plan = plan_from_dict(raw(), "plan.yaml")
    with pytest.raises(UserError, match="world_size is 6 but 4 processes were launched"):
        plan.check_world_size(4)
    with pytest.raises(UserError, match=r"llm.layers_per_stage \[1, 1\] sums to 2 but the model has 24 llm layers"):
        plan.check_model(2, 24)
