"""torchrun worker for test_trainer_loop.py: an uninterrupted run, and a run stopped after a step
that follows a checkpoint (as if killed) then re-run, in one launch (process start dominates on CPU).

    python -m torch.distributed.run --nproc-per-node N resume_worker.py SPEC.json
    SPEC.json: {"config": {...}, "plan": path, "shapes": path, "full": dir, "resumed": dir, "stop_after": k,
                "reference_plan": path, "reference": dir}   (optional: one more uninterrupted run, another plan)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dflop.config import Config
from dflop.runtime.process_group import end_worker, init_distributed
from dflop.runtime.run import train


def main() -> int:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_distributed("cpu")
    cfg = Config.from_dict(spec["config"])
    common = dict(plan_path=spec["plan"], shapes_path=spec["shapes"], costmodel_path=None, progress=False)
    train(cfg, out_dir=spec["full"], **common)
    train(cfg, out_dir=spec["resumed"], stop_after=spec["stop_after"], **common)  # "killed"
    # Snakemake deletes an incomplete job's declared outputs before the re-run.
    assert not (Path(spec["resumed"]) / "metrics.parquet").exists()
    train(cfg, out_dir=spec["resumed"], **common)  # re-run: resumes from the last checkpoint
    if "reference_plan" in spec:
        train(cfg, out_dir=spec["reference"], **{**common, "plan_path": spec["reference_plan"]})
    return 0


if __name__ == "__main__":
    end_worker(main())  # barrier, destroy the group, os._exit (see end_worker)
