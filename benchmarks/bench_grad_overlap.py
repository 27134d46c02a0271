"""Gradient all-reduce overlapped with the last backward vs started after the pipeline.

    python benchmarks/bench_grad_overlap.py [--preset small] [--steps 4] [--warmup 1] [--batch 4]
        [--microbatches 2] [--out-dir results/bench/grad_overlap]

Two data-parallel replicas (colocated: each rank runs the vision tower and the whole LLM; gloo, one
torch thread per rank) of the `bench_costmodel.py` preset on the demo data. Every rank holds two
trainers with the same seed, plan and global batches, ``train.overlap_grad_sync`` on and off, and
runs them in turn on each batch (rotating which goes first). Printed per variant: the median step
(gradients + sync + optimizer, between barriers) and the exposed synchronisation: on the rank
that finished its pipeline last (it waits for no replica), the time from the end of its pipeline
to synced gradients, the part of the all-reduce the overlap is meant to hide. Gradients of the
two variants are compared (they must agree: the same sums, only started earlier).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_trainer import colocated_variants_parser, run_colocated_dp2, worker_inputs  # noqa: E402

VARIANTS = ("after-pipeline", "overlapped")


def worker(spec_path: str) -> int:
    """One rank: two trainers (overlap off / on), run in turn on the same batches."""
    import torch
    import torch.distributed as dist

    from dflop.models.tensor_parallel import local_tensor
    from dflop.plan import plan_from_dict
    from dflop.data.training import pool_samples
    from dflop.runtime.settings import TrainSettings
    from dflop.runtime.trainer import Trainer

    spec, device, cfg, pool = worker_inputs(spec_path)
    plan = plan_from_dict(spec["plan"], "benchmark plan").plan
    n_steps = spec["warmup"] + spec["steps"]
    trainers = {}
    for name in VARIANTS:
        settings = TrainSettings.from_config(cfg, overlap_grad_sync=name == "overlapped", steps=n_steps)
        trainers[name] = Trainer(settings, plan, pool, pool_samples(pool, settings.datasets, settings.seed),
                                 device=device)
    rows, max_grad_diff = [], 0.0
    for step in range(n_steps):
        grads = {}
        for name in VARIANTS[step % 2:] + VARIANTS[:step % 2]:
            trainer = trainers[name]
            step_plan = trainer.next_plan(step)
            loaded = trainer.load(step_plan).result()
            dist.barrier()
            t0 = time.perf_counter()
            stats = trainer.compute_gradients(step_plan, loaded)
            gradients_s = time.perf_counter() - t0
            grads[name] = [local_tensor(p.grad).clone() for p in trainer.param_infos]
            trainer.optimizer_step()
            dist.barrier()
            step_s = time.perf_counter() - t0
            timings = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
            dist.all_gather(timings, torch.tensor([stats["pipeline_s"], gradients_s], dtype=torch.float64))
            # The rank that finished its pipeline last waits for nobody: what it spends after the
            # pipeline is the synchronisation's own tail (other ranks also wait for it).
            last_pipeline, last_gradients = max(t.tolist() for t in timings)
            if dist.get_rank() == 0:
                rows.append({"variant": name, "step": step, "warmup": step < spec["warmup"], "step_s": step_s,
                             "exposed_sync_s": last_gradients - last_pipeline,
                             "overlapped_buckets": trainer.sync.overlapped_buckets,
                             "buckets": len(trainer.sync._buckets), "loss": stats["loss"]})
        diffs = [(a - b).abs().max().item() for a, b in zip(*grads.values())]
        max_grad_diff = max(max_grad_diff, max(diffs))
    if dist.get_rank() == 0:
        Path(spec["result"]).write_text(json.dumps({"rows": rows, "max_grad_diff": max_grad_diff}))
    for trainer in trainers.values():
        trainer.close()
    dist.destroy_process_group()
    return 0


def summarize(result: dict) -> str:
    import pandas as pd

    frame = pd.DataFrame([r for r in result["rows"] if not r["warmup"]])
    table = frame.groupby("variant").agg(step_s=("step_s", "median"), exposed=("exposed_sync_s", "median"),
                                         overlapped=("overlapped_buckets", "median"), buckets=("buckets", "first"),
                                         steps=("step", "count")).reindex(list(VARIANTS))
    lines = ["| variant | median step (s) | exposed sync after the pipeline (s) | buckets started in backward | "
             "steps |", "|---|---|---|---|---|"]
    for name, row in table.iterrows():
        lines.append(f"| {name} | {row.step_s:.3f} | {row.exposed:.3f} | {row.overlapped:.0f} of {row.buckets:.0f} "
                     f"| {int(row.steps)} |")
    paired = frame.pivot(index="step", columns="variant", values="step_s")
    lines.append(f"overlapped vs after-pipeline: step ratio {(paired['after-pipeline'] / paired['overlapped']).median():.3f}"
                 f" (median of per-batch ratios); exposed sync {table.loc['after-pipeline', 'exposed']:.3f} s -> "
                 f"{table.loc['overlapped', 'exposed']:.3f} s; largest gradient difference "
                 f"{result['max_grad_diff']:.2g}")
    return "\n".join(lines)


def main() -> int:
    parser = colocated_variants_parser(__doc__.splitlines()[0], steps=4, out_dir="results/bench/grad_overlap")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    print(summarize(run_colocated_dp2(Path(__file__), args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
