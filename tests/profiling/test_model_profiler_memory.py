"""Exact memory accounting: activation bytes saved for backward, parameter/gradient/optimizer bytes."""

from __future__ import annotations

import torch
from torch import nn

from dflop.profiling._memory import adam_state_bytes, grad_bytes, param_bytes, saved_tensor_bytes


def test_saved_bytes_of_an_mlp_match_the_closed_form():
    n, d, h = 10, 8, 32
    mlp = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d))
    x = torch.randn(n, d, requires_grad=True)
    with saved_tensor_bytes(exclude=mlp.parameters()) as saved:
        mlp(x).sum().backward()
    # Linear 1 keeps x [n, d]; ReLU keeps its output [n, h], which Linear 2 also keeps (one storage).
    assert saved.bytes == 4 * (n * d + n * h)


def test_views_and_repeated_saves_count_once_and_parameters_not_at_all():
    w = nn.Parameter(torch.randn(6, 6))
    x = torch.randn(6, 6, requires_grad=True)
    with saved_tensor_bytes(exclude=[w]) as saved:
        y = x * w  # saves x and w
        z = x.view(36).sin()  # saves a view of x
        (y.sum() + z.sum()).backward()
    assert saved.bytes == x.numel() * 4


def test_parameter_gradient_and_adam_bytes():
    model = nn.Linear(100, 10).to(torch.bfloat16)
    n = 100 * 10 + 10
    assert param_bytes(model) == grad_bytes(model) == 2 * n
    assert adam_state_bytes(model) == 12 * n  # two fp32 moments + fp32 master weights
    model.bias.requires_grad_(False)
    assert grad_bytes(model) == 2 * 1000
    assert adam_state_bytes(nn.Linear(100, 10)) == 8 * n
