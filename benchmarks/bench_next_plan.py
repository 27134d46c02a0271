"""Host time of rank 0's next-plan work per step: `StepPlanner.get` on a demo's artifacts.

    python benchmarks/bench_next_plan.py --workdir DIR [--steps 150] [--trees OLD NEW --rounds 3]

DIR is a finished demo working directory (`make demo`: results/plan/plan.yaml,
results/data/shapes.parquet, results/costmodel/costmodel.json). Builds rank 0's scheduler as the
trainer builds it (`dflop.runtime.trainer.step_planner` on the demo's plan, pricing and shapes,
one torch thread) and times `get` for `--steps` steps, sleeping 50 ms between them so the
scheduler's worker solves ahead as it does during a step. On CPU this work sits on every step's
critical path (`dflop.runtime.run`: the next plan is made after the optimizer step, while the other
ranks wait in its broadcast); on GPUs it runs behind the step.

With ``--trees OLD NEW`` it runs itself on each code tree in turn (PYTHONPATH=<tree>), `--rounds`
times, interleaved, and prints each run's median and the medians' ratio: two versions compared on
the same machine state.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def time_gets(workdir: Path, steps: int) -> np.ndarray:
    """Milliseconds of each `get` after the first five (the first waits for its solve)."""
    import torch

    from dflop.config import load
    from dflop.costmodel.jsonio import load_cost_model
    from dflop.models.handle import ModelHandle
    from dflop.plan import read_plan
    from dflop.runtime.settings import TrainSettings
    from dflop.runtime.trainer import plan_cluster, step_planner, training_pricing
    from dflop.scheduler.online import GlobalBatches
    from dflop.shapes import read_shapes

    torch.set_num_threads(1)
    cfg = load(workdir / "config/config.yaml")
    longer = {**cfg.raw, "train": {**cfg.raw.get("train", {}), "steps": steps}}  # the planner stops at the last step
    settings = TrainSettings.from_config(type(cfg).from_dict(longer))
    model = ModelHandle.resolve(cfg.model)
    plan_file = read_plan(workdir / "results/plan/plan.yaml")
    shapes = read_shapes(workdir / "results/data/shapes.parquet")
    cost = load_cost_model(workdir / "results/costmodel/costmodel.json")
    pricing = training_pricing(plan_file.plan, model, cost, plan_cluster(plan_file, settings))
    batches = GlobalBatches(len(shapes), settings.train.global_batch_size, settings.seed)
    planner = step_planner(settings, pricing, shapes, batches, model.sample_rules())
    times = []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            planner.get(step, timeout_s=1.0 if step == 0 else 0.0)
            times.append(time.perf_counter() - t0)
            time.sleep(0.05)
    finally:
        planner.close()
    return np.array(times[5:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--trees", type=Path, nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    if args.trees is None:
        ms = time_gets(workdir, args.steps)
        print(f"get: median {np.median(ms):.2f} ms (p10 {np.percentile(ms, 10):.2f}, p90 {np.percentile(ms, 90):.2f}, "
              f"{len(ms)} steps)")
        return
    medians: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(args.rounds):
        for name, tree in zip(("old", "new"), args.trees):
            env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
            out = subprocess.run([sys.executable, __file__, "--workdir", str(workdir), "--steps", str(args.steps)],
                                 env=env, capture_output=True, text=True, check=True, cwd=tree)
            line = out.stdout.strip().splitlines()[-1]
            medians[name].append(float(line.split("median ")[1].split(" ms")[0]))
            print(f"{name} ({tree}): {line}", flush=True)
    ratio = np.median(medians["old"]) / np.median(medians["new"])
    print(f"median of medians: old {np.median(medians['old']):.2f} ms, new {np.median(medians['new']):.2f} ms, "
          f"old / new {ratio:.2f}x")


if __name__ == "__main__":
    main()
