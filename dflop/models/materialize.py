"""Give chosen tensors of a model built on the meta device their values, on their device.

A rank builds the whole model on the meta device (names and shapes, no memory), takes its stage
views, and materialises only the tensors those reach (`Materializer`; with tensor parallelism one
part at a time, each just before it is sharded): from a local weights directory
(`dflop.models.weights_dir`) or by a random init that depends on the seed and each tensor's name
alone (`dflop.models.init_by_name`). Tensors are filled in place
(``torch.utils.swap_tensors``): the same objects stay registered everywhere, so stage views, tied
embeddings (`lm_head.weight` is `embed_tokens.weight`) and LLaVA-OV's ``image_newline`` (on the inner
model and on the image-feature tail) stay shared. Everything else stays on the meta device.

A tensor's global name is its first name in the model (``named_parameters``/``named_buffers`` order),
as checkpoints name it (`dflop.runtime.param_names.canonical_names`): a tied LM head is its embedding.
"""

from __future__ import annotations

from contextlib import contextmanager
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


class Materializer:
    """Fills the meta tensors of `model` (built on the meta device) on `device`, in any number of
    calls: by name, or whatever meta tensors a module (a view of the model) still reaches. It holds
    no tensor between calls (a part sharded after its call is freed as it is replaced).

    weights: read the stored tensors from this directory (it must hold each one asked for, except
        the `optional` ones of a call, which are initialised by name when absent); buffers that are
        never stored (rotary ``inv_freq``) are computed.
    seed: the random init's seed (None: one drawn from torch's global generator).
    """

    def __init__(self, model: nn.Module, *, device: torch.device | str = "cpu", seed: int | None = None,
                 weights: WeightsDirectory | None = None):
        self.model = model
        self.device = torch.device(device)
        self.seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
        self.weights = weights

    def __call__(self, names: Iterable[str], optional: Iterable[str] = ()) -> None:
        """Fill the tensors `names` (global names) that are still on the meta device."""
        tensors = named_tensors(self.model)
        names = set(names)
        unknown = sorted(names - set(tensors))
        if unknown:
            raise ValueError(f"{type(self.model).__name__} has no parameter or buffer {unknown[0]}")
        wanted = sorted(name for name in names if tensors[name].tensor.is_meta)
        optional = set(optional)
        values: dict[str, torch.Tensor] = {}
        if self.weights is not None:
            stored = {name: tensors[name].tensor for name in wanted
                      if tensors[name].stored and (name not in optional or name in self.weights.where)}
            for name, value in self.weights.read(stored):
                values[name] = value.to(self.device)
        with _settled(self.model):  # the init rules leave every real tensor as it is
            for name in wanted:
                if name not in values:
                    values[name] = initial_value(self.model, name, self.seed).to(self.device)
        for name, value in values.items():  # only now: the rules above saw every other tensor on meta
            meta = tensors[name]
            new = nn.Parameter(value, requires_grad=meta.tensor.requires_grad) if meta.is_parameter else value
            torch.utils.swap_tensors(meta.tensor, new)

    def module(self, module: nn.Module) -> None:
        """Fill the tensors of the model that `module` reaches and are still on the meta device
        (others it holds, such as tensor-parallel shards, are left alone)."""
        pending = {id(t) for t in chain(module.parameters(), module.buffers()) if t.is_meta}
        self([name for name, t in named_tensors(self.model).items() if id(t.tensor) in pending])


def materialize(model: nn.Module, names: Iterable[str] | None = None, *, device: torch.device | str = "cpu",
                seed: int | None = None, weights: WeightsDirectory | None = None,
                optional: Iterable[str] = ()) -> None:
    """Fill the meta tensors `names` (None: all) of `model` in one call (`Materializer`)."""
    Materializer(model, device=device, seed=seed, weights=weights)(
        named_tensors(model) if names is None else names, optional)


@contextmanager
def _settled(model: nn.Module):
    """Mark every real tensor of `model` initialised (transformers' ``_is_hf_initialized``, which its
    init functions honour) while init rules run, so a rule that reaches beyond its target (SigLIP's
    attention initialises its projections) cannot redraw a tensor filled in an earlier call."""
    marked = []
    for tensor in chain(model.parameters(), model.buffers()):
        if not tensor.is_meta and not getattr(tensor, "_is_hf_initialized", False):
            tensor._is_hf_initialized = True
            marked.append(tensor)
    try:
        yield
    finally:
        for tensor in marked:
            del tensor._is_hf_initialized
