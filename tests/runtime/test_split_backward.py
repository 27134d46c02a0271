"""ZB-H1's split backward (`dflop.runtime.split_backward`) against the plain one: B gives the input
gradient and no weight gradient; W then gives every weight gradient the whole backward gives,
through the engine's own accumulation (post-accumulate-grad hooks fire once per weight, as the
gradient sync and sequence parallelism's norms need), also for a weight used at two depths, under
activation checkpointing, and for a weight the inputs never reach."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflop.runtime.split_backward import backward_input


class Stage(nn.Module):
    def __init__(self, recompute: bool):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down, self.shared = nn.Linear(6, 8), nn.Linear(8, 6), nn.Linear(6, 6, bias=False)
        self.norm = nn.Parameter(torch.rand(6) + 0.5)
        self.alone = nn.Parameter(torch.rand(3))  # reaches an output the inputs do not
        self.recompute = recompute

    def block(self, h):
        return self.down(torch.tanh(self.up(h)))

    def forward(self, x):
        h = self.shared(x)  # the same weight at the bottom and the top of the stage
        h = h * self.norm / h.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        h = checkpoint(self.block, h, use_reentrant=False) if self.recompute else self.block(h)
        return [self.shared(torch.relu(h)) + h, self.alone * 3]


def _run(stage: Stage, split: bool, one_pass: bool = False):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    fired = {name: 0 for name, _ in stage.named_parameters()}
    for name, p in stage.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fired.__setitem__(name, fired[name] + 1))
    outs = stage(x)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(2)) for o in outs]
    if not split:
        torch.autograd.backward(outs, grads)
        return x.grad, {n: p.grad for n, p in stage.named_parameters()}, fired
    (dx,), weight = backward_input(outs, grads, [x], one_pass=one_pass)
    assert all(p.grad is None for p in stage.parameters()), "B must not compute weight gradients"
    assert all(v == 0 for v in fired.values())
    weight.run()
    return dx, {n: p.grad for n, p in stage.named_parameters()}, fired


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_b_then_w_equals_the_whole_backward(recompute, one_pass):
    stage = Stage(recompute)
    dx, grads, fired = _run(copy.deepcopy(stage), split=True, one_pass=one_pass)
    ref_dx, ref_grads, ref_fired = _run(stage, split=False)
    torch.testing.assert_close(dx, ref_dx)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, msg=name)
    assert fired == ref_fired and set(fired.values()) == {1}


def test_a_stage_without_gradient_inputs_runs_its_whole_backward_as_w():
    """The first stage (token ids in): B has nothing to compute, W is the whole backward."""
    stage = Stage(False)
    ref = copy.deepcopy(stage)
    x = torch.randn(4, 6)
    outs = stage(x)
    (dx,), weight = backward_input(outs, [torch.ones_like(o) for o in outs], [x])
    assert dx is None and all(p.grad is None for p in stage.parameters())
    weight.run()
    torch.autograd.backward(ref(x), [torch.ones_like(o) for o in outs])
    for (name, p), q in zip(stage.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
