"""`dflop head-to-head`: the plan, its data-blind baseline and the Hugging Face `Trainer` trained side
by side on one machine, taking their steps in turn, so the summary's speedups over both peers are
measured under the same machine phases (rule train_baseline with
``train.compare_with_hf_trainer``: the demo).

Three jobs start at once (their start-ups overlap) and, once all three are ready, take one step
each in turn (`dflop.runtime.turns`: plan, baseline, hf, plan, ...), never computing at the same
time:

- ``plan``: `dflop train` with plan.yaml (no export, no checkpoints: a measurement);
- ``baseline``: `dflop train --baseline` (plan.yaml's data-blind baseline), into the baseline's
  directory (its metrics.parquet and trace.json are rule train_baseline's outputs);

  both are the torchrun that `dflop train` would start, started here after its checks
  (`job_commands`);
- ``hf``: `dflop.integrations.hf_run`: transformers' `Trainer` with the same model, data, global
  batch and world size, every rank data-parallel, ``group_by_length`` order, padded batches.

All three train on the same pool: the shapes rows HF's LLaVA-OV can batch (`hf_pool`: videos of
the model's frame count), written to ``OUT/pool_shapes.parquet``; the plan's and the baseline's
global batches are the same (same seed), HF's are its own sampler's. Each job's output goes to
``OUT/logs/NAME.log``; when one fails the others are stopped and the error names its log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping

from dflop.errors import UserError

JOBS = ("plan", "baseline", "hf")


def hf_accumulation(global_batch: int, world: int, microbatches: int) -> int:
    """Gradient-accumulation steps for HF's Trainer: the plan's microbatch count when the global
    batch splits evenly over world x that count, else 1 (then it must split over the world)."""
    from dflop.integrations.hf_run import per_device_batch

    accum = microbatches if global_batch % (world * microbatches) == 0 else 1
    per_device_batch(global_batch, world, accum)  # the one-line error when even 1 does not split
    return accum


def job_commands(*, config: str | None, settings: Mapping, plan: Path, baseline_plan: Path, pool_shapes: Path,
                 costmodel: Path | None, out_dir: Path, baseline_dir: Path, turns_dir: Path, world: int, accum: int,
                 python: str = sys.executable) -> dict[str, list[str]]:
    """The three jobs' commands (module docstring): torchrun for each. The plan's and the
    baseline's workers get what `dflop train` would hand them after its checks and the baseline
    plan (`baseline_plan`: `launch.write_baseline_plan`), which `head_to_head` does once itself: a
    `dflop train` process per job spent seconds of CPU importing torch and transformers again."""
    from dflop.runtime.launch import torchrun_command

    common = ["--config", str(config)] if config else []
    common += ["--settings", json.dumps(settings)]
    train = [*common, "--shapes", str(pool_shapes)]
    train += ["--costmodel", str(costmodel)] if costmodel is not None else []
    train += ["--no-export", "--fresh"]
    return {
        "plan": torchrun_command(plan, [*train, "--plan", str(plan), "--out-dir", str(out_dir / "plan"),
                                        "--take-turns", str(turns_dir / "plan")], python=python),
        "baseline": torchrun_command(baseline_plan, [*train, "--plan", str(baseline_plan), "--policy", "baseline",
                                                     "--out-dir", str(baseline_dir),
                                                     "--take-turns", str(turns_dir / "baseline")], python=python),
        "hf": [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               "-m", "dflop.integrations.hf_run", *common, "--shapes", str(pool_shapes),
               "--out-dir", str(out_dir / "hf"), "--accum", str(accum), "--take-turns", str(turns_dir / "hf")],
    }


def head_to_head(config: str | None, settings: Mapping | None, *, plan: str | Path, shapes: str | Path,
                 costmodel: str | Path | None, out_dir: str | Path, baseline_dir: str | Path) -> dict[str, Path]:
    """Run the three jobs (module docstring); returns each job's metrics.parquet."""
    from dflop.config import load
    from dflop.integrations.hf_run import hf_pool
    from dflop.io import atomic_path
    from dflop.models.handle import ModelHandle
    from dflop.plan import read_plan
    from dflop.runtime.launch import check_before_launch, worker_error_file, write_baseline_plan
    from dflop.runtime.turns import TurnDir
    from dflop.shapes import read_shapes

    settings = dict(settings or {})
    cfg = load(config, json.dumps(settings) if settings else None)
    out_dir, baseline_dir = Path(out_dir), Path(baseline_dir)
    plan_file = read_plan(plan)
    world = plan_file.plan.world_size
    if cfg.cluster.device == "cuda" and world > cfg.cluster.gpus_per_node:
        raise UserError(f"{plan}: train.compare_with_hf_trainer runs on one node, but the plan needs {world} GPUs "
                        f"(cluster.gpus_per_node {cfg.cluster.gpus_per_node})")
    accum = hf_accumulation(cfg.train.global_batch_size, world, plan_file.plan.layout.m)
    rules = ModelHandle.resolve(cfg.model).sample_rules()
    if costmodel is not None and not Path(costmodel).exists():
        raise UserError(f"--costmodel: file not found: {costmodel}")
    out_dir.mkdir(parents=True, exist_ok=True)
    baseline_dir.mkdir(parents=True, exist_ok=True)
    baseline_plan = write_baseline_plan(plan, baseline_dir)
    for path in (plan, baseline_plan):  # what `dflop train` checks before it starts torchrun
        check_before_launch(cfg, path)
    for path in (out_dir / "plan", baseline_dir):
        worker_error_file(path).unlink(missing_ok=True)
    pool_shapes = out_dir / "pool_shapes.parquet"
    with atomic_path(pool_shapes) as tmp:
        hf_pool(read_shapes(shapes), int(rules.arch_params["video_frames"])).to_parquet(tmp, index=False)
    turns = TurnDir(out_dir / "turns")
    turns.create(JOBS)
    # No checkpoints: a save between two turns would run beside the next job's step.
    settings.setdefault("train", {})
    settings["train"] = {**settings["train"], "checkpoint_every": 0}
    commands = job_commands(config=config, settings=settings, plan=Path(plan), baseline_plan=baseline_plan,
                            pool_shapes=pool_shapes,
                            costmodel=Path(costmodel) if costmodel is not None else None, out_dir=out_dir,
                            baseline_dir=baseline_dir, turns_dir=turns.dir, world=world, accum=accum)
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, command in commands.items():
            with open(logs / f"{name}.log", "w") as log:
                procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                               env={**os.environ, "OMP_NUM_THREADS": "1"})
        print(f"head-to-head: started {', '.join(JOBS)}; they take their steps in turn once all are ready "
              f"(logs: {logs})", file=sys.stderr, flush=True)
        if not turns.start_when_ready(alive=lambda: _first_failure(procs) is None):
            _raise_failure(procs, logs)
        while any(p.poll() is None for p in procs.values()):
            if _first_failure(procs) is not None:
                _raise_failure(procs, logs)
            time.sleep(0.2)
        if _first_failure(procs) is not None:
            _raise_failure(procs, logs)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
    return {"plan": out_dir / "plan" / "metrics.parquet", "baseline": baseline_dir / "metrics.parquet",
            "hf": out_dir / "hf" / "metrics.parquet"}


def _first_failure(procs: Mapping[str, subprocess.Popen]) -> str | None:
    return next((name for name, p in procs.items() if p.poll() not in (None, 0)), None)


def _raise_failure(procs: Mapping[str, subprocess.Popen], logs: Path):
    name = _first_failure(procs)
    log = logs / f"{name}.log"
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    own = [ln for ln in lines if ln.startswith(("dflop train: ", "hf_run: "))]  # a job's one-line error
    last = (own or lines or ["(no output)"])[-1]
    raise UserError(f"head-to-head: job {name} failed with exit code {procs[name].returncode} ({log}): {last}")
