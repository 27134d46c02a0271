"""A fresh training run on one gloo rank says nothing about resuming.

Reference: the checkpoint directory (empty, so nothing is resumed and nothing may be said about it).
"""

from __future__ import annotations

import logging

import pytest
import yaml

from dflop.runtime import run
from test_checkpoint_helpers import spawn
from trainer_reference import config_dict, pick_pool

PLAN = {"vision": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]},
        "llm": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]}, "placement": "colocated",
        "microbatches": 2, "global_batch_size": 4, "world_size": 1}
STEPS = 2


def _fresh_run(rank: int, spec: dict) -> None:
    from dflop.config import Config

    handler = logging.FileHandler(spec["log"])
    logging.getLogger("dflop").addHandler(handler)
    logging.getLogger("dflop").setLevel(logging.INFO)
    try:
        run.train(Config.from_dict(spec["config"]), plan_path=spec["plan"], shapes_path=spec["shapes"],
                  costmodel_path=None, out_dir=spec["out"], progress=False, export=False)
    finally:
        logging.getLogger("dflop").removeHandler(handler)


@pytest.mark.distributed
def test_a_fresh_run_says_nothing_about_resuming(tmp_path, demo_shapes, runtime_demo):
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(PLAN))
    pool = pick_pool(demo_shapes["llava_ov"], tmp_path / "pool.parquet", {"image": 2, "text": 2})
    config = config_dict("llava_ov", runtime_demo, train={"global_batch_size": 4, "steps": STEPS,
                                                          "checkpoint_every": STEPS})
    spec = {"config": config, "plan": str(tmp_path / "plan.yaml"), "shapes": pool, "out": str(tmp_path / "out"),
            "log": str(tmp_path / "train.log")}
    spawn(_fresh_run, 1, tmp_path, spec)
    log = (tmp_path / "train.log").read_text()
    assert "step 2/2" in log, log  # the loop's own lines were captured
    assert "adaptive correction" not in log and "checkpoint's" not in log, log

