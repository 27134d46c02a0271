"""The optimizer training builds over a model's parameters: one home, because the model profiler
times its step (`dflop.profiling.step_costs`) exactly as the trainer will run it."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def build_optimizer(params: list[tuple[str, nn.Parameter]], *, lr: float, weight_decay: float,
                    betas=(0.9, 0.95), eps: float = 1e-8, foreach: bool | None = None) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices only (not norms, biases).

    DTensor (tensor-parallel) and plain parameters go in separate groups: the multi-tensor
    (``foreach``) kernels AdamW picks on CUDA refuse a list that mixes the two."""
    groups = []
    for decay in (True, False):
        for distributed in (True, False):
            members = [p for _, p in params if (p.ndim >= 2) == decay and isinstance(p, DTensor) == distributed]
            if members:
                groups.append({"params": members, "weight_decay": weight_decay if decay else 0.0})
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=foreach)
