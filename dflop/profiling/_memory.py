"""Exact memory of a module: parameter, gradient and optimizer bytes, and activation bytes (the
tensors autograd keeps for backward), measured on any device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from dflop.models.tensor_parallel import local_tensor


@dataclass
class SavedBytes:
    """Filled in when the `saved_tensor_bytes` block ends: bytes of distinct storages saved."""

    bytes: int = 0
    _storages: dict[int, int] = field(default_factory=dict)


@contextlib.contextmanager
def saved_tensor_bytes(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedBytes]:
    """Count the bytes of tensors saved for backward by the forward run inside the block.

    Each storage counts once (views and tensors saved by several ops share it); storages of
    `exclude` (the parameters: they are memory anyway) are not activations. Saved tensors stay
    alive until backward, so no two of them can share an address by reuse.
    """
    excluded = {local_tensor(t).untyped_storage().data_ptr() for t in exclude}
    result = SavedBytes()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = local_tensor(tensor)
        if isinstance(local, AsyncCollectiveTensor):  # a collective's output (sequence parallelism's
            local = local.trigger_wait()  # all-gather into the LM head): its storage once it has arrived
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in excluded:
            result._storages.setdefault(ptr, storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result
    result.bytes = sum(result._storages.values())


def param_bytes(module: nn.Module) -> int:
    """Bytes of the module's distinct parameters on this rank."""
    return sum(local_tensor(p).numel() * p.element_size() for p in module.parameters())


def grad_bytes(module: nn.Module) -> int:
    """Bytes of the gradients of trainable parameters (same dtype as the parameters) on this rank."""
    return sum(local_tensor(p).numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def adam_state_bytes(module: nn.Module) -> int:
    """Adam's two float32 moments per trainable parameter, plus a float32 master copy of
    parameters kept in lower precision (mixed-precision training)."""
    total = 0
    for p in module.parameters():
        if p.requires_grad:
            total += local_tensor(p).numel() * (8 + (4 if p.dtype != torch.float32 else 0))
    return total


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor: its local shard's), each counted
    once however many tensors view it: what a rank holds for them (e.g. FSDP2's gathered parameters
    are views of one buffer; the buffer counts, padding included)."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = local_tensor(tensor).untyped_storage()
        storages.setdefault(storage.data_ptr(), storage.nbytes())
    return sum(storages.values())
