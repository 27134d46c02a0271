"""torchrun worker for test_p2p.py: one global batch through the real trainer (`grad_worker.run_case`),
recording this rank's pipeline messages.

Per case, ``<case>/p2p_rank<r>.json`` lists in order the executor's ops (``["op", kind, position]``,
as each starts) and every ``torch.distributed.batch_isend_irecv`` call (``["batch", [[op, peer,
tag, shape], ...]]``, op "isend" or "irecv", shape the tensor actually sent or the buffer posted).

    python -m torch.distributed.run --nproc-per-node N p2p_worker.py CASES.json  (grad_worker's format)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dflop.runtime import schedule
from dflop.runtime.process_group import end_worker, init_distributed
from grad_worker import run_case

EVENTS: list = []


def _record() -> None:
    batch = dist.batch_isend_irecv

    def batched(ops):
        EVENTS.append(["batch", [[op.op.__name__, op.peer, op.tag, list(op.tensor.shape)] for op in ops]])
        return batch(ops)

    dist.batch_isend_irecv = batched
    executor = schedule.PipelineExecutor
    for kind, name in (("F", "_forward"), ("B", "_backward")):
        def op(self, k, p, received, _run=getattr(executor, name), _kind=kind):
            EVENTS.append(["op", _kind, p])
            return _run(self, k, p, received)

        setattr(executor, name, op)


def main() -> int:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    device = init_distributed("cpu")
    _record()
    for case in spec["cases"]:
        EVENTS.clear()
        run_case(case, case["shapes"], spec["manifest"], device)
        (Path(case["out"]) / f"p2p_rank{dist.get_rank()}.json").write_text(json.dumps(EVENTS))
        dist.barrier()
    return 0


if __name__ == "__main__":
    end_worker(main())  # barrier, destroy the group, os._exit (see end_worker)
