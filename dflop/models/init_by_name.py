"""Random initial values that depend on the seed and each tensor's name, not on the layout.

A rank materialises only its own stages' tensors (`dflop.models.materialize`), so one
tensor's values must not depend on which others are built beside it, or in what order: a layer is
then bitwise the same whichever pipeline split or rank builds it, and the same as in the whole
model built in one process. Each tensor therefore draws from the global generator seeded from
(seed, its global name) alone, always on the CPU (so a CUDA build gets the same values).

The rule is transformers' own: the ``_init_weights`` of the tensor's module and then of each of its
ancestors (a parent may overwrite a child's rule, as SigLIP's attention does with xavier), each by
its nearest enclosing `PreTrainedModel` (the vision tower keeps SigLIP's or InternViT's rules, the
LLM its ``initializer_range``): the order transformers' ``initialize_weights`` applies them in. All
other tensors of the model stay on the meta device meanwhile, where the rules' writes are no-ops
that draw no random numbers. Buffers left empty on the meta device (rotary ``inv_freq``, position
ids) are recomputed by the same rules.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from transformers import PreTrainedModel


def derived_seed(seed: int, name: str) -> int:
    """The generator seed of tensor `name` (stable across processes, unlike Python's ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def initial_value(model: PreTrainedModel, name: str, seed: int) -> torch.Tensor:
    """A new CPU tensor holding the initial value of `name` (a parameter or buffer name of `model`,
    whose tensors are on the meta device). Raises RuntimeError when no rule writes it."""
    path, _, leaf = name.rpartition(".")
    chain = _rule_chain(model, path)
    owner = chain[0][0]
    slots = owner._parameters if leaf in owner._parameters else owner._buffers
    meta = slots[leaf]
    value = torch.empty(meta.shape, dtype=meta.dtype, device="cpu")
    slots[leaf] = value  # the one real tensor the rules see
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            # The CPU generator only: `torch.manual_seed` also queues a seed of every CUDA and MTIA
            # device, formatting the Python stack each time, which outweighed small tensors' draws
            # (and left the CUDA generators seeded past `fork_rng`).
            torch.default_generator.manual_seed(derived_seed(seed, name))
            for module, rules in chain:
                rules._init_weights(module)
    finally:
        slots[leaf] = meta
    if value._version == 0:
        raise RuntimeError(f"no transformers init rule writes {name} ({type(owner).__name__}); "
                           f"it would stay uninitialised")
    return value


def _rule_chain(model: PreTrainedModel, path: str) -> list[tuple[nn.Module, PreTrainedModel]]:
    """(module, the PreTrainedModel whose rules apply to it) from the module at `path` up to the root."""
    modules = [model]
    for part in path.split(".") if path else ():
        modules.append(getattr(modules[-1], part))
    chain, rules = [], model
    for module in modules:
        if isinstance(module, PreTrainedModel):
            rules = module
        chain.append((module, rules))
    return chain[::-1]
