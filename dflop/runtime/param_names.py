"""Global parameter names: the parameters one rank trains, under the full model's Hugging Face names.

Checkpoints and the export name every tensor by its name in the full transformers model (the name
in its Hugging Face checkpoint), so what a checkpoint holds does not depend on how the model was
split over ranks, and pipeline stages (whose module paths restart at their own ``layers.0``) never
collide. Pipeline stages are views of the rank's full model, so a stage parameter's global name is
the full model's name for the same tensor; the vocabulary-parallel wrappers of an `LLMStage` (new
modules holding the token embedding / LM head slice) are named after the embeddings they replace.
This module is the one place that mapping is made; `global_name_module` hands it to torch's
state_dict API, which keys model and optimizer state by a module's parameter names.

Tensor-parallel shards are DTensors (`dflop.models.tensor_parallel`): their ``shape`` is the global
shape, so a parameter of any other shape than the full model's is refused, unless it holds zero
vision heads (`dflop.models.tensor_parallel.zero_head_padding`): `RankParameters.padding` says
where, the checkpoint saves it padded and the export cuts it off.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from dflop.errors import UserError
from dflop.models.architectures import architecture_of
from dflop.models.packing import PACKED_ATTENTION
from dflop.models.stages import LLMStage, build_llm_stage, build_vision_stage
from dflop.models.tensor_parallel import zero_head_padding


@dataclass(frozen=True)
class RankParameters:
    """The parameters this rank trains, under the full model's parameter names.

    tensors: global name (``named_parameters()`` of the full transformers model) -> the parameter
        this rank holds: the whole tensor, or a DTensor (a tensor-parallel shard, or replicated).
    config: the full model's transformers config (export builds the model from it).
    untrained: parameters of the full model that no pipeline stage runs (LLaVA-OneVision's vision
        post_layernorm), taken from this rank's full model: they never change, so export writes
        these values.
    padding: global name -> (dimension, real length) of each tensor that holds zero vision heads
        beyond its real length (its shape is the padded model's).
    """

    tensors: Mapping[str, torch.Tensor]
    config: PreTrainedConfig
    untrained: Mapping[str, torch.Tensor]
    padding: Mapping[str, tuple[int, int]] = field(default_factory=dict)


def full_model_on_meta(config: PreTrainedConfig) -> PreTrainedModel:
    """The full model of `config` with meta tensors (shapes and names only, no memory).

    The LLM uses the packed attention so pipeline stages can be built on it."""
    attn = {"text_config": PACKED_ATTENTION, "vision_config": "sdpa", "": "sdpa"}
    with torch.device("meta"):
        return architecture_of(config).model_class._from_config(copy.deepcopy(config), attn_implementation=attn)


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name, tied aliases included (``lm_head.weight``), -> the name
    ``named_parameters()`` reports for that tensor (``model.language_model.embed_tokens.weight``)."""
    first: dict[int, str] = {}
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names[name] = first.setdefault(id(param), name)
    return names


def untrained_parameter_names(meta_model: PreTrainedModel) -> set[str]:
    """Parameters of the full model outside every pipeline stage: the forward never uses them."""
    stages = [build_vision_stage(meta_model, 0, 1), build_llm_stage(meta_model, 0, 1)]
    used = {id(p) for stage in stages for p in stage.parameters()}
    return {name for name, p in meta_model.named_parameters() if id(p) not in used}


def rank_parameters(model: PreTrainedModel, modules: Iterable[nn.Module] | None = None) -> RankParameters:
    """This rank's parameters by global name, from the modules it runs.

    model: this rank's full transformers model (``build_model``); pipeline stages are views of it.
        Layers sharded in place (``shard_llm_layer``) stay reachable from it.
    modules: the modules this rank runs, e.g. ``[vision_stage, llm_stage]``; None: the whole model
        (single process).
    """
    meta = full_model_on_meta(model.config)
    full_shapes = {name: p.shape for name, p in meta.named_parameters()}
    canonical = canonical_names(meta)
    by_identity = {id(p): name for name, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    padded, padding = {}, {}
    for module in (modules if modules is not None else [model]):
        padded.update(zero_head_padding(module))
        for local_name, param in module.named_parameters():
            name = by_identity.get(id(param)) or _wrapper_name(model, module, local_name)
            if name is None or name not in canonical:
                raise UserError(f"parameter {local_name!r} of {type(module).__name__} is not a parameter of "
                                f"the full {type(model).__name__}; cannot name it in a checkpoint")
            name = canonical[name]
            if name in tensors:
                if tensors[name] is not param:
                    raise UserError(f"parameter {name} (tied) is held twice on this rank as different tensors; "
                                    "tied weights must stay one tensor")
                continue
            shape = list(param.shape)  # a DTensor reports its global shape
            if id(param) in padded:
                dim, shape[dim] = padded[id(param)][0], padded[id(param)][1]
                padding[name] = padded[id(param)]
            if tuple(shape) != tuple(full_shapes[name]):
                raise UserError(f"parameter {name}: shape {list(param.shape)} is not the full model's "
                                f"{list(full_shapes[name])} (tensor-parallel shards must be DTensors)")
            tensors[name] = param
    untrained_names = untrained_parameter_names(meta)
    untrained = {name: p for name, p in model.named_parameters()
                 if name in untrained_names and tuple(p.shape) == tuple(full_shapes[name]) and not p.is_meta}
    return RankParameters(tensors=tensors, config=model.config, untrained=untrained, padding=padding)


def _wrapper_name(model: PreTrainedModel, module: nn.Module, local_name: str) -> str | None:
    """Global name of a parameter of a vocabulary-parallel wrapper inside an LLMStage."""
    if not isinstance(module, LLMStage):
        return None
    by_identity = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    if local_name == "embedding.embed_tokens.weight":
        return by_identity.get(id(model.get_input_embeddings().weight))
    if local_name in ("head.weight", "head.lm_head.weight"):
        return by_identity.get(id(model.get_output_embeddings().weight))
    return None


def global_name_module(tensors: Mapping[str, nn.Parameter]) -> nn.Module:
    """A module holding exactly `tensors`, each under its global name (``named_parameters()`` gives
    ``model.language_model.layers.1.mlp.up_proj.weight`` for the tensor a pipeline stage calls
    ``layers.0.mlp.up_proj.weight``): the model torch's state_dict API reads names from.

    The parameters are the rank's own objects (no copy), so an optimizer over them is keyed by
    these names, and loading into the module loads into the stages. Never called (no forward)."""
    root = nn.Module()
    for name, param in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(leaf, param)
    return root
