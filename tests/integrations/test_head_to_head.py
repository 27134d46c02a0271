"""`dflop head-to-head`'s training jobs are what `dflop train` would start (its torchrun and the
workers' arguments), started without a `dflop train` process of their own."""

from __future__ import annotations

import json
import subprocess

import yaml

from dflop.integrations.head_to_head import job_commands
from dflop.runtime import launch

LAYOUT = {"vision": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]},
          "llm": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]}, "placement": "disjoint",
          "microbatches": 2, "global_batch_size": 16, "world_size": 2}
PLAN = {**LAYOUT, "baseline": {**LAYOUT, "microbatches": 4, "policy": "megatron"}}


def _launched(monkeypatch, argv: list[str]) -> list[str]:
    """The command `dflop train argv` (the launcher, outside torchrun) would run."""
    seen = []
    monkeypatch.setattr(launch.subprocess, "run",
                        lambda command, env=None: seen.append(command) or subprocess.CompletedProcess(command, 0))
    assert launch.main(argv) == 0
    (command,) = seen
    return command


def _split(command: list[str]) -> tuple[list[str], dict]:
    """(torchrun's part, the workers' parsed arguments) of a torchrun command of launch workers."""
    at = command.index("dflop.runtime.launch") + 1
    return command[:at], vars(launch.build_parser().parse_args(command[at:]))


def test_train_jobs_are_the_torchrun_dflop_train_would_start(tmp_path, monkeypatch):
    plan, shapes, costmodel = tmp_path / "plan.yaml", tmp_path / "pool.parquet", tmp_path / "costmodel.json"
    plan.write_text(yaml.safe_dump(PLAN))
    shapes.write_bytes(b"")  # never read: nothing trains
    costmodel.write_text("{}")
    out, baseline_dir, turns = tmp_path / "h2h", tmp_path / "baseline", tmp_path / "turns"
    baseline_dir.mkdir()
    settings = {"train": {"checkpoint_every": 0}}
    jobs = job_commands(config=None, settings=settings, plan=plan,
                        baseline_plan=launch.write_baseline_plan(plan, baseline_dir), pool_shapes=shapes,
                        costmodel=costmodel, out_dir=out, baseline_dir=baseline_dir, turns_dir=turns, world=2, accum=2)
    # What head-to-head ran before: `dflop train` (python -m dflop.runtime.launch) per job.
    common = ["--settings", json.dumps(settings), "--plan", str(plan), "--shapes", str(shapes),
              "--costmodel", str(costmodel), "--no-export", "--fresh"]
    by_launcher = {
        "plan": _launched(monkeypatch, [*common, "--out-dir", str(out / "plan"), "--take-turns", str(turns / "plan")]),
        "baseline": _launched(monkeypatch, [*common, "--baseline", "--out-dir", str(baseline_dir),
                                            "--take-turns", str(turns / "baseline")]),
    }
    for name, command in by_launcher.items():
        assert _split(jobs[name]) == _split(command), name
    assert _split(jobs["baseline"])[1]["policy"] == "baseline"
    assert _split(jobs["baseline"])[1]["plan"].name == "baseline_plan.yaml"
