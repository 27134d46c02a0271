"""The modules one rank runs: its vision stage and/or LLM stage, tensor-parallel shards, frozen parts.

Every rank builds the full transformers model on the meta device (no memory), takes the stage views
of it that the `Topology` assigns (docs/design.md), materialises only the tensors those reach on its
device (random init by seed and tensor name, the same under any layout, or read from the local
weights: `dflop.models.materialize`), and applies the plan's techniques to each stage
(`dflop.runtime.parallelize.parallelize_stage`: tensor parallelism, recomputation, FSDP2), freezing
parameters by their global name before FSDP2:

- ``vision``: ``model.vision_tower.*`` (InternVL's final tower norm included);
- ``projector``: ``model.multi_modal_projector.*`` and LLaVA-OV's ``model.image_newline``;
- ``llm``: ``model.language_model.*`` and ``lm_head.*``.

Tied input/output embeddings (Qwen2.5 small models): when one rank holds both (pp_l = 1) they stay
one tensor, also when vocabulary-sharded (`shard_stage`); across ranks (pp_l > 1) the first and
last LLM stage hold equal copies whose gradients the trainer sums over the ``tied_embedding`` group.

Parameters no stage runs (LLaVA-OV's vision ``post_layernorm``) are materialised on the ranks of the
last vision stage only, so the export finds them (`dflop.runtime.param_names.RankParameters.untrained`);
a weights directory may lack them (they are then initialised). Every other tensor of the full model
stays on the meta device.

Which stages run a backward pass is decided here from the freeze flags, identically on every rank,
because it decides which gradient messages exist: a frozen vision tower with a trained projector
runs backward only on the last vision stage.

Each stage recomputes activations as the plan says (``techniques.recompute[stage]`` of its module;
a colocated vision tower is one stage). Recomputation does not change what is trained: a checkpointed
layer whose parameters and inputs need no gradient keeps nothing and recomputes nothing.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from dflop.config import ModelSpec
from dflop.errors import UserError
from dflop.models.handle import ModelHandle
from dflop.models.stages import LLMStage, VisionStage
from dflop.runtime.parallelize import parallelize_stage
from dflop.runtime.param_names import full_model_on_meta, untrained_parameter_names
from dflop.runtime.topology import LLM, VISION, Topology

EMBEDDING_NAME = "model.language_model.embed_tokens.weight"  # global name of the LLM's input embedding

FREEZE_PREFIXES = {
    "vision": ("model.vision_tower.",),
    "projector": ("model.multi_modal_projector.", "model.image_newline"),
    "llm": ("model.language_model.", "lm_head."),
}


class RankModules(nn.Module):
    """This rank's modules: ``vision`` (a VisionStage) and/or ``llm`` (an LLMStage).

    llm_chunks: every LLM stage of this rank by local chunk index (one, or v under interleaved
    1F1B: virtual stages r, r + pp, ...); ``llm`` is the first (the only one when v = 1).

    full: the rank's full transformers model (stages are views of it; the checkpoint names
    parameters through it); tensors outside this rank's stages are on the meta device.
    sharded: the stages FSDP2 shards (`dflop.runtime.sharding`).
    """

    def __init__(self, full: PreTrainedModel, vision: VisionStage | None, llm: LLMStage | list[LLMStage] | None):
        super().__init__()
        chunks = [] if llm is None else list(llm) if isinstance(llm, (list, tuple)) else [llm]
        self.vision = vision
        self.llm = chunks[0] if chunks else None
        self.llm_chunks = nn.ModuleList(chunks)
        object.__setattr__(self, "full", full)  # not a submodule: its parameters are not all ours
        self.sharded: list = []

    @property
    def parts(self) -> list[nn.Module]:
        """This rank's stages: its vision stage and every LLM chunk it holds."""
        return ([self.vision] if self.vision is not None else []) + list(self.llm_chunks)

    def trainable_parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for p in self.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out


def build_rank_modules(topo: Topology, handle: ModelHandle, seed: int, device: torch.device | str = "cpu") -> RankModules:
    """Build (random init from `seed`, or the handle's weights), shard and freeze the modules of
    this rank (see module docstring)."""
    handle.check_trainable()
    plan = topo.plan
    plan.check(handle.info)  # every rank refuses, before any collective
    model = handle.build_on_meta()
    config = model.config
    vision = None
    untrained: set[str] = set()
    if topo.vision_role is not None:
        role = topo.vision_role
        vision = VisionStage(model, role.stage, role.n_stages, plan.vision.layer_ranges()[role.stage])
        if role.is_last:
            untrained = untrained_parameter_names(full_model_on_meta(config))
    llm: list[LLMStage] = []
    if topo.llm_role is not None:  # one stage, or v model chunks (virtual stages) under interleaving
        n_chunks = plan.layout.n_llm_chunks
        llm = [LLMStage(model, c, n_chunks, plan.llm.layer_ranges()[c]) for c in topo.rank_chunks(topo.llm_role)]
    fill = handle.materializer(model, seed=seed, device=device)
    fill(untrained, optional=untrained)
    modules = RankModules(model, vision, llm or None)
    stages = [(VISION, vision, topo.vision_role.stage)] if vision is not None else []
    stages += [(LLM, chunk, c) for chunk, c in zip(llm, topo.rank_chunks(topo.llm_role) if llm else [])]
    for module, stage, index in stages:
        sharded = parallelize_stage(stage, topo.layout(module), index, topo, full=model,
                                    device_type=torch.device(device).type, materialize=fill.module,
                                    freeze=lambda part: freeze(model, part, handle.spec))
        if sharded is not None:
            modules.sharded.append(sharded)
    return modules


def freeze(full: PreTrainedModel, stage: nn.Module, spec: ModelSpec) -> None:
    """Set requires_grad of `stage`'s parameters from the freeze flags (the config's model
    section), by global parameter name (`full`: the rank's full model, of which it is a view)."""
    frozen = tuple(prefix for part, flag in (("vision", spec.freeze_vision), ("projector", spec.freeze_projector),
                                             ("llm", spec.freeze_llm)) if flag for prefix in FREEZE_PREFIXES[part])
    names = _global_names(full, [stage])
    for param in stage.parameters():
        param.requires_grad_(not names[id(param)].startswith(frozen) if frozen else True)


def parameter_names(modules: RankModules) -> dict[int, str]:
    """id(parameter) -> global name, without the checkpoint module (identity, then TP wrappers)."""
    return _global_names(modules.full, modules.parts)


def _global_names(full: PreTrainedModel, parts: list[nn.Module]) -> dict[int, str]:
    """id(parameter) -> global name of the parameters of `parts`, views of `full`."""
    by_identity: dict[int, str] = {}
    for n, p in full.named_parameters(remove_duplicate=False):
        by_identity.setdefault(id(p), n)  # a tied tensor keeps its first (canonical) name
    out = {}
    for part in parts:
        for local, param in part.named_parameters():
            name = by_identity.get(id(param))
            if name is None and local == "embedding.embed_tokens.weight":
                name = EMBEDDING_NAME
            elif name is None and local in ("head.weight", "head.lm_head.weight"):
                name = "lm_head.weight"
            if name is None:
                raise UserError(f"parameter {local!r} of this rank has no name in the full model")
            out[id(param)] = name
    return out
