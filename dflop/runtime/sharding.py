"""Optimizer state and gradients sharded over a module's data-parallel replicas (ZeRO-2), on FSDP2.

``plan.<module>.techniques.shard_optimizer``: the stage of that module on this rank (a whole
`VisionStage` / `LLMStage`, one FSDP parameter group) goes through ``fully_shard`` over the
module's data-parallel group (`Topology.groups.vision_dp` / ``llm_dp``, as a 1-D DeviceMesh made
from the existing group: the stages' ranks are subsets of the world; with tp > 1 see below). Each
replica then holds 1/dp of the parameters, of their gradients and (AdamW builds it from them) of the
optimizer state.

Inside a step (`StepSharding`), as torch.distributed.pipelining drives FSDP under a schedule:

1. ``begin``: gradient sync off, no resharding after forward/backward, and an explicit
   ``unshard()`` (one all-gather of the stage's parameters). Every replica calls it, also one whose
   microbatches bring it no work this step (an empty bin runs no forward, so FSDP's pre-forward
   all-gather alone would leave the replicas' collectives unmatched). The unsharded parameters stay
   for the whole step (ZeRO-2: no re-gather in backward); backward accumulates full gradients.
2. ``reduce`` after the pipeline: every trainable parameter that got no gradient on this replica
   (all of them on a replica without work) first gets a zero one, then every parameter group's
   post-backward runs with sync on (one reduce-scatter per stage, SUM: the trainer divides by the
   global answer-token count), then FSDP's end-of-backward callback, which waits for it, reshards
   (frees the unsharded parameters) and leaves in each sharded parameter's ``.grad`` its 1/dp shard
   of the summed gradient. The zeros keep every replica's reduce-scatter the same call: torch 2.11's
   post-backward leaves a parameter without a gradient out of it (and with none at all issues no
   collective, so the other replicas would wait forever); 2.13 zero-fills them itself when
   ``set_reduce_scatter_unused_params`` is on, a switch 2.11 lacks. The post-backward sequence is
   ``torch.distributed.pipelining.stage._PipelineStageBase.perform_reduce_grad``'s (private FSDP2
   methods, the ones torch's own pipeline schedule calls), kept in `_reduce_now`.

`GradientSync` leaves these parameters out of its data-parallel buckets, sums a tied embedding's
shard over the ``tied_embedding`` group (both LLM stages shard it alike over the same dp size, and
sums commute), and counts each shard once in the global norm (every replica holds a different one).

With tensor parallelism (tp > 1) FSDP2 needs the TP DTensors on the "tp" dimension of the 2-D mesh
whose "dp" dimension it shards over (torchtitan's composition): `Topology` then hands the module's
`TPGroup` the stage's (dp, tp) rank grid, TP is applied on that mesh's "tp" first, FSDP2 here on
its "dp". Parameters become DTensors on the (dp, tp) mesh (each rank holds a (replica, tp rank)
block); FSDP2 redistributes a gradient to the parameter's TP placement before its reduce-scatter,
which also sums sequence parallelism's partial norm gradients over tp (its hooks sit on the
pre-FSDP parameters). A module whose stage on this rank trains nothing is not sharded (no optimizer
state to shard); dp = 1 has nothing to shard over.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from dflop.models.tensor_parallel import DP_DIM
from dflop.runtime.topology import VISION, Topology


def shard_stage_over_replicas(topo: Topology, module: str, stage: nn.Module, full: nn.Module,
                              device_type: str) -> FSDPModule | None:
    """``fully_shard`` this rank's stage of `module` (vision | llm) if the module asks for it, has
    dp > 1 and the stage trains something here; returns the sharded stage, else None. Call after
    freezing and after tensor parallelism (module docstring).

    full: the rank's full model, of which the stage is a view: its modules get the sharded
    parameters too (FSDP replaces them only inside the stage; e.g. LLaVA-OV's ``image_newline`` is
    also registered on the inner model), so global names keep resolving by identity."""
    group = topo.groups.vision_dp if module == VISION else topo.groups.llm_dp
    if not topo.layout(module).techniques.shard_optimizer or group is None:
        return None
    if not any(p.requires_grad for p in stage.parameters()):
        return None
    tp = topo.vision_tp if module == VISION else topo.llm_tp
    if tp.dp_group is not None:  # tensor-parallel: shard over "dp" of the mesh whose "tp" TP uses
        mesh = tp.dp_tp_mesh(device_type)[DP_DIM]
    else:
        mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=(f"{module}_dp",))
    before = dict(stage.named_parameters(remove_duplicate=False))
    sharded = fully_shard(stage, mesh=mesh, reshard_after_forward=False)
    _rebind(full, before, dict(stage.named_parameters(remove_duplicate=False)))
    sum_over_replicas(sharded)
    return sharded


def sum_over_replicas(sharded: FSDPModule) -> None:
    """Make `sharded`'s reduce-scatter a plain SUM over its replicas, as `GradientSync`'s all-reduce."""
    sharded.set_gradient_divide_factor(1.0)
    sharded.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM, which a factor of 1 would use


def _rebind(full: nn.Module, before: dict[str, nn.Parameter], after: dict[str, nn.Parameter]) -> None:
    """Where `full` registers a parameter of `before`, register its replacement (same name in `after`)."""
    new = {id(param): after[name] for name, param in before.items()}
    for module in full.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in new:
                module._parameters[name] = new[id(param)]


def is_sharded_parameter(param: torch.Tensor, sharded: list[FSDPModule]) -> bool:
    """Whether FSDP manages `param` (one of the sharded stages' parameters)."""
    return any(param is p for m in sharded for p in m.parameters())


class StepSharding:
    """Drives the sharded stages through one step (module docstring: `begin`, then `reduce`)."""

    def __init__(self, sharded: list[FSDPModule]):
        self.sharded = sharded

    def begin(self) -> None:
        for m in self.sharded:
            _lazy_init(m)  # a replica may run no forward this step
            m.set_is_last_backward(False)
            m.set_requires_gradient_sync(False)
            m.set_reshard_after_backward(False)
            m.unshard()

    def reduce(self) -> None:
        for m in self.sharded:
            m.set_is_last_backward(True)
            m.set_requires_gradient_sync(True)
            m.set_reshard_after_backward(True)
            for param in m.parameters():  # the unsharded ones, registered since `begin`
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
            _reduce_now(m)


# FSDP2 has no public call for "reduce-scatter the accumulated gradients now" nor for its root's
# lazy init; torch's own pipeline schedule uses the private state as below. Read against torch 2.11
# and 2.13 (`tests/runtime/test_sharding.py::test_fsdp2_private_state_is_the_one_read` fails when an
# installed torch has it otherwise). The form is told by the attribute, not the version number, so
# pre-releases and vendor builds (2.13.0a0+git..., which compares below 2.13) read the right one.


def _lazy_init(m: FSDPModule) -> None:
    fully_shard.state(m)._lazy_init()


def _param_groups(state) -> list:
    """One FSDP state's parameter groups: torch 2.13 keeps a list (per-parameter meshes), 2.11 one
    group or None."""
    held = vars(state)
    if "_fsdp_param_groups" in held:
        return list(held["_fsdp_param_groups"])
    if "_fsdp_param_group" in held:
        return [] if held["_fsdp_param_group"] is None else [held["_fsdp_param_group"]]
    raise RuntimeError(f"torch {torch.__version__}'s FSDP2 keeps its parameter groups in neither "
                       "_fsdp_param_groups nor _fsdp_param_group: update dflop.runtime.sharding._param_groups")


def _reduce_now(m: FSDPModule) -> None:
    """Every parameter group's post-backward (a reduce-scatter where gradient sync is on), then the
    end-of-backward callback (waits for it and reshards): `perform_reduce_grad`'s sequence."""
    state = fully_shard.state(m)
    for inner in state._state_ctx.all_states:
        for group in _param_groups(inner):
            group.post_backward()
    state._root_post_backward_final_callback()
