"""Costs of a training step outside the modules' forward and backward, measured by the model
profiler on the device, and with the ranks, it profiles with (`dflop.profiling.model_profiler`).

- ``optim_ms`` (a column of every module's rows): one step of the trainer's AdamW
  (`dflop.models.optimizer.build_optimizer`) over the module's parameters on this rank, plus what
  the trainer does to each gradient before it (`dflop.runtime.optim`): the scaling by the batch's
  answer tokens and the squared sum of the global norm. Per tensor, so the module's own tensor
  sizes and count set it (on CPU a step pays per tensor beyond its bytes, and one large flat tensor
  more per byte than several smaller ones: `benchmarks/bench_optimizer_pricing.py`).
- ``optim_call_ms`` (the same on every row): that step over a one-element weight and bias, the cost
  of the call itself, which a stage pays once however many modules it steps. A stage's optimizer
  is this plus, per module, its ``optim_ms`` less this (`dflop.costmodel.model.ModuleCosts.optimizer_s`).
- Module ``allreduce`` rows (profiling worlds of 2+ ranks only): one in-place sum all-reduce of
  ``bytes`` float32 bytes over the first ``batch`` ranks, as the trainer's gradient buckets are
  reduced over a data-parallel group; ``fwd_ms`` is world rank 0's time.
- Module ``p2p`` rows (same): one pipeline message of ``bytes`` from rank 0 to rank 1 as
  `dflop.runtime.p2p` sends it (the tensor alone, in a ``batch_isend_irecv`` batch: both ends know
  its shape from the step's plan, so no header), received there: half of a ping-pong of two such
  messages, so both ends' costs count.

Why measured here: on the demo's CPU ranks the step also paid the optimizer and gloo collectives
that the module profile never saw, and the cluster's declared bandwidths are a guess for the
machine the profile runs on. The sizes span latency-bound to bandwidth-bound messages, so a line
``const + bytes x per_byte`` fitted to them (`dflop.costmodel.fit`) holds at either end.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from dflop.models.optimizer import build_optimizer
from dflop.models.tensor_parallel import local_tensor
from dflop.profiling._timing import Timer

#: Message sizes (bytes) of the link sweeps: 4 KiB to 16 MiB on CPU (gloo), to 256 MiB on CUDA.
CPU_MAX_BYTES, CUDA_MAX_BYTES = 2**24, 2**28


def optimizer_step_ms(module: nn.Module, timer: Timer, *, repeats: int, barrier: Callable[[], None]) -> float:
    """Median milliseconds of one AdamW step (with the gradient scaling and global-norm pass) over
    `module`'s parameters; 0 for a module without any. The module's weights move by the steps
    (timing only needs shapes)."""
    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not params:
        return 0.0
    for _, p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = build_optimizer(params, lr=1e-4, weight_decay=0.1)

    def step() -> None:
        total = torch.zeros((), dtype=torch.float64, device=params[0][1].device)
        for _, p in params:
            local_tensor(p.grad).mul_(1.0)  # the trainer's scaling by 1 / answer tokens
        for _, p in params:
            total += local_tensor(p.grad).double().pow(2).sum()
        float(total)  # the trainer reads the norm on the host before clipping
        optimizer.step()

    step()  # AdamW allocates its state on the first step: not part of a training step's cost
    times = []
    for _ in range(max(repeats, 1)):
        barrier()
        times.append(timer(step)[1])
    for _, p in params:
        p.grad = None
    optimizer.state.clear()
    return float(statistics.median(times))


def optimizer_call_ms(device: torch.device, dtype: torch.dtype, timer: Timer, *, repeats: int,
                      barrier: Callable[[], None]) -> float:
    """`optimizer_step_ms` over one-element parameters in the profile's dtype: what one step costs
    beyond its tensors. A 1 x 1 weight and a bias, so the step has the decayed and the undecayed
    parameter group a layer has (`build_optimizer`; on CUDA each group is one multi-tensor launch)."""
    probe = nn.Linear(1, 1, bias=True, device=device, dtype=dtype)
    return optimizer_step_ms(probe, timer, repeats=repeats, barrier=barrier)


def link_sizes(device: torch.device) -> list[int]:
    """Message bytes of the link sweeps: powers of 4 from 4 KiB up to the device's maximum."""
    top = CUDA_MAX_BYTES if device.type == "cuda" else CPU_MAX_BYTES
    sizes, size = [], 2**12
    while size <= top:
        sizes.append(size)
        size *= 4
    return sizes


def link_rows(device: torch.device, timer: Timer, common: dict, *, repeats: int) -> list[dict]:
    """Rows of the all-reduce (every group size 2..world) and P2P sweeps; collective: every rank of
    the profiling world calls it, world rank 0's rows are the ones kept."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = {size: dist.new_group(list(range(size))) for size in range(2, world + 1)}
    rows = []
    for nbytes in link_sizes(device):
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for size, group in groups.items():
            def reduce(buf=buf, group=group):
                dist.all_reduce(buf, group=group)
                buf.fill_(1.0)  # keep the values finite over repeats (the fill is 0.1 % of the time)
            times = _timed(reduce if rank < size else None, timer, repeats)
            rows += [dict(common, module="allreduce", batch=size, bytes=nbytes, fwd_ms=ms, repeat=k)
                     for k, ms in enumerate(times)]
        times = _timed(_ping_pong(buf) if rank < 2 else None, timer, repeats)
        rows += [dict(common, module="p2p", batch=2, bytes=nbytes, fwd_ms=ms / 2, repeat=k)
                 for k, ms in enumerate(times)]
    return rows


def _ping_pong(buf: torch.Tensor) -> Callable[[], None]:
    """Rank 0 sends `buf` to rank 1, which sends it back, each message a batch of its own."""
    peer = 1 - dist.get_rank()

    def message(op) -> None:
        for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
            work.wait()

    def round_trip() -> None:
        first, second = (dist.isend, dist.irecv) if dist.get_rank() == 0 else (dist.irecv, dist.isend)
        message(first)
        message(second)

    return round_trip


def _timed(work: Callable[[], None] | None, timer: Timer, repeats: int) -> list[float]:
    """`repeats` timed runs of `work` after one untimed run, every rank between the same barriers
    (a rank with no part in the work waits at them)."""
    times = []
    for k in range(repeats + 1):
        dist.barrier()
        if work is not None:
            _, ms = timer(work)
            if k:
                times.append(ms)
    dist.barrier()
    return times
