"""Exact memory of a module: parameter, gradient and optimizer bytes, activation bytes (the
tensors autograd keeps for backward), and the peak of everything its forward and backward allocate
(`allocated_peak`), measured on any device.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dflop.models.tensor_parallel import local_tensor


@dataclass
class SavedBytes:
    """Filled in when the `saved_tensor_bytes` block ends: bytes of distinct storages saved."""

    bytes: int = 0
    _storages: dict[int, int] = field(default_factory=dict)

    def among(self, addresses: set[int]) -> int:
        """Bytes of the saved storages whose data address is in `addresses` (those an
        `allocated_peak` block allocated: `AllocatedBytes.holding`)."""
        return sum(n for ptr, n in self._storages.items() if ptr in addresses)


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
        storage = _storage(tensor)
        ptr = storage.data_ptr()
        if ptr not in excluded:
            result._storages.setdefault(ptr, storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result
    result.bytes = sum(result._storages.values())


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    """The storage behind a saved tensor (a DTensor: its local shard's)."""
    local = local_tensor(tensor)
    if isinstance(local, AsyncCollectiveTensor):  # a collective's output (sequence parallelism's
        local = local.trigger_wait()  # all-gather into the LM head): its storage once it has arrived
    return local.untyped_storage()


@dataclass
class LiveSavedBytes:
    """Bytes of the distinct storages autograd holds for backward right now, and their peak so far
    (`live_saved_tensor_bytes`)."""

    live: int = 0
    peak: int = 0
    _held: dict[int, list[int]] = field(default_factory=dict)  # storage address -> [saved tensors, bytes]

    def _add(self, ptr: int, nbytes: int) -> None:
        entry = self._held.get(ptr)
        if entry is not None:
            entry[0] += 1
            return
        self._held[ptr] = [1, nbytes]
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _release(self, ptr: int) -> None:
        entry = self._held[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self._held[ptr]
            self.live -= entry[1]


class _Held:
    """A saved tensor as autograd keeps it while `live_saved_tensor_bytes` is on: autograd drops
    it when the backward that needs it has run (or the graph goes), which releases its bytes."""

    __slots__ = ("tensor", "ptr", "owner")

    def __init__(self, tensor: torch.Tensor, ptr: int, owner: LiveSavedBytes):
        self.tensor, self.ptr, self.owner = tensor, ptr, owner

    def __del__(self):
        self.owner._release(self.ptr)


@contextlib.contextmanager
def live_saved_tensor_bytes(exclude: Iterable[torch.Tensor] = ()) -> Iterator[LiveSavedBytes]:
    """Track the bytes of tensors saved for backward by forwards run inside the block while they are
    held, across forwards and backwards (a pipeline's in-flight microbatches): ``peak`` is the most
    held at once. Each storage counts once while any saved tensor uses it; storages of `exclude`
    (the parameters) are not activations. Tensors saved inside `torch.utils.checkpoint` regions are
    the checkpoint's business (its own hooks take precedence): only what it keeps is seen.
    """
    excluded = {local_tensor(t).untyped_storage().data_ptr() for t in exclude}
    result = LiveSavedBytes()

    def pack(tensor: torch.Tensor):
        storage = _storage(tensor)
        ptr = storage.data_ptr()
        if ptr in excluded:
            return tensor
        result._add(ptr, storage.nbytes())
        return _Held(tensor, ptr, result)

    def unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield result


class AllocatedBytes(TorchDispatchMode):
    """Bytes of the storages that ops run inside an `allocated_peak` block allocated, counted while
    any tensor holds them, and their peak (``peak``; ``live``: now).

    Every op's outputs are seen as they are made (a dispatch mode sees the ops autocast inserts, and
    the backward's, recomputation included). An output whose storage is one of the op's inputs' (a
    view, an in-place op, ``out=``) is no allocation; any other output storage counts once, from
    its op until the storage is freed, however many tensors view it. Storages, not tensors, are
    watched (a weak reference to each, which PyTorch keeps alive as long as the storage itself):
    autograd saves an op's output as a new tensor on the same storage, so the tensor Python saw can
    go while its bytes stay. Not seen: a kernel's own scratch space (cuBLAS workspace, a fused
    kernel's internal buffers), which is no op's output, and the allocator's rounding and caching.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: dict[int, tuple[weakref.ref, int, int]] = {}  # storage id -> (watcher, bytes, data address)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = _plain(t).untyped_storage()
                key = storage._cdata
                if key not in inputs and key not in self._held:
                    self._watch(key, storage)
        self.peak = max(self.peak, self.live)
        return out

    def _watch(self, key: int, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        self._held[key] = (weakref.ref(storage, lambda _, key=key: self._release(key)), nbytes, storage.data_ptr())
        self.live += nbytes

    def _release(self, key: int) -> None:
        entry = self._held.pop(key, None)
        if entry is not None:
            self.live -= entry[1]

    def holding(self) -> set[int]:
        """Data addresses of the storages allocated inside the block that are alive now."""
        return {ptr for _, _, ptr in self._held.values()}


@contextlib.contextmanager
def allocated_peak() -> Iterator[AllocatedBytes]:
    """Track the bytes ops inside the block allocate (`AllocatedBytes`); tensors made before it
    (inputs, parameters, gradients already there) are not counted, nor are storages freed by it."""
    tracker = AllocatedBytes()
    with tracker:
        yield tracker


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds `tensor`'s bytes: a DTensor's local shard, an asynchronous
    collective's result buffer (without waiting for it)."""
    tensor = local_tensor(tensor)
    if isinstance(tensor, AsyncCollectiveTensor):
        tensor = tensor.elem
    return tensor


def _storage_key(tensor: torch.Tensor) -> int:
    return _plain(tensor).untyped_storage()._cdata


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
