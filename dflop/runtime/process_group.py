"""The default process group: joining it (`init_distributed`: torchrun's, NCCL on CUDA, gloo on
CPU, or a world of one), and the helpers checkpointing and export use, all no-ops in one process
without a process group (tests, `read_checkpoint_model`), so the same code serves both."""

from __future__ import annotations

import logging
import os
import socket
import sys
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from dflop.cpu_memory import reuse_large_cpu_allocations
from dflop.errors import UserError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def device_type() -> str:
    """Device of collective buffers: CUDA under NCCL, else CPU."""
    return "cuda" if is_distributed() and "nccl" in str(dist.get_backend()).lower() else "cpu"


def collective_device() -> torch.device:
    """The device tensors must live on for collectives of the default process group."""
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if is_distributed():
        if device_type() == "cuda":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def broadcast_int(value: int) -> int:
    """Rank 0's value on every rank."""
    if not is_distributed():
        return value
    buf = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.broadcast(buf, src=0)
    return int(buf.item())


def init_distributed(device: str) -> torch.device:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU); a plain process is a world of 1."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("cluster.device is cuda but this machine has no CUDA device")
        torch_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(torch_device)
    else:
        torch_device = torch.device("cpu")
        reuse_large_cpu_allocations()  # no page faults on every step's large tensors (dflop.cpu_memory)
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a single process: a world of one over a local store
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=10),
                                device_id=torch_device if device == "cuda" else None)
    return torch_device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_worker(code: int = 0) -> NoReturn:
    """End a torchrun worker process that has finished: wait for every rank (a barrier: no rank
    closes its connections while a peer still talks to it), destroy the process group, flush, and
    leave with `os._exit(code)`.

    Why not a plain return: once a functional collective has run on a gloo group (every DTensor
    redistribution of tensor parallelism does), torch keeps the group's backend alive after
    destroy_process_group, so gloo's threads (gloo_tcp_loop, pt_gloo_runloop) still run when the
    interpreter and then the C++ runtime tear the process down; that teardown races with them, and
    under load a rank died in it with "terminate called without an active exception" (SIGABRT) after
    its work was done. The worker's output is complete once flushed, so it skips that teardown."""
    if is_distributed():
        barrier()
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
