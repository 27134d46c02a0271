"""The memory techniques of a plan applied to one pipeline stage, as wrappers over plain model code.

`parallelize_stage` takes a stage of `dflop.models.stages` (a view of the rank's full model, no
technique applied) and applies what the plan asks for that stage, in place, in torchtitan's
order, each step wrapping what the one before left:

1. tensor parallelism and sequence parallelism (`dflop.models.tensor_parallel.shard_stage`:
   DTensor parallel styles on the layers' projections, the vocabulary-parallel embedding and head).
   First, because its plans name submodules by their path inside a layer, which a wrapper around
   the layer would hide;
2. activation recomputation (`dflop.models.recompute.apply_recompute`: each layer in a checkpoint
   wrapper for ``full``, the attention core's recomputing function for ``selective``), around the
   sharded layers, so a recomputed forward reissues their collectives;
3. FSDP2 over the module's data-parallel replicas (`dflop.runtime.sharding`), last, over the whole
   stage as it will run. It needs the freeze flags set (a stage that trains nothing is not sharded),
   and tensor parallelism replaces the parameters it shards with new ones (``requires_grad`` on),
   so the caller's `freeze` runs between recomputation and FSDP2.

The model profiler measures layers under the same tensor-parallel and recompute wrappers
(`dflop.profiling.model_modules`), so the cost model prices what this applies.
"""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.distributed.fsdp import FSDPModule

from dflop.models.recompute import apply_recompute
from dflop.models.stages import LLMStage, VisionStage
from dflop.models.tensor_parallel import shard_stage
from dflop.plan import ModuleLayout
from dflop.runtime.sharding import shard_stage_over_replicas
from dflop.runtime.topology import LLM, VISION, Topology


def parallelize_stage(stage: VisionStage | LLMStage, module_layout: ModuleLayout, stage_index: int,
                      topology: Topology, *, full: nn.Module, device_type: str,
                      materialize: Callable[[nn.Module], None] | None = None,
                      freeze: Callable[[nn.Module], None] | None = None) -> FSDPModule | None:
    """Apply `module_layout`'s techniques for stage `stage_index` of its module to this rank's
    `stage` (module docstring for the order); returns the stage if FSDP2 sharded it, else None.

    full: the rank's full model, of which `stage` is a view (FSDP2 rebinds its parameters there).
    device_type: of the device meshes ("cpu", "cuda").
    materialize: fills a part's meta tensors; tensor parallelism calls it on each part just before
        sharding it (`shard_stage`), so a rank holds one unsharded part at a time.
    freeze: sets the stage's ``requires_grad`` flags, before FSDP2 decides whether to shard it.
    """
    module = VISION if isinstance(stage, VisionStage) else LLM
    techniques = module_layout.techniques
    tp = topology.vision_tp if module == VISION else topology.llm_tp
    shard_stage(stage, tp, techniques.sequence_parallel, materialize=materialize)
    apply_recompute(stage, techniques.recompute[stage_index], f"{'vision' if module == VISION else 'LLM'} stage {stage_index}")
    if freeze is not None:
        freeze(stage)
    return shard_stage_over_replicas(topology, module, stage, full, device_type)
