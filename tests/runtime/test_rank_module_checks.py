"""Plans the trainer must refuse before any collective, on every rank: a vision TP degree that
does not split the tower (or its projector) evenly, and sequence parallelism for the vision tower."""

from __future__ import annotations

import pytest

from dflop.config import Config
from dflop.errors import UserError
from dflop.models.handle import ModelHandle
from dflop.plan import plan_from_dict
from dflop.runtime.model import build_rank_modules
from dflop.runtime.topology import Topology

from trainer_reference import config_dict


def _plan(vision_tp: int, **vision_techniques):
    world = vision_tp + 2
    return plan_from_dict({"vision": {"tp": vision_tp, "pp": 1, "dp": 1, "layers_per_stage": [2], **vision_techniques},
                           "llm": {"tp": 2, "pp": 1, "dp": 1, "layers_per_stage": [2], "sequence_parallel": True},
                           "placement": "disjoint", "microbatches": 1, "global_batch_size": 1,
                           "world_size": world}, "plan.yaml").plan


@pytest.fixture(scope="module")
def handle():
    return ModelHandle.resolve(Config.from_dict(config_dict("llava_ov", "unused.jsonl")).model)


@pytest.mark.parametrize("rank", [0, 3])  # a vision rank and an LLM rank refuse alike
def test_vision_tp_that_does_not_divide_the_widths_is_refused(handle, rank):
    # siglip-tiny: 4 heads, MLP 256, projector into qwen2.5-tiny's width 64. Heads are padded with zero
    # heads (4 -> 8 at tp 8), so the widths alone limit the degree: 3 divides neither
    plan = _plan(3)
    with pytest.raises(UserError, match=r"^plan.yaml: vision.tp is 3, which does not split .*"
                                        r"\(possible: 1, 2, 4, 8, 16, 32, 64\)$"):
        build_rank_modules(Topology(plan, rank, plan.world_size), handle, seed=0)


@pytest.mark.parametrize("rank", [0, 2])
def test_vision_sequence_parallel_is_refused_naming_the_key(handle, rank):
    plan = _plan(2, sequence_parallel=True)
    with pytest.raises(UserError, match=r"^plan.yaml: vision.sequence_parallel: .*LLM only"):
        build_rank_modules(Topology(plan, rank, plan.world_size), handle, seed=0)
