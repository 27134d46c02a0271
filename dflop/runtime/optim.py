"""End of a step: gradient synchronisation, the global gradient norm, AdamW and its LR schedule.

Loss normalisation. Every LLM bin backpropagates the SUM of its answer-token losses; after the
step's gradients are summed over data-parallel replicas they are divided by the number of answer
tokens in the whole global batch (one all-reduce of two numbers per step). The result is the
gradient of the mean over answer tokens of the global batch, exactly, however the batch was split
into microbatches, bins and replicas.

Synchronisation, once per step: (1) tied input/output embeddings held on two LLM stages add their
gradients over the ``tied_embedding`` group; (2) every gradient is summed over its module's
data-parallel group, in flat buckets of ~``bucket_mb`` MB (one all-reduce per bucket), all started
at once without waiting, so that a stage that finished its backward early syncs with its replicas
while the trainer waits for the slowest stage (the step-total all-reduce).

Global norm: each distinct parameter is counted once over the world: data-parallel replica 0 only,
tensor-parallel shards on every TP rank but replicated tensors on TP rank 0 only, a tied embedding
on the first LLM stage only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dflop.models.tensor_parallel import local_tensor
from dflop.runtime.topology import Topology


@dataclass(frozen=True)
class ParamInfo:
    """How one of this rank's parameters is replicated.

    module: "vision" or "llm" (decides the data-parallel group); sharded: a TP shard;
    tied_copy: the LLM head's copy of a tied embedding held on another stage than the embedding.
    """

    name: str
    module: str
    sharded: bool
    tied_copy: bool


class PendingSync:
    """Data-parallel all-reduces in flight: flat buckets to copy back into their gradients."""

    def __init__(self):
        self._work: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []

    def add(self, work, flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
        self._work.append((work, flat, grads))

    def wait(self) -> None:
        for work, flat, grads in self._work:
            work.wait()
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)
        self._work.clear()


class GradientSync:
    """Gradient all-reduces and the global norm of one rank's parameters."""

    def __init__(self, topo: Topology, params: dict[nn.Parameter, ParamInfo] | list, bucket_mb: float = 25.0):
        self.topo = topo
        self.params = list(params.items()) if isinstance(params, dict) else list(params)
        self.bucket_bytes = int(bucket_mb * 2**20)

    def _grads(self, module: str | None = None) -> list[tuple[nn.Parameter, ParamInfo]]:
        return [(p, info) for p, info in self.params
                if p.grad is not None and (module is None or info.module == module)]

    @staticmethod
    def _local_grad(param: nn.Parameter) -> torch.Tensor:
        """The gradient this rank holds (a DTensor parameter's local shard; in-place ops write through)."""
        with torch.no_grad():
            return local_tensor(param.grad)

    def all_reduce(self) -> None:
        """Tied-embedding sum, then data-parallel sum (bucketed)."""
        self.start_all_reduce().wait()

    def start_all_reduce(self) -> "PendingSync":
        """Start the synchronisation; `wait()` on the result before reading gradients.

        The tied-embedding sum runs first and to completion (the data-parallel buckets read the
        same tensor); the data-parallel buckets are then all in flight at once (``async_op``), so a
        rank that finished its backward early syncs with its replicas while the caller does
        something else (the trainer's step-total all-reduce waits for the slowest stage).
        """
        tied = self.topo.groups.tied_embedding
        if tied is not None:
            for p, info in self._grads("llm"):
                if info.name == "model.language_model.embed_tokens.weight":
                    dist.all_reduce(self._local_grad(p), group=tied)
        pending = PendingSync()
        for module, group in (("vision", self.topo.groups.vision_dp), ("llm", self.topo.groups.llm_dp)):
            if group is not None:
                for bucket in self._buckets([self._local_grad(p) for p, _ in self._grads(module)]):
                    flat = _flatten_dense_tensors(bucket)
                    pending.add(dist.all_reduce(flat, group=group, async_op=True), flat, bucket)
        return pending

    def _buckets(self, grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Consecutive gradients of one dtype, ~bucket_bytes each (a larger tensor alone)."""
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if buckets and size + nbytes <= self.bucket_bytes and g.dtype == buckets[-1][0].dtype:
                buckets[-1].append(g)
                size += nbytes
            else:
                buckets.append([g])
                size = nbytes
        return buckets

    def scale(self, factor: float) -> None:
        for p, _ in self._grads():
            self._local_grad(p).mul_(factor)

    def global_norm(self, device: torch.device) -> float:
        """L2 norm of the whole model's gradient (one all-reduce over the world)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for p, info in self._grads():
            role = self.topo.llm_role if info.module == "llm" else self.topo.vision_role
            if role.replica != 0 or info.tied_copy or (not info.sharded and role.tp_rank != 0):
                continue
            total += self._local_grad(p).double().pow(2).sum()
        if dist.is_initialized():
            dist.all_reduce(total)
        return float(total.sqrt())

    def clip(self, max_norm: float, norm: float) -> None:
        """Scale gradients so the global norm is at most `max_norm` (0 = no clipping)."""
        if max_norm > 0 and norm > max_norm:
            self.scale(max_norm / (norm + 1e-6))


def build_optimizer(params: list[tuple[str, nn.Parameter]], *, lr: float, weight_decay: float,
                    betas=(0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices only (not norms, biases)."""
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def warmup_cosine(step: int, *, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step `step` (0-based): linear warm-up to 1 over `warmup_steps`,
    then cosine decay to `min_lr_ratio` at the last step."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int,
                       min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, total_steps=total_steps, warmup_steps=warmup_steps,
                                           min_lr_ratio=min_lr_ratio))
