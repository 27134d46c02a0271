"""Measured step time and pipeline idle time: data-blind baseline vs the DFLOP policy, one pipeline.

    python benchmarks/bench_trainer.py [--preset tiny|small] [--layout pp2] [--steps 8] [--warmup 2]
        [--batch 16] [--microbatches 4] [--out-dir results/bench/trainer] [--costmodel PATH | --analytic]

The demo dataset (300 samples) on a real pipeline of 2-3 ranks (`--layout`; default: vision tower
on rank 0, the LLM in two pipeline stages on ranks 1-2; gloo, one torch thread per rank), LLaVA-OV
model of the `bench_costmodel.py` preset (tiny: 2 + 2 layers; small: 6 + 8 layers). Every rank
holds three trainers with the same seed and the same global batches, and runs them in turn on
each batch (rotating which goes first), so all three see the same machine load:

- ``baseline-pad``: fixed sample count per microbatch in batch order, uniform layer split, every
  sample padded to the longest of its bin (what the LLaVA / HF trainers do);
- ``baseline``: the same split, samples packed;
- ``dflop``: the online scheduler's portfolio on the fitted cost model, and the layer split with
  the best predicted step on the data (enumerated with the cost model over sampled batches).

Step time = forward + backward of all microbatches + gradient sync + optimizer, between two
barriers (data loading excluded: it is prefetched in training). Idle fraction = 1 - (compute
seconds of all ranks) / (ranks x step). The cost model is fitted on this CPU with the model
profiler (thread CPU time; `bench_costmodel.py`), unless given or --analytic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_costmodel import PRESETS  # noqa: E402  (the presets the cost-model benchmark fits)

VARIANTS = ("baseline-pad", "baseline", "dflop")


def model_section(preset: str) -> dict:
    arch, vision, llm = PRESETS[preset]
    return {"arch": arch, "vision": vision, "llm": llm}


def prepare(out: Path, n_samples: int, preset: str, costmodel: str | None,
            analytic: bool) -> tuple[Path, Path, str | None]:
    """Demo data, its shapes for the preset's vision tower and a cost model (made once, reused)."""
    from dflop.config import Config
    from dflop.data.demo import make_demo_data
    from dflop.profiling.data_profiler import profile_data

    manifest = out / "demo" / "demo.json"
    if not manifest.exists():
        make_demo_data(out / "demo", n_samples=n_samples, seed=0)
    shapes = out / preset / "shapes.parquet"
    if not shapes.exists():
        shapes.parent.mkdir(parents=True, exist_ok=True)
        cfg = Config.from_dict({"model": model_section(preset),
                                "data": {"datasets": [{"name": "demo", "path": str(manifest)}]}})
        profile_data(cfg, shapes_path=shapes, histograms_path=shapes.parent / "histograms.parquet", workers=1,
                     progress=False)
    if analytic:
        return manifest, shapes, None
    if costmodel is None:
        costmodel = str(out / "costmodel" / preset / "costmodel.json")
        if not Path(costmodel).exists():
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_costmodel.py"), "--presets", preset,
                            "--timer", "thread-cpu", "--time-budget-s", "60", "--out-dir", str(out / "costmodel")],
                           check=True)
    return manifest, shapes, costmodel


# name: (placement, LLM pp, LLM dp, what the ranks run)
LAYOUTS = {
    "pp2": ("disjoint", 2, 1, "vision | LLM stage 0 | LLM stage 1"),
    "dp2": ("disjoint", 1, 2, "vision | LLM replica 0 | LLM replica 1"),
    "vision-llm": ("disjoint", 1, 1, "vision | LLM"),
    "colocated-pp2": ("colocated", 2, 1, "vision + LLM stage 0 | LLM stage 1"),
    "colocated-dp2": ("colocated", 1, 2, "vision + LLM replica 0 | vision + LLM replica 1"),
}


def plan_dict(layout: str, vision_layers: int, llm_layers: list[int], microbatches: int, batch: int) -> dict:
    placement, pp, dp, _ = LAYOUTS[layout]
    world = pp * dp + (1 if placement == "disjoint" else 0)
    return {"vision": {"tp": 1, "pp": 1, "dp": 1 if placement == "disjoint" else dp,
                       "layers_per_stage": [vision_layers]},
            "llm": {"tp": 1, "pp": pp, "dp": dp, "layers_per_stage": llm_layers},
            "placement": placement, "microbatches": microbatches, "global_batch_size": batch, "world_size": world}


def splits(layout: str, n_layers: int) -> list[list[int]]:
    """Candidate LLM layer splits (the uniform one, the baseline's, first)."""
    if LAYOUTS[layout][1] == 1:
        return [[n_layers]]
    half = n_layers // 2
    return [[half, n_layers - half]] + [[k, n_layers - k] for k in range(n_layers + 1) if k != half]


def compute_cost_model(path: str | None):
    """The cost model at `path` (None: None, the trainer's stand-in) without its sample-load line:
    the timed step excludes loading (module docstring), so the split, the partitions and the
    predictions price compute alone, or they would charge loads the measurement leaves out."""
    from dflop.costmodel.jsonio import load_cost_model

    if path is None:
        return None
    cost = load_cost_model(path)
    cost.step_costs = dataclasses.replace(cost.step_costs, loading=None)
    return cost


def choose_split(config: dict, shapes: Path, costmodel: str | None, microbatches: int, batch: int, seed: int,
                 layout: str, vision_layers: int, llm_layers: int) -> list[int]:
    """The LLM layer split with the best mean predicted step over sampled batches (the plan),
    priced as the trainer prices (`training_pricing`)."""
    from dflop.config import Config
    from dflop.models.handle import ModelHandle
    from dflop.plan import plan_from_dict
    from dflop.pricing.cluster import Cluster
    from dflop.planner.expected import run_partition
    from dflop.scheduler.settings import SchedulerSettings
    from dflop.pricing.pool import Pool
    from dflop.scheduler.greedy import MemoryGuardError
    from dflop.scheduler.online import GlobalBatches
    from dflop.runtime.settings import TrainSettings
    from dflop.runtime.trainer import training_pricing
    from dflop.shapes import read_shapes

    cfg = Config.from_dict(config)
    settings, model = TrainSettings.from_config(cfg), ModelHandle.resolve(cfg.model)
    cost = compute_cost_model(costmodel)
    pool = read_shapes(shapes)
    batches = GlobalBatches(len(pool), batch, seed)
    best = None
    for split in splits(layout, llm_layers):
        plan = plan_from_dict(plan_dict(layout, vision_layers, split, microbatches, batch)).plan
        pricing = training_pricing(plan, model, cost, Cluster.from_section(settings.cluster))
        try:
            steps = [run_partition(pricing.batch(Pool.from_shapes(pool.iloc[batches.rows(s)])), pricing,
                                   SchedulerSettings.planning()).step_s for s in range(8)]
        except MemoryGuardError:  # some sampled batch does not fit this split's stages: not a plan
            continue
        if best is None or np.mean(steps) < best[0]:
            best = (float(np.mean(steps)), split)
    if best is None:
        raise SystemExit(f"no LLM layer split of the {layout} layout fits every sampled batch in "
                         f"cluster.gpu_memory_gb = {settings.cluster.gpu_memory_gb} per rank")
    return best[1]


def launch_workers(script: Path, spec: Path, world: int) -> None:
    """`world` ranks of ``script --worker spec`` under torchrun (gloo on CPU, one thread each)."""
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                    str(script.resolve()), "--worker", str(spec)], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


def run_colocated_variants(script: Path, out: Path, args, manifest, shapes, plan: dict, model: dict) -> dict:
    """Write the spec of a two-variant worker benchmark (`args`: seed, batch, steps, warmup), run
    `script`'s workers on `plan`'s world size and return what rank 0 wrote (``result.json``)."""
    spec = {"config": {"run": {"seed": args.seed}, "model": model,
                       "data": {"datasets": [{"name": "demo", "path": str(manifest)}]},
                       "train": {"global_batch_size": args.batch, "lr": 1e-4, "warmup_steps": 0},
                       "scheduler": {"prefetch": 2}},
            "shapes": str(shapes), "plan": plan, "steps": args.steps, "warmup": args.warmup,
            "result": str(out / "result.json")}
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    launch_workers(script, out / "spec.json", plan["world_size"])
    return json.loads((out / "result.json").read_text())


def colocated_variants_parser(description: str, *, steps: int, out_dir: str) -> argparse.ArgumentParser:
    """The options of a two-variant worker benchmark on 2 colocated data-parallel replicas of a preset
    (`run_colocated_dp2`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=Path(out_dir))
    return parser


def run_colocated_dp2(script: Path, args, *, tp: int = 1, dtype: str | None = None) -> dict:
    """Demo data and a plan of 2 colocated data-parallel replicas of `tp` ranks for `args.preset`,
    then `run_colocated_variants`; prints what ran and how long it took."""
    from dflop.models.info import model_info

    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    manifest, shapes, _ = prepare(out, args.samples, args.preset, None, analytic=True)
    info = model_info(*PRESETS[args.preset])
    plan = plan_dict("colocated-dp2", info.vision_layers, [info.llm_layers], args.microbatches, args.batch)
    plan["vision"]["tp"] = plan["llm"]["tp"] = tp
    plan["world_size"] *= tp
    model = {**model_section(args.preset), **({"dtype": dtype} if dtype else {})}
    started = time.perf_counter()
    result = run_colocated_variants(script, out, args, manifest, shapes, plan, model)
    print(f"{args.preset} model, 2 colocated data-parallel replicas{f' of tp {tp}' if tp > 1 else ''}, batch "
          f"{args.batch}, {args.microbatches} microbatches; {args.steps} measured steps after {args.warmup} warm-up, "
          f"{time.perf_counter() - started:.0f} s")
    return result


def worker_inputs(spec_path: str):
    """What every benchmark worker starts from: (spec, device, config, shapes pool), with the
    process group initialised and one torch thread per rank."""
    import torch

    from dflop.config import Config
    from dflop.runtime.process_group import init_distributed
    from dflop.shapes import read_shapes

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    device = init_distributed("cpu")
    return spec, device, Config.from_dict(spec["config"]), read_shapes(spec["shapes"])


def timed_step(trainer, plan):
    """One measured step of `plan` (its samples loaded first, untimed): (gradient stats, wall
    seconds between barriers, every rank's busy times (rank 0), the slowest rank's pipeline seconds)."""
    import torch
    import torch.distributed as dist

    loaded = trainer.load(plan).result()
    dist.barrier()
    t0 = time.perf_counter()
    stats = trainer.compute_gradients(plan, loaded)
    trainer.optimizer_step()
    dist.barrier()
    step_s = time.perf_counter() - t0
    times = trainer.gather_times(stats["result"])
    pipeline = [torch.zeros(1, dtype=torch.float64) for _ in range(trainer.world)]
    dist.all_gather(pipeline, torch.tensor([stats["pipeline_s"]], dtype=torch.float64))
    return stats, step_s, times, max(float(t) for t in pipeline)


def worker(spec_path: str) -> int:
    """One rank: three trainers, run in turn on the same batches."""
    import torch
    import torch.distributed as dist

    from dflop.plan import plan_from_dict
    from dflop.data.training import pool_samples
    from dflop.runtime.settings import TrainSettings
    from dflop.runtime.trainer import Trainer

    spec, device, cfg, pool = worker_inputs(spec_path)
    cost = compute_cost_model(spec["costmodel"])
    trainers = {}
    for name in VARIANTS:
        policy = "dflop" if name == "dflop" else "baseline"
        settings = TrainSettings.from_config(cfg, policy=policy, pad_to_longest=name == "baseline-pad",
                                             steps=spec["steps"] + spec["warmup"])
        plan = plan_from_dict(spec["plans"][name], f"{name} plan").plan
        trainers[name] = Trainer(settings, plan, pool, pool_samples(pool, settings.datasets, settings.seed),
                                 cost=cost, device=device)
    n_steps = spec["warmup"] + spec["steps"]
    plans = {}
    if not spec["live_scheduler"]:
        # Solve every batch first: on this CPU the scheduler's thread would take cycles and the GIL
        # from rank 0's compute, which on a GPU node it does not. Its solve time is reported.
        from dflop.runtime.agreement import rank0_result

        for name in VARIANTS:
            planner = trainers[name].planner
            for step in range(n_steps):
                plans[(name, step)] = rank0_result(lambda: planner.get(step, timeout_s=30.0))
    rows = []
    for step in range(n_steps):
        order = VARIANTS[step % 3:] + VARIANTS[:step % 3]
        for name in order:
            trainer = trainers[name]
            plan = plans[(name, step)] if plans else trainer.next_plan(step)
            stats, step_s, times, pipeline_s = timed_step(trainer, plan)
            if trainer.rank == 0:
                rows.append({"variant": name, "step": step, "warmup": step < spec["warmup"], "step_s": step_s,
                             "busy_s": float(times.sum()),
                             "idle_frac": float(1 - times.sum() / (trainer.world * step_s)),
                             "busy_per_rank": times.sum(axis=(1, 2)).tolist(), "loss": stats["loss"],
                             "pipeline_s": pipeline_s,
                             "predicted_step_s": plan.predicted_step_s, "member": plan.member,
                             "sched_ms": plan.sched_s * 1e3,
                             "tokens": int(sum(plan.seq_len)), "tiles": int(sum(plan.n_tiles))})
    if dist.get_rank() == 0:
        Path(spec["result"]).write_text(json.dumps(rows))
    for trainer in trainers.values():
        trainer.close()
    dist.destroy_process_group()
    return 0


def summarize(rows: list[dict]) -> str:
    """The markdown table of the measured steps, with each variant's prediction beside them (issue 21:
    the step model is held to the measured step per variant, and the predicted speed-up to the
    measured one). Each step's prediction is its own partition simulated with the cost model
    (`StepPlan.predicted_step_s`); medians over the measured steps, ratios per batch."""
    import pandas as pd

    frame = pd.DataFrame([r for r in rows if not r["warmup"]])
    world = len(frame["busy_per_rank"].iloc[0])
    frame["pipeline_idle"] = 1 - frame["busy_s"] / (world * frame["pipeline_s"])
    frame["measured_over_predicted"] = frame["step_s"] / frame["predicted_step_s"]
    table = frame.groupby("variant").agg(step_s=("step_s", "median"), idle_frac=("idle_frac", "median"),
                                         sched_ms=("sched_ms", "median"),
                                         pipeline_idle=("pipeline_idle", "median"), busy_s=("busy_s", "median"),
                                         predicted_s=("predicted_step_s", "median"),
                                         ratio=("measured_over_predicted", "median"),
                                         steps=("step", "count")).reindex(list(VARIANTS))
    paired = frame.pivot(index="step", columns="variant", values="step_s")
    predicted = frame.pivot(index="step", columns="variant", values="predicted_step_s")
    lines = ["| variant | median step (s) | predicted (s) | measured / predicted | idle fraction | "
             "idle inside the 1F1B loop | compute (rank-s) | scheduler solve (ms) | steps |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in table.iterrows():
        lines.append(f"| {name} | {row.step_s:.3f} | {row.predicted_s:.3f} | {row.ratio:.3f} | {row.idle_frac:.1%} | "
                     f"{row.pipeline_idle:.1%} | {row.busy_s:.3f} | {row.sched_ms:.0f} | {int(row.steps)} |")
    for base in ("baseline", "baseline-pad"):
        ratio = (paired[base] / paired["dflop"]).median()
        predicted_ratio = (predicted[base] / predicted["dflop"]).median()
        idle_cut = 1 - table.loc["dflop", "idle_frac"] / table.loc[base, "idle_frac"]
        loop_cut = 1 - table.loc["dflop", "pipeline_idle"] / table.loc[base, "pipeline_idle"]
        lines.append(f"dflop vs {base}: speed-up {ratio:.2f}x measured, {predicted_ratio:.2f}x predicted "
                     f"(medians of per-batch ratios; measured / predicted {ratio / predicted_ratio:.3f}), "
                     f"idle time cut by {idle_cut:.0%} (inside the loop: {loop_cut:.0%})")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="pp2", help="the ranks' grid (same for all variants)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="model (bench_costmodel.py presets)")
    parser.add_argument("--budget-ms", type=float, default=50.0, help="scheduler ILP budget per batch")
    parser.add_argument("--live-scheduler", action="store_true",
                        help="solve while training (its thread shares rank 0's CPU) instead of before")
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench/trainer"))
    parser.add_argument("--costmodel", help="costmodel.json (default: profile + fit the preset here)")
    parser.add_argument("--analytic", action="store_true",
                        help="use the FLOP-count stand-in cost model (dflop.costmodel.analytic)")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from dflop.models.info import model_info

    manifest, shapes, costmodel = prepare(out, args.samples, args.preset, args.costmodel, args.analytic)
    info = model_info(*PRESETS[args.preset])
    config = {"run": {"seed": args.seed}, "model": model_section(args.preset),
              "data": {"datasets": [{"name": "demo", "path": str(manifest)}]},
              "train": {"global_batch_size": args.batch, "lr": 1e-4, "warmup_steps": 0},
              "scheduler": {"budget_ms": args.budget_ms, "prefetch": 2}}
    split = choose_split(config, shapes, costmodel, args.microbatches, args.batch, args.seed, args.layout,
                         info.vision_layers, info.llm_layers)
    uniform = plan_dict(args.layout, info.vision_layers, splits(args.layout, info.llm_layers)[0],
                        args.microbatches, args.batch)
    world = uniform["world_size"]
    spec = {"config": config,
            "shapes": str(shapes), "costmodel": costmodel, "steps": args.steps, "warmup": args.warmup,
            "live_scheduler": args.live_scheduler,
            "plans": {"baseline-pad": uniform, "baseline": uniform,
                      "dflop": plan_dict(args.layout, info.vision_layers, split, args.microbatches, args.batch)},
            "result": str(out / "steps.json")}
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    started = time.perf_counter()
    launch_workers(Path(__file__), out / "spec.json", world)
    rows = json.loads((out / "steps.json").read_text())
    print(f"{args.preset} model, {world} ranks ({LAYOUTS[args.layout][3]}), batch {args.batch}, "
          f"{args.microbatches} microbatches, "
          f"dflop LLM layer split {split}, cost model {'analytic' if costmodel is None else costmodel}; "
          f"{args.steps} measured steps after {args.warmup} warm-up, {time.perf_counter() - started:.0f} s")
    print(summarize(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
