"""The default process group, as checkpointing and export use it: all helpers are no-ops in one
process without a process group (tests, `read_checkpoint_model`), so the same code serves both."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
