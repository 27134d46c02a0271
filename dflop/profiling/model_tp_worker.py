"""torchrun entry point of the model profiler for one TP degree (one process per rank).

    python -m torch.distributed.run --standalone --nproc-per-node TP \\
        -m dflop.profiling.model_tp_worker --job JSON --out rows.parquet

`profile_model` builds the job and reads the rows back; rank 0 writes them.
"""

from __future__ import annotations

import argparse
import json

import pandas as pd
import torch.distributed as dist

from dflop.io import atomic_path
from dflop.models.tensor_parallel import TPGroup
from dflop.profiling.model_profiler import COLUMNS, profile_rank


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="JSON job built by profile_model")
    parser.add_argument("--out", required=True, help="Parquet file rank 0 writes its rows to")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    job = json.loads(args.job)

    dist.init_process_group("nccl" if job["device"] == "cuda" else "gloo")
    try:
        tp = TPGroup(rank=dist.get_rank(), size=dist.get_world_size())
        if tp.size != job["tp"]:
            raise SystemExit(f"job is for TP={job['tp']} but {tp.size} ranks were launched")
        rows = profile_rank(job, progress=args.progress, tp=tp)
        if tp.rank == 0:
            with atomic_path(args.out) as tmp:
                pd.DataFrame(rows, columns=list(COLUMNS)).to_parquet(tmp, index=False)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
