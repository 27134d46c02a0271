"""torchrun entry point of the model profiler for one TP degree (one process per rank).

    python -m torch.distributed.run --standalone --nproc-per-node WORLD \\
        -m dflop.profiling.model_tp_worker --job JSON --out rows.parquet

WORLD is a multiple of the job's TP degree: ranks ``[g * tp, (g + 1) * tp)`` form TP group g, and
the groups beyond the first are co-runners that load the machine as training ranks would
(`dflop.profiling.model_profiler`). `profile_model` builds the job and reads the rows back; rank 0
writes them.
"""

from __future__ import annotations

import argparse
import json

import pandas as pd
import torch.distributed as dist

from dflop.io import atomic_path
from dflop.models.tensor_parallel import TPGroup
from dflop.profiling.model_profiler import COLUMNS, profile_rank
from dflop.runtime.process_group import end_worker


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="JSON job built by profile_model")
    parser.add_argument("--out", required=True, help="Parquet file rank 0 writes its rows to")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    job = json.loads(args.job)

    dist.init_process_group("nccl" if job["device"] == "cuda" else "gloo")
    try:
        rank, world, size = dist.get_rank(), dist.get_world_size(), job["tp"]
        if world % size:
            raise SystemExit(f"job is for TP={size} but {world} ranks were launched (not a multiple)")
        # every rank creates every group (torch.distributed's rule), then uses its own
        groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(world // size)]
        tp = TPGroup(rank=rank % size, size=size, group=None if world == size else groups[rank // size])
        rows = profile_rank(job, progress=args.progress, tp=tp)
        if rank == 0:
            with atomic_path(args.out) as tmp:
                pd.DataFrame(rows, columns=list(COLUMNS)).to_parquet(tmp, index=False)
    except BaseException:
        dist.destroy_process_group()
        raise


if __name__ == "__main__":
    main()
    end_worker()  # barrier, destroy the group, os._exit: gloo's threads outlive the group (see end_worker)
