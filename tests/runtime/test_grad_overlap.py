"""Data-parallel all-reduce overlapped with the last backward (`GradientSync.arm`), on 2 gloo ranks.

Reference: every rank recomputes both replicas' gradients in one process (same seeds) and sums
them; the synced gradients must equal that sum whether a bucket started during the backward or at
the end, and both replicas must start the same buckets in the same order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dflop.plan import plan_from_dict
from dflop.runtime.optim import GradientSync, ParamInfo
from dflop.runtime.topology import Topology
from test_checkpoint_helpers import spawn

WIDTH = 2


class SkipChain(nn.Module):
    """x -> l0 -> l1 -> (l2, unless skipped) -> l3 -> sum: a microbatch can leave l2 untouched.
    Every tensor has its own size, so a bucket (one tensor each) is known by its size."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(WIDTH, 3), nn.Linear(3, 5, bias=False), nn.Linear(5, 5),
                                     nn.Linear(5, 7)])

    def forward(self, x: torch.Tensor, skip_l2: bool) -> torch.Tensor:
        h = self.layers[1](self.layers[0](x))
        if not skip_l2:
            h = self.layers[2](h)
        return self.layers[3](h).pow(2).sum()


def _microbatches(rank: int, skip_in_last: bool) -> list[tuple[torch.Tensor, bool]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(3, WIDTH, generator=g), False), (torch.randn(3, WIDTH, generator=g), skip_in_last)]


def _step(model: SkipChain, batches, sync: GradientSync | None) -> None:
    """Backward of each microbatch; `sync.arm()` right before the last one (as the executor does)."""
    for i, (x, skip) in enumerate(batches):
        if sync is not None and i == len(batches) - 1:
            sync.arm()
        model(x, skip).backward()


def _overlap_worker(rank: int, skip_rank: int | None) -> None:
    plan = plan_from_dict({"vision": {"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [1]},
                           "llm": {"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [1]}, "placement": "colocated",
                           "microbatches": 2, "global_batch_size": 4, "world_size": 2}).plan
    topo = Topology(plan, rank, 2)
    topo.create_groups()
    model = SkipChain()
    params = {p: ParamInfo(name, "llm", False, False) for name, p in model.named_parameters()}
    sync = GradientSync(topo, params, bucket_mb=1e-6)  # every tensor its own bucket: 7 buckets

    started: list[int] = []  # sizes of the flat buckets, in start order
    real_all_reduce = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        started.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        _step(model, _microbatches(rank, skip_in_last=rank == skip_rank), sync)
        started_in_backward = len(started)
        sync.start_all_reduce().wait()
    finally:
        dist.all_reduce = real_all_reduce

    reference = SkipChain()
    for r in range(2):
        _step(reference, _microbatches(r, skip_in_last=r == skip_rank), None)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(got.grad, want.grad, rtol=1e-6, atol=1e-6), name

    # Buckets last layer first: l3.bias, l3.weight, l2.bias, l2.weight, l1.weight, l0.bias, l0.weight
    if rank == skip_rank:  # l2 got no gradient in the last backward: it and all after it wait
        assert started_in_backward == 2
    else:
        assert started_in_backward == 7
    orders = [None, None]
    dist.all_gather_object(orders, started)
    assert orders[0] == orders[1] == [7, 35, 5, 25, 15, 3, 3 * WIDTH]

    # A second step starts afresh (no bucket left marked ready from the first)
    for p in model.parameters():
        p.grad.zero_()
    _step(model, _microbatches(rank, skip_in_last=False), sync)
    sync.start_all_reduce().wait()


@pytest.mark.distributed
@pytest.mark.parametrize("skip_rank", [None, 1])
def test_buckets_start_during_the_last_backward_in_the_same_order_on_every_replica(tmp_path, skip_rank):
    spawn(_overlap_worker, 2, tmp_path, skip_rank)
