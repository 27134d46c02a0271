"""Give chosen tensors of a model built on the meta device their values, on their device.

A rank builds the whole model on the meta device (names and shapes, no memory), takes its stage
views, and materialises only the tensors those reach (`tensor_names`): from a local weights
directory (`dflop.models.weights_dir`) or by a random init that depends on the seed and each
tensor's name alone (`dflop.models.init_by_name`). Tensors are filled in place
(``torch.utils.swap_tensors``): the same objects stay registered everywhere, so stage views, tied
embeddings (`lm_head.weight` is `embed_tokens.weight`) and LLaVA-OV's ``image_newline`` (on the inner
model and on the image-feature tail) stay shared. Everything else stays on the meta device.

A tensor's global name is its first name in the model (``named_parameters``/``named_buffers`` order),
as checkpoints name it (`dflop.runtime.param_names.canonical_names`): a tied LM head is its embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Iterable

import torch
from torch import nn

from dflop.models.init_by_name import initial_value
from dflop.models.weights_dir import WeightsDirectory


@dataclass(frozen=True)
class NamedTensor:
    """A parameter or buffer of the model under its global name; `stored`: a checkpoint holds it
    (parameters and persistent buffers; a rotary ``inv_freq`` is always computed)."""

    tensor: torch.Tensor
    is_parameter: bool
    stored: bool


def named_tensors(model: nn.Module) -> dict[str, NamedTensor]:
    """Global name -> tensor of every parameter and buffer of `model` (each tensor once)."""
    out: dict[str, NamedTensor] = {}
    seen: set[int] = set()
    for is_parameter in (True, False):
        for prefix, module in model.named_modules():
            slots = module._parameters if is_parameter else module._buffers
            for key, tensor in slots.items():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                stored = is_parameter or key not in module._non_persistent_buffers_set
                out[f"{prefix}.{key}" if prefix else key] = NamedTensor(tensor, is_parameter, stored)
    return out


def tensor_names(model: nn.Module, modules: Iterable[nn.Module]) -> set[str]:
    """Global names of the parameters and buffers `modules` (views of `model`) reach."""
    by_id = {id(t.tensor): name for name, t in named_tensors(model).items()}
    out = set()
    for module in modules:
        for tensor in chain(module.parameters(), module.buffers()):
            if id(tensor) not in by_id:
                raise ValueError(f"a tensor of {type(module).__name__} is not one of the model's")
            out.add(by_id[id(tensor)])
    return out


def materialize(model: nn.Module, names: Iterable[str] | None = None, *, device: torch.device | str = "cpu",
                seed: int | None = None, weights: WeightsDirectory | None = None,
                optional: Iterable[str] = ()) -> None:
    """Give the meta tensors `names` (global names; None: all of `model`) their values on `device`.

    weights: read the stored ones from this directory, which must hold each of them except those in
        `optional` (initialised by name when absent); buffers that are never stored are computed.
    seed: the random init's seed (None: one drawn from torch's global generator).
    All values are computed before any tensor is filled: the init rules of one tensor's module see
    every other tensor still on the meta device (`dflop.models.init_by_name`).
    """
    tensors = named_tensors(model)
    wanted = sorted(tensors if names is None else set(names))
    unknown = [name for name in wanted if name not in tensors]
    if unknown:
        raise ValueError(f"{type(model).__name__} has no parameter or buffer {unknown[0]}")
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    values: dict[str, torch.Tensor] = {}
    if weights is not None:
        optional = set(optional)
        stored = {name: tensors[name].tensor for name in wanted
                  if tensors[name].stored and (name not in optional or name in weights.where)}
        for name, value in weights.read(stored):
            values[name] = value.to(device)
    for name in wanted:
        if name not in values:
            values[name] = initial_value(model, name, seed).to(device)
    for name, value in values.items():
        meta = tensors[name]
        new = nn.Parameter(value, requires_grad=meta.tensor.requires_grad) if meta.is_parameter else value
        torch.utils.swap_tensors(meta.tensor, new)
