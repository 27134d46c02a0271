"""The one policy vocabulary (dflop.scheduler.policy): the config's words translated as the trainer
translated them before (`policy = "padded" if pad_to_longest and policy == "baseline" else policy`,
then "baseline" -> "megatron" for the partition), and the names files hold."""

from __future__ import annotations

import pytest
import yaml

from dflop.config import Config
from dflop.scheduler.partition import POLICIES
from dflop.scheduler.policy import Policy


@pytest.mark.parametrize("policy, pad, priced, partitioned", [
    ("dflop", False, "dflop", "dflop"), ("dflop", True, "dflop", "dflop"),
    ("baseline", False, "megatron", "megatron"), ("baseline", True, "padded", "megatron"),
])
def test_the_config_reads_as_the_trainer_read_it(policy, pad, priced, partitioned):
    section = Config.from_dict({"scheduler": {"policy": policy, "pad_to_longest": pad}}).scheduler
    ours = Policy.of_config(section)
    assert ours == priced and ours.bins == partitioned  # priced: dflop.scheduler.padded.price's word
    assert ours.data_blind == (policy == "baseline")


def test_files_and_the_partitioner_see_plain_names():
    assert yaml.safe_dump({"policy": str(Policy.PADDED)}) == "policy: padded\n"
    assert set(POLICIES) == {"dflop", "megatron", "llava_group", "lpt1d"}  # `partition`'s, as before
