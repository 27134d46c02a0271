"""torchrun worker for test_pipeline_equivalence.py: global batches through the real trainer.

Runs several cases in one launch (imports and process start dominate on CPU). Per case, rank 0's
scheduler (the case's policy) partitions the batch; with ``shuffle_seed`` the microbatch execution
order is then permuted. Every rank runs the trainer's forward/backward and gradient
synchronisation (no optimizer step) and writes the gradients it holds, under the full model's
parameter names, to ``<case>/grads_rank<r>.safetensors`` with a JSON sidecar naming each tensor's
shard (its offset and shape in the global tensor); rank 0 also writes the loss and the batch rows.

    python -m torch.distributed.run --nproc-per-node N grad_worker.py CASES.json
    CASES.json: {"shapes": ..., "manifest": ..., "cases": [{"name", "out", "plan", "config",
                 "overrides", "shuffle_seed"}, ...]}
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dflop.config import Config
from dflop.models.recompute import attention_module
from dflop.models.tensor_parallel import local_tensor
from dflop.plan import plan_from_dict
from dflop.runtime.agreement import rank0_result
from dflop.shapes import read_shapes
from dflop.data.training import pool_samples
from dflop.runtime.process_group import end_worker, init_distributed
from dflop.runtime.settings import TrainSettings
from dflop.runtime.trainer import Trainer


def run_case(case: dict, shapes: str, manifest: str, device: torch.device) -> None:
    raw = dict(case["config"])
    raw["data"] = {"datasets": [{"name": "demo", "path": manifest}]}
    settings = TrainSettings.from_config(Config.from_dict(raw), **case.get("overrides", {}))
    plan = plan_from_dict(case["plan"], f"case {case['name']}").plan
    pool = read_shapes(shapes)
    trainer = Trainer(settings, plan, pool, pool_samples(pool, settings.datasets, settings.seed), device=device)
    def first_plan():
        step_plan = trainer.planner.get(0)
        if case.get("shuffle_seed") is not None:
            order = np.random.default_rng(case["shuffle_seed"]).permutation(step_plan.n_microbatches)
            step_plan = dataclasses.replace(step_plan, bins=tuple(step_plan.bins[k] for k in order),
                                            vision_shares=tuple(step_plan.vision_shares[k] for k in order),
                                            microbatch_ids=tuple(step_plan.microbatch_ids[k] for k in order))
        return step_plan

    step_plan = rank0_result(first_plan)
    stats = trainer.compute_gradients(step_plan, trainer.load(step_plan).result())
    out = Path(case["out"])
    out.mkdir(parents=True, exist_ok=True)
    grads, shards = {}, {}
    for param, info in trainer.param_infos.items():
        key = f"{info.name}@{len(grads)}"
        grads[key] = local_tensor(param.grad).detach().contiguous().clone()
        if isinstance(param, DTensor) and any(p.is_shard() for p in param.placements):  # TP and/or FSDP shard
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            shards[key] = {"offset": list(offset), "shape": list(shape)}
    save_file(grads, out / f"grads_rank{trainer.rank}.safetensors")
    (out / f"shards_rank{trainer.rank}.json").write_text(json.dumps(shards))
    # what this rank's stages recompute, and the attention function their layers call
    # (one entry per LLM model chunk: its virtual stage indexes the plan's recompute list)
    stages = [("vision", trainer.topo.vision_role.stage, trainer.modules.vision)] if trainer.modules.vision else []
    if trainer.topo.llm_role is not None:
        stages += [("llm", c, chunk) for c, chunk in zip(trainer.topo.rank_chunks(trainer.topo.llm_role),
                                                           trainer.modules.llm_chunks)]
    recompute = [[part, index, stage.recompute, [attention_module(layer).config._attn_implementation
                                                 for layer in stage.layers]] for part, index, stage in stages]
    (out / f"recompute_rank{trainer.rank}.json").write_text(json.dumps(recompute))
    overlapped = torch.tensor(trainer.sync.overlapped_buckets)
    dist.all_reduce(overlapped)  # buckets started during the last backward, over all ranks
    if trainer.rank == 0:
        (out / "result.json").write_text(json.dumps({
            "loss": stats["loss"], "n_answer": stats["n_answer"], "rows": list(step_plan.rows),
            "overlapped_buckets": int(overlapped),
            "bins": step_plan.bins, "vision_shares": step_plan.vision_shares, "member": step_plan.member}))
    trainer.close()


def main() -> int:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    device = init_distributed("cpu")
    for case in spec["cases"]:
        run_case(case, case["shapes"] if "shapes" in case else spec["shapes"], spec["manifest"], device)
        dist.barrier()
    return 0


if __name__ == "__main__":
    end_worker(main())  # barrier, destroy the group, os._exit (see end_worker)
