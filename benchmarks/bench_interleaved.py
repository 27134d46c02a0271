"""Interleaved 1F1B or ZB-H1 against 1F1B on the same batches: measured step and idle time beside the prediction.

    python benchmarks/bench_interleaved.py [--schedule interleaved|zb-h1] [--preset tiny|small]
        [--layout colocated-pp2|pp2] [--chunks 2] [--steps 6] [--warmup 1] [--batch 8] [--microbatches 4]
        [--out-dir results/bench/interleaved] [--costmodel PATH | --analytic]

The demo dataset on a real pipeline (`bench_trainer.py`'s layouts with two LLM stages: default
``colocated-pp2``, the vision tower and LLM stage 0 on rank 0 and LLM stage 1 on rank 1, two ranks
for a two-core machine; gloo, one torch thread per rank). Every rank holds two trainers with the
same seed, hence the same global batches, and runs them in turn on each batch (rotating which goes
first), so both see the same machine load:

- ``1f1b``: the LLM's layers split uniformly over its 2 pipeline ranks, 1F1B;
- ``interleaved`` (``--schedule interleaved``): the same layers split uniformly over 2 x v model
  chunks (chunk c on rank c mod 2), Megatron-LM's interleaved 1F1B (`dflop.runtime.schedule`);
- ``zb-h1`` (``--schedule zb-h1``): the 1f1b plan's layers under ZB-H1, each LLM stage's backward
  split into B and W (`dflop.runtime.split_backward`).

Each trainer's online scheduler (policy dflop) partitions its batch as the trainer would, priced by
its own plan (`dflop.pricing.pricing`: per chunk under interleaving), and its ``predicted_step_s`` is
that partition simulated with the plan's schedule (`dflop.sim`); the online scheduler scores ZB-H1's
partitions as 1F1B, so its prediction here is the partition re-timed under ZB-H1 with the pricing's
W share, as the planner does (`dflop.planner.expected.schedule_timeline`). Step time = forward + backward of
all microbatches + gradient sync + optimizer, between two barriers (loading excluded, as in
`bench_trainer.py`). Idle fraction = 1 - (compute seconds of all ranks) / (ranks x step); "inside the
loop" takes the pipeline's own wall time instead of the step. The cost model is fitted on this CPU
with the model profiler (`bench_costmodel.py`, thread CPU time) unless given or --analytic.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_costmodel import PRESETS  # noqa: E402
from bench_trainer import (LAYOUTS, compute_cost_model, launch_workers, model_section, plan_dict, timed_step,  # noqa: E402
                           prepare, worker_inputs)

SCHEDULES = ("interleaved", "zb-h1")  # what --schedule compares with 1f1b


def plans(layout: str, vision_layers: int, llm_layers: int, chunks: int, microbatches: int, batch: int,
          schedule: str = "interleaved") -> dict:
    """The two variants' plans: the same grid, the LLM's layers uniform over its stages / chunks."""
    from dflop.plan import uniform_layer_split

    pp = LAYOUTS[layout][1]
    if pp < 2:
        raise SystemExit(f"layout {layout} has one LLM stage: nothing to interleave")

    def uniform(n: int) -> list[int]:
        return [stop - start for start, stop in uniform_layer_split(llm_layers, n)]

    one = plan_dict(layout, vision_layers, uniform(pp), microbatches, batch)
    if schedule == "zb-h1":
        zb = plan_dict(layout, vision_layers, uniform(pp), microbatches, batch)
        zb["llm"].update(schedule="zb-h1")
        return {"1f1b": one, "zb-h1": zb}
    inter = plan_dict(layout, vision_layers, uniform(pp * chunks), microbatches, batch)
    inter["llm"].update(schedule="interleaved", chunks=chunks)
    return {"1f1b": one, "interleaved": inter}


def zb_h1_prediction(trainer, step: int, plan) -> float:
    """The step of the partition the zb-h1 trainer's scheduler chose (scored as 1F1B) timed under
    ZB-H1 with the pricing's W share, as `dflop.planner.expected.schedule_timeline` times it (rank 0)."""
    from types import SimpleNamespace

    from dflop.scheduler.evaluate import simulate_times, stage_times

    planner = trainer.planner
    costs, _, part = planner._costs[step]  # the online scheduler's own record of the step (a benchmark reads it)
    times = stage_times(costs, part.microbatch, part.replica, part.m, part.dp_llm, part.dp_vision)
    frac = trainer.pricing.wgrad_frac(SimpleNamespace(seq_len=plan.seq_len))
    return float(simulate_times(times, part.order, p2p_s=planner.p2p_s, allreduce_s=planner.allreduce_s,
                                schedule="zb-h1", wgrad_frac=frac).step_s)


def worker(spec_path: str) -> int:
    """One rank: the two trainers, run in turn on the same batches (module docstring)."""
    import torch
    import torch.distributed as dist

    from dflop.data.training import pool_samples
    from dflop.plan import plan_from_dict
    from dflop.runtime.agreement import rank0_result
    from dflop.runtime.settings import TrainSettings
    from dflop.runtime.trainer import Trainer

    spec, device, cfg, pool = worker_inputs(spec_path)
    cost = compute_cost_model(spec["costmodel"])
    n_steps = spec["warmup"] + spec["steps"]
    variants = tuple(spec["plans"])
    trainers = {}
    for name in variants:
        settings = TrainSettings.from_config(cfg, policy="dflop", steps=n_steps)
        plan = plan_from_dict(spec["plans"][name], f"{name} plan").plan
        trainers[name] = Trainer(settings, plan, pool, pool_samples(pool, settings.datasets, settings.seed),
                                 cost=cost, device=device)
    # Every batch solved first: the scheduler's thread would take rank 0's CPU (bench_trainer.py).
    step_plans = {(name, step): rank0_result(lambda: trainers[name].planner.get(step, timeout_s=60.0))
                  for name in variants for step in range(n_steps)}
    predicted = {key: plan.predicted_step_s for key, plan in step_plans.items()}
    if "zb-h1" in variants and dist.get_rank() == 0:
        for step in range(n_steps):
            predicted["zb-h1", step] = zb_h1_prediction(trainers["zb-h1"], step, step_plans["zb-h1", step])
    rows = []
    for step in range(n_steps):
        order = variants[step % 2:] + variants[:step % 2]
        for name in order:
            trainer, plan = trainers[name], step_plans[(name, step)]
            stats, step_s, times, pipeline_s = timed_step(trainer, plan)
            if trainer.rank == 0:
                rows.append({"variant": name, "step": step, "warmup": step < spec["warmup"], "step_s": step_s,
                             "busy_s": float(times.sum()), "world": trainer.world,
                             "pipeline_s": pipeline_s, "loss": stats["loss"],
                             "predicted_step_s": predicted[name, step], "rows": list(map(int, plan.rows))})
    if dist.get_rank() == 0:
        Path(spec["result"]).write_text(json.dumps(rows))
    for trainer in trainers.values():
        trainer.close()
    dist.destroy_process_group()
    return 0


def summarize(rows: list[dict]) -> str:
    """Medians over the measured steps per variant, and the per-batch ratio 1f1b / the other
    schedule, measured and predicted."""
    import pandas as pd

    frame = pd.DataFrame([r for r in rows if not r["warmup"]])
    other = next(v for v in frame["variant"].unique() if v != "1f1b")
    variants = ["1f1b", other]
    by_step = frame.pivot(index="step", columns="variant", values="rows")
    same = all(list(a) == list(b) for a, b in zip(by_step["1f1b"], by_step[other]))
    frame["idle_frac"] = 1 - frame["busy_s"] / (frame["world"] * frame["step_s"])
    frame["idle_s"] = frame["world"] * frame["step_s"] - frame["busy_s"]
    frame["loop_idle"] = 1 - frame["busy_s"] / (frame["world"] * frame["pipeline_s"])
    frame["ratio"] = frame["step_s"] / frame["predicted_step_s"]
    table = frame.groupby("variant").agg(step_s=("step_s", "median"), predicted_s=("predicted_step_s", "median"),
                                         ratio=("ratio", "median"), idle_frac=("idle_frac", "median"),
                                         idle_s=("idle_s", "median"), loop_idle=("loop_idle", "median"),
                                         busy_s=("busy_s", "median"), steps=("step", "count")).reindex(variants)
    lines = [f"same global batches in both variants: {same}",
             "| variant | median step (s) | predicted (s) | measured / predicted | idle fraction | idle (rank-s) | "
             "idle inside the pipeline | compute (rank-s) | steps |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in table.iterrows():
        lines.append(f"| {name} | {row.step_s:.3f} | {row.predicted_s:.3f} | {row.ratio:.3f} | {row.idle_frac:.1%} | "
                     f"{row.idle_s:.3f} | {row.loop_idle:.1%} | {row.busy_s:.3f} | {int(row.steps)} |")
    measured = frame.pivot(index="step", columns="variant", values="step_s")
    predicted = frame.pivot(index="step", columns="variant", values="predicted_step_s")
    lines.append(f"1f1b / {other} step: {(measured['1f1b'] / measured[other]).median():.3f} measured, "
                 f"{(predicted['1f1b'] / predicted[other]).median():.3f} predicted (medians of per-batch ratios)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=SCHEDULES, default="interleaved", help="the schedule run against 1f1b")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks per rank (v; interleaved only)")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=[k for k, v in LAYOUTS.items() if v[1] > 1], default="colocated-pp2")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench/interleaved"))
    parser.add_argument("--costmodel", help="costmodel.json (default: profile + fit the preset here)")
    parser.add_argument("--analytic", action="store_true", help="the FLOP-count stand-in cost model")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    from dflop.models.info import model_info

    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    manifest, shapes, costmodel = prepare(out, args.samples, args.preset, args.costmodel, args.analytic)
    info = model_info(*PRESETS[args.preset])
    variants = plans(args.layout, info.vision_layers, info.llm_layers, args.chunks, args.microbatches, args.batch,
                     args.schedule)
    config = {"run": {"seed": args.seed}, "model": model_section(args.preset),
              "data": {"datasets": [{"name": "demo", "path": str(manifest)}]},
              "train": {"global_batch_size": args.batch, "lr": 1e-4, "warmup_steps": 0},
              "scheduler": {"budget_ms": 50.0, "prefetch": 2}}
    spec = {"config": config, "shapes": str(shapes), "costmodel": costmodel, "steps": args.steps,
            "warmup": args.warmup, "plans": variants, "result": str(out / "steps.json")}
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    started = time.perf_counter()
    world = variants["1f1b"]["world_size"]
    launch_workers(Path(__file__), out / "spec.json", world)
    rows = json.loads((out / "steps.json").read_text())
    other = variants[args.schedule]["llm"]
    chunks = f", v={args.chunks}" if args.schedule == "interleaved" else ""
    print(f"{args.preset} model, {world} ranks ({LAYOUTS[args.layout][3]}), batch {args.batch}, {args.microbatches} "
          f"microbatches, LLM layers {variants['1f1b']['llm']['layers_per_stage']} (1f1b) / "
          f"{other['layers_per_stage']} ({args.schedule}{chunks})"
          f", cost model "
          f"{'analytic' if costmodel is None else costmodel}; {args.steps} measured steps after {args.warmup} "
          f"warm-up, {time.perf_counter() - started:.0f} s")
    print(summarize(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
