"""`live_saved_tensor_bytes` against hand-counted bytes: a Linear + ReLU saves its input and the
ReLU output (float32), held from each forward until its backward, as a pipeline's microbatches are."""

from __future__ import annotations

import torch

from dflop.profiling._memory import live_saved_tensor_bytes


def _saved(n: int) -> int:
    return 4 * n * 8 + 4 * n * 16  # Linear input [n, 8] + ReLU output [n, 16]


def test_live_bytes_follow_forwards_and_backwards():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 16)
    inputs = [torch.randn(n, 8) for n in (3, 5, 7)]
    with live_saved_tensor_bytes(layer.parameters()) as live:
        outs = [torch.relu(layer(x)).sum() for x in inputs]
        assert live.live == live.peak == sum(_saved(x.shape[0]) for x in inputs)
        outs.pop(0).backward()  # the first microbatch's backward frees what it saved
        assert live.live == _saved(5) + _saved(7)
        again = torch.relu(layer(inputs[0])).sum()  # the same input storage, saved anew: counted again
        assert live.live == _saved(5) + _saved(7) + _saved(3)
        for out in [*outs, again]:
            out.backward()
        assert live.live == 0
    assert live.peak == sum(_saved(x.shape[0]) for x in inputs)


def test_a_storage_saved_by_two_forwards_counts_once_until_both_are_done():
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8)
    with live_saved_tensor_bytes(layer.parameters()) as live:
        a, b = torch.relu(layer(x)).sum(), torch.relu(layer(x)).sum()
        assert live.live == 4 * 4 * 8 + 2 * 4 * 4 * 16  # x once, two ReLU outputs
        a.backward()
        assert live.live == 4 * 4 * 8 + 4 * 4 * 16  # x still held by the second forward
        b.backward()
        assert live.live == 0
