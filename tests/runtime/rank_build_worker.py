"""Under torchrun: each rank builds its tensor-parallel modules and reports what its full model holds.

Writes <out>/rank<r>.json: the elements of this rank's parameters (local shards), of the real
parameters its full model still registers (beyond the untrained ones), and the parameters whose
gathered value differs from the whole model built in one process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dflop.config import Config
from dflop.models.builder import build_model
from dflop.models.handle import ModelHandle
from dflop.plan import plan_from_dict
from dflop.runtime.model import build_rank_modules, parameter_names
from dflop.runtime.process_group import end_worker, init_distributed
from dflop.runtime.topology import Topology

from trainer_reference import MODELS, config_dict


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def main() -> int:
    torch.set_num_threads(1)
    out, arch = Path(sys.argv[1]), sys.argv[2]
    pp = int(sys.argv[3]) if len(sys.argv) > 3 else 1  # LLM pipeline stages (tp = world / pp)
    init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = world // pp
    plan = plan_from_dict({"vision": {"tp": tp, "pp": 1, "dp": 1, "layers_per_stage": [2]},
                           "llm": {"tp": tp, "pp": pp, "dp": 1, "layers_per_stage": [2 // pp] * pp},
                           "placement": "colocated", "microbatches": 1, "global_batch_size": 1,
                           "world_size": world}, "plan.yaml").plan
    topo = Topology(plan, rank, world)
    topo.create_groups()
    handle = ModelHandle.resolve(Config.from_dict(config_dict(arch, "unused.jsonl")).model)
    modules = build_rank_modules(topo, handle, seed=0)
    mine = {id(p) for p in modules.parameters()}
    untrained = {"model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"}
    beyond = {n: _local(p).numel() for n, p in modules.full.named_parameters()
              if not p.is_meta and id(p) not in mine and n not in untrained}
    whole = dict(build_model(arch, *MODELS[arch], seed=0).named_parameters(remove_duplicate=False))
    names = parameter_names(modules)
    differ = [names[id(p)] for p in modules.parameters()
              if not torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, whole[names[id(p)]])]
    (out / f"rank{rank}.json").write_text(json.dumps({
        "held": sum(_local(p).numel() for p in modules.parameters()), "beyond": beyond, "differ": differ,
        "whole": sum({id(p): p.numel() for n, p in whole.items() if n not in untrained}.values())}))
    return 0


if __name__ == "__main__":
    end_worker(main())  # barrier, destroy the group, os._exit (see end_worker)
