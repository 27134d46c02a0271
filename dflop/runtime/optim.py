"""End of a step: gradient synchronisation, the global gradient norm and the LR schedule (the AdamW
itself is built by `dflop.models.optimizer.build_optimizer`, which the profiler also times).

Loss normalisation. Every LLM bin backpropagates the SUM of its answer-token losses; after the
step's gradients are summed over data-parallel replicas they are divided by the number of answer
tokens in the whole global batch (one all-reduce of two numbers per step). The result is the
gradient of the mean over answer tokens of the global batch, exactly, however the batch was split
into microbatches, bins and replicas.

Synchronisation, once per step: (1) tied input/output embeddings held on two LLM stages add their
gradients over the ``tied_embedding`` group; (2) every gradient is summed over its module's
data-parallel group, in flat buckets of ~``bucket_mb`` MB (one all-reduce per bucket). A bucket
starts (``async_op``) during the rank's last backward of the step as soon as its gradients are
final (`GradientSync`), the rest right after the pipeline, so the all-reduces overlap the last
backward and, on a stage that finished early, the wait for the slowest stage (the step-total
all-reduce).

Parameters sharded over the replicas (``ParamInfo.zero``, `dflop.runtime.sharding`) have their
data-parallel sum done by FSDP2 before (2); the tied-embedding sum (1) adds their shards.

Global norm: each distinct parameter is counted once over the world: data-parallel replica 0 only
(a replica-sharded one: each replica's shard),
tensor-parallel shards on every TP rank but replicated tensors on TP rank 0 only, a tied embedding
on the first LLM stage only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


from dflop.models.tensor_parallel import is_tp_shard, local_tensor
from dflop.runtime.model import EMBEDDING_NAME, RankModules, parameter_names
from dflop.runtime.param_names import RankParameters
from dflop.runtime.sharding import is_sharded_parameter
from dflop.runtime.topology import LLM, VISION, Topology


@dataclass(frozen=True)
class ParamInfo:
    """How one of this rank's parameters is replicated.

    module: "vision" or "llm" (decides the data-parallel group); sharded: a TP shard;
    tied_copy: the LLM head's copy of a tied embedding held on another stage than the embedding.
    zero: sharded over the data-parallel replicas by FSDP2 (`dflop.runtime.sharding`), which
    reduces its gradient: no data-parallel bucket; each replica's shard counts in the norm.
    """

    name: str
    module: str
    sharded: bool
    tied_copy: bool
    zero: bool = False


def param_infos(modules: RankModules, topo: Topology, rank_params: RankParameters) -> dict[nn.Parameter, ParamInfo]:
    """How each trainable parameter of this rank's `modules` is replicated, by its global name."""
    names = parameter_names(modules)
    canonical = {id(t): n for n, t in rank_params.tensors.items()}
    llm_role = topo.llm_role
    head_copy = topo.tied_embeddings and llm_role is not None and llm_role.is_last and not llm_role.is_first
    infos: dict[nn.Parameter, ParamInfo] = {}
    for param in modules.trainable_parameters():
        name = canonical.get(id(param), names[id(param)])
        module = LLM if name.startswith(("model.language_model.", "lm_head.")) else VISION
        infos[param] = ParamInfo(name, module, is_tp_shard(param), tied_copy=head_copy and name == EMBEDDING_NAME,
                                 zero=is_sharded_parameter(param, modules.sharded))
    return infos


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


@dataclass
class _Bucket:
    """Parameters whose gradients are summed by one all-reduce over `group`."""

    params: list[nn.Parameter]
    group: Any
    overlappable: bool  # False: must wait for the end of the step (the tied-embedding sum comes first)
    ready: set[int] = field(default_factory=set)  # id(param) of gradients final in this step

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


class GradientSync:
    """Gradient all-reduces and the global norm of one rank's parameters.

    Overlap with the last backward: the data-parallel buckets are fixed once, in the order
    gradients become final in a backward pass (reverse order of the parameters: last layer
    first). `arm()` before the rank's last backward of the step turns on per-parameter hooks; when
    every gradient of the next bucket in line has been accumulated, that bucket's all-reduce
    starts (``async_op``) while the backward goes on. Buckets start strictly in order, so all
    replicas issue the same collectives in the same order even when a replica's last microbatch
    leaves some parameters untouched (those buckets, and all after them, start in
    `start_all_reduce`).
    """

    def __init__(self, topo: Topology, params: dict[nn.Parameter, ParamInfo] | list, bucket_mb: float = 25.0,
                 overlap: bool = True):
        self.topo = topo
        self.params = tuple(params.items()) if isinstance(params, dict) else tuple(params)  # buckets are fixed
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._buckets = self._plan_buckets()
        self._bucket_of = {id(p): b for b in self._buckets if b.overlappable for p in b.params}
        self._next = 0  # first bucket not started in this step
        self._pending = PendingSync()
        self._armed = False
        self.overlapped_buckets = 0  # buckets of the last completed step started during its backward
        self._hooks = []
        if overlap:
            for param in {id(p): p for b in self._buckets if b.overlappable for p in b.params}.values():
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_gradient_final))

    def remove_hooks(self) -> None:
        """Detach the overlap hooks from the parameters (another GradientSync takes over)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def zero_grads(self) -> None:
        """Zeros, not None: every replica all-reduces the same list (a ``zero`` parameter's shard is
        set by FSDP2, and none is held meanwhile: `dflop.costmodel.memory`)."""
        for param, info in self.params:
            if info.zero:
                param.grad = None
            elif param.grad is None:
                param.grad = torch.zeros_like(param)
            else:
                param.grad.zero_()

    def _grads(self, module: str | None = None) -> list[tuple[nn.Parameter, ParamInfo]]:
        return [(p, info) for p, info in self.params
                if p.grad is not None and (module is None or info.module == module)]

    @staticmethod
    def _local_grad(param: nn.Parameter) -> torch.Tensor:
        """The gradient this rank holds (a DTensor parameter's local shard; in-place ops write through)."""
        return local_tensor(param.grad)

    def _is_tied(self, info: ParamInfo) -> bool:
        return self.topo.groups.tied_embedding is not None and info.name == EMBEDDING_NAME

    def _plan_buckets(self) -> list[_Bucket]:
        """Data-parallel buckets in launch order: each module's parameters last-to-first (the order a
        backward pass finalises them), the tied embedding (summed over stages first) at the end."""
        buckets: list[_Bucket] = []
        tied: list[_Bucket] = []
        for module, group in (("llm", self.topo.groups.llm_dp), ("vision", self.topo.groups.vision_dp)):
            if group is None:
                continue
            members = [(p, info) for p, info in reversed(self.params) if info.module == module and not info.zero]
            buckets += [_Bucket(chunk, group, True) for chunk in
                        self._buckets_by_size([p for p, info in members if not self._is_tied(info)])]
            tied += [_Bucket(chunk, group, False) for chunk in
                     self._buckets_by_size([p for p, info in members if self._is_tied(info)])]
        return buckets + tied

    def _buckets_by_size(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """Consecutive parameters of one dtype, ~bucket_bytes each (a larger tensor alone)."""
        buckets: list[list[nn.Parameter]] = []
        size = 0
        for p in params:
            nbytes = local_tensor(p).numel() * p.element_size()
            if buckets and size + nbytes <= self.bucket_bytes and p.dtype == buckets[-1][0].dtype:
                buckets[-1].append(p)
                size += nbytes
            else:
                buckets.append([p])
                size = nbytes
        return buckets

    def arm(self) -> None:
        """Start each bucket's all-reduce as soon as its gradients are final: call right before this
        rank's last backward of the step (gradients accumulated before it are not final yet)."""
        self._armed = True

    def _on_gradient_final(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of.get(id(param)) if self._armed else None
        if bucket is not None:
            bucket.ready.add(id(param))
            while self._next < len(self._buckets) and self._buckets[self._next].overlappable \
                    and self._buckets[self._next].complete:
                self._launch(self._buckets[self._next])

    def _launch(self, bucket: _Bucket) -> None:
        for p in bucket.params:
            if p.grad is None:  # every replica all-reduces the same list
                p.grad = torch.zeros_like(p)
        grads = [self._local_grad(p) for p in bucket.params]
        flat = _flatten_dense_tensors(grads)
        self._pending.add(dist.all_reduce(flat, group=bucket.group, async_op=True), flat, grads)
        self._next += 1

    def all_reduce(self) -> None:
        """Tied-embedding sum, then data-parallel sum (bucketed)."""
        self.start_all_reduce().wait()

    def start_all_reduce(self) -> "PendingSync":
        """Start what is left of the synchronisation; `wait()` on the result before reading gradients.

        The tied-embedding sum runs first and to completion (its data-parallel bucket reads the
        same tensor); the buckets not started during the last backward then all start at once
        (``async_op``), so a rank that finished its backward early syncs with its replicas while the
        caller does something else (the trainer's step-total all-reduce waits for the slowest stage).
        """
        self._armed = False
        self.overlapped_buckets = self._next  # started by the hooks during the last backward
        if self.topo.groups.tied_embedding is not None:
            for p, info in self._grads("llm"):
                if info.name == EMBEDDING_NAME:
                    dist.all_reduce(self._local_grad(p), group=self.topo.groups.tied_embedding)
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
        pending, self._pending, self._next = self._pending, PendingSync(), 0
        for bucket in self._buckets:
            bucket.ready.clear()
        return pending

    def scale(self, factor: float) -> None:
        for p, _ in self._grads():
            self._local_grad(p).mul_(factor)

    def global_norm(self, device: torch.device) -> float:
        """L2 norm of the whole model's gradient (one all-reduce over the world)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for p, info in self._grads():
            role = self.topo.llm_role if info.module == "llm" else self.topo.vision_role
            if (role.replica != 0 and not info.zero) or info.tied_copy or (not info.sharded and role.tp_rank != 0):
                continue
            total += self._local_grad(p).double().pow(2).sum()
        if dist.is_initialized():
            dist.all_reduce(total)
        return float(total.sqrt())

    def clip(self, max_norm: float, norm: float) -> None:
        """Scale gradients so the global norm is at most `max_norm` (0 = no clipping)."""
        if max_norm > 0 and norm > max_norm:
            self.scale(max_norm / (norm + 1e-6))


def warmup_cosine(step: int, *, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step `step` (0-based): linear warm-up to 1 over `warmup_steps`,
    then cosine decay to `min_lr_ratio` at the last step."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def follow_schedule(sched: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set the optimizer's LR from `sched`'s own lambdas at its step (after a resume: the schedule
    rebuilt from the current config, not the LR the checkpoint saved)."""
    for group, base, factor in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * factor(sched.last_epoch)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int,
                       min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, total_steps=total_steps, warmup_steps=warmup_steps,
                                           min_lr_ratio=min_lr_ratio))
