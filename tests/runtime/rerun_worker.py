"""torchrun worker for test_reruns.py: a sequence of re-runs of one training in one out-dir, each
with a changed setting, in one launch (process start dominates on CPU).

    python -m torch.distributed.run --nproc-per-node 2 rerun_worker.py SPEC.json
    SPEC.json: {"config": {...}, "plan": path, "runs": [{"name", "shapes", "config_changes", "fresh"}],
                "out": dir, "record": dir}

After each run its metrics.parquet and the names under previous_runs/ are copied to record/<name>/.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dflop.config import Config, deep_merge
from dflop.runtime.process_group import end_worker, init_distributed
from dflop.runtime.run import train


def main() -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # as `dflop train` does
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_distributed("cpu")
    out, record = Path(spec["out"]), Path(spec["record"])
    for run in spec["runs"]:
        cfg = Config.from_dict(deep_merge(spec["config"], run.get("config_changes", {})))
        train(cfg, plan_path=spec["plan"], shapes_path=run["shapes"], costmodel_path=None, out_dir=out,
              progress=False, export=False, fresh=run.get("fresh", False))
        dist.barrier()
        if dist.get_rank() == 0:
            keep = record / run["name"]
            keep.mkdir(parents=True)
            shutil.copy(out / "metrics.parquet", keep / "metrics.parquet")
            previous = out / "previous_runs"
            names = sorted(p.name for p in previous.iterdir()) if previous.exists() else []
            (keep / "previous_runs.json").write_text(json.dumps(names))
        dist.barrier()
    return 0


if __name__ == "__main__":
    end_worker(main())  # barrier, destroy the group, os._exit (see end_worker)
