"""Training-state bytes held per rank with and without ``shard_optimizer`` (FSDP2, ZeRO-2), measured
against the cost model's `training_state_bytes`.

    python benchmarks/bench_sharding.py [--preset small] [--steps 2] [--warmup 1] [--batch 4]
        [--microbatches 2] [--tp 1] [--out-dir results/bench/sharding]

Two data-parallel replicas (colocated: each rank runs the vision tower and the whole LLM, or its
1/tp shard with ``--tp``; gloo, one torch thread per rank) of the `bench_costmodel.py` preset on the demo data, float32. Every rank
holds two trainers with the same seed, plan and global batches, ``shard_optimizer`` off and on
(both modules), and runs them in turn on each batch. Measured per rank, after the warm-up (AdamW
state exists): the bytes of the distinct storages of parameters (the stages' registered ones, and
the sharded ones the optimizer holds), their gradients and the optimizer state
(`dflop.profiling._memory.held_bytes`), at the peak of the step (end of the pipeline, before the
gradient reduction) and between steps (after the optimizer step); predicted: the rank's parameter
count times `training_state_bytes("float32", shard_over=dp)` (peak) and, between steps, that of the
shards alone. Also printed: the median step and the largest difference of the two variants'
parameters after the last step (the same maths: only where the state lives differs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_trainer import colocated_variants_parser, run_colocated_dp2, timed_step, worker_inputs  # noqa: E402

VARIANTS = ("unsharded", "sharded")


def held_state(trainer) -> int:
    """Bytes this rank holds for parameters, gradients and optimizer state (see module docstring)."""
    import torch

    from dflop.profiling._memory import held_bytes

    stages = [m for m in (trainer.modules.vision, trainer.modules.llm) if m is not None]
    registered = [p for m in stages for p in m.parameters()]
    tensors = registered + [p.grad for p in registered]
    tensors += list(trainer.param_infos) + [p.grad for p in trainer.param_infos]
    if trainer.optimizer is not None:
        tensors += [v for state in trainer.optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
    return held_bytes(tensors)


def worker(spec_path: str) -> int:
    """One rank: two trainers (shard_optimizer off / on), run in turn on the same batches."""
    import torch.distributed as dist

    from dflop.costmodel.memory import training_state_bytes
    from dflop.models.tensor_parallel import local_tensor
    from dflop.plan import plan_from_dict
    from dflop.data.training import pool_samples
    from dflop.runtime.settings import TrainSettings
    from dflop.runtime.trainer import Trainer

    spec, device, cfg, pool = worker_inputs(spec_path)
    n_steps = spec["warmup"] + spec["steps"]
    settings = TrainSettings.from_config(cfg, steps=n_steps)
    trainers = {}
    for name in VARIANTS:
        raw = json.loads(json.dumps(spec["plan"]))
        for module in ("vision", "llm"):
            raw[module]["shard_optimizer"] = name == "sharded"
        plan = plan_from_dict(raw, f"benchmark plan ({name})").plan
        trainers[name] = Trainer(settings, plan, pool, pool_samples(pool, settings.datasets, settings.seed),
                                 device=device)
    dp = spec["plan"]["llm"]["dp"]
    # this rank's parameters as unsharded (a TP shard's local part): what the prediction multiplies
    n_params = sum(local_tensor(t).numel() for t in trainers["unsharded"].rank_params.tensors.values())
    rows = []
    for step in range(n_steps):
        for name in VARIANTS[step % 2:] + VARIANTS[:step % 2]:
            trainer = trainers[name]
            peak = {}
            reduce = trainer.sharding.reduce

            def measured_reduce(trainer=trainer, reduce=reduce, peak=peak):
                peak["bytes"] = held_state(trainer)  # end of the pipeline: gradients accumulated, not reduced
                reduce()

            trainer.sharding.reduce = measured_reduce
            step_plan = trainer.next_plan(step)
            stats, step_s, _, _ = timed_step(trainer, step_plan)
            trainer.sharding.reduce = reduce
            shard_over = dp if name == "sharded" else 1
            row = {"variant": name, "step": step, "warmup": step < spec["warmup"], "rank": dist.get_rank(),
                   "n_params": n_params, "step_s": step_s, "loss": stats["loss"],
                   "peak_bytes": peak["bytes"], "between_bytes": held_state(trainer),
                   "predicted_peak": n_params * training_state_bytes("float32", shard_over).total,
                   "predicted_between": n_params * training_state_bytes("float32").total / shard_over}
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, row)
            rows += gathered
    # The same maths: the two variants' parameters after the last step.
    diff = 0.0
    plain = {n: t for n, t in trainers["unsharded"].rank_params.tensors.items()}
    for name, tensor in trainers["sharded"].rank_params.tensors.items():
        full, ref = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (tensor, plain[name]))
        diff = max(diff, (full.detach() - ref.detach()).abs().max().item())
    diffs = [None] * dist.get_world_size()
    dist.all_gather_object(diffs, diff)
    if dist.get_rank() == 0:
        Path(spec["result"]).write_text(json.dumps({"rows": rows, "max_param_diff": max(diffs), "dp": dp}))
    for trainer in trainers.values():
        trainer.close()
    dist.destroy_process_group()
    return 0


def summarize(result: dict) -> str:
    import pandas as pd

    frame = pd.DataFrame([r for r in result["rows"] if not r["warmup"]])
    table = frame.groupby(["variant", "rank"]).agg(
        n_params=("n_params", "first"), peak=("peak_bytes", "max"), predicted_peak=("predicted_peak", "first"),
        held_between=("between_bytes", "max"), predicted_between=("predicted_between", "first"),
        step_s=("step_s", "median")).reindex(list(VARIANTS), level=0)
    mib = 2 ** 20
    lines = ["| variant | rank | parameters | peak held (MiB) | predicted | error | between steps (MiB) | "
             "predicted | error | median step (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (name, rank), r in table.iterrows():
        lines.append(f"| {name} | {rank} | {r.n_params / 1e6:.2f} M | {r.peak / mib:.1f} | {r.predicted_peak / mib:.1f} "
                     f"| {100 * (r.peak / r.predicted_peak - 1):+.1f} % | {r.held_between / mib:.1f} | "
                     f"{r.predicted_between / mib:.1f} | {100 * (r.held_between / r.predicted_between - 1):+.1f} % "
                     f"| {r.step_s:.3f} |")
    lines.append(f"dp = {result['dp']}; largest parameter difference sharded vs unsharded after the last step: "
                 f"{result['max_param_diff']:.2g}")
    return "\n".join(lines)


def main() -> int:
    parser = colocated_variants_parser(__doc__.splitlines()[0], steps=2, out_dir="results/bench/sharding")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism of both modules (world 2 tp)")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    print(summarize(run_colocated_dp2(Path(__file__), args, tp=args.tp, dtype="float32")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
