"""Activation recomputation of a pipeline stage (plan key ``recompute``: none | selective | full),
applied as wrappers over the plain layers (`recompute_layer`, `apply_recompute`).

Recomputation trades backward time for the memory of the tensors autograd keeps from a
microbatch's forward to its backward (docs/design.md; 1F1B keeps up to pp of them in flight):

- ``full``: every layer of the stage is wrapped (torch's ``checkpoint_wrapper``, whose checkpoint
  function is `checkpointed_call`: non-reentrant `torch.utils.checkpoint`), so a layer keeps only
  its inputs and runs its forward again in backward;
- ``selective``: only the attention core (the attention function: query, key, value -> output) is
  recomputed, as Megatron's selective recomputation recomputes core attention. The hook is the
  attention function transformers' attention modules look up by ``config._attn_implementation``:
  the layer's attention module gets a copy of its config naming a checkpointing wrapper of its own
  function (``"<name>+recompute"``), so the packed LLM path (``dflop_packed``, flash-attention) and
  the vision towers' SDPA (SigLIP, InternViT) are covered alike;
- ``none``: the layers run as they are.

Selective is not a ``create_selective_checkpoint_contexts`` policy over the whole layer: that
checkpoints the layer, so it would keep the layer's inputs and hold the tensors its policy saves in
its own cache, out of sight of saved-tensor hooks, where this keeps what mode none keeps except the
core's internals, all of it visible to `dflop.profiling._memory.saved_tensor_bytes`.

With flash-style kernels (CPU flash SDPA, flash-attn varlen) the core keeps only q, k, v, its
output and the log-sum-exp, so selective saves little; it saves the O(L^2) probabilities of
kernels that keep them (eager / math attention). `dflop.costmodel.activations` has the bytes.

The models have no dropout (attention and hidden dropout are 0), so recomputation needs no RNG
replay; torch's checkpoint still restores the RNG state (its default).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dflop.errors import UserError
from dflop.models.packing import in_compute_dtype
from dflop.plan import RECOMPUTE_MODES

_SUFFIX = "+recompute"


def check_mode(mode: str, where: str) -> str:
    if mode not in RECOMPUTE_MODES:
        raise UserError(f"{where}: recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    return mode


def checkpointed_call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under non-reentrant checkpoint.

    Every tensor of the arguments (inside kwargs and tuples too) is passed to the checkpoint
    positionally: the checkpoint saves exactly those for backward, so what it holds is what
    saved-tensor hooks see (tensors left in a closure would be held but not seen).
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def run(*tensors):
        filled = list(leaves)
        for i, tensor in zip(where, tensors):
            filled[i] = tensor
        a, k = pytree.tree_unflatten(filled, spec)
        return fn(*a, **k)

    return checkpoint(run, *(leaves[i] for i in where), use_reentrant=False)


def _recomputing(name: str):
    """The attention function `name` with its call checkpointed (the core's saved tensors dropped)."""
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(name, None)
    if inner is None:
        raise UserError(f"selective recompute: attention {name!r} is not registered with transformers")

    def attention(module, query, key, value, attention_mask, **kwargs):
        # in the compute dtype first: the checkpoint keeps its inputs, and under autocast rotary's
        # query and key are float32 (twice the bytes of the bf16 ones the kernel takes)
        query, key, value = in_compute_dtype(query, key, value)
        return checkpointed_call(inner, module, query, key, value, attention_mask, **kwargs)

    return attention


def attention_module(layer: nn.Module) -> nn.Module:
    """The module of `layer` that calls the attention function (LLM decoder layers and SigLIP:
    ``self_attn``; InternViT: ``attention``)."""
    for name in ("self_attn", "attention"):
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module) and hasattr(module, "config"):
            return module
    raise UserError(f"selective recompute: {type(layer).__name__} has no attention module (self_attn / attention)")


def set_core_recompute(layer: nn.Module, on: bool) -> None:
    """Make `layer`'s attention recompute its core in backward, or stop (module docstring, ``selective``).

    Only this layer's attention module sees the config copy; the model's config and the other
    layers keep theirs. Turning it off gives the module its original config back (no-op if never on).
    """
    if not on:
        for module in layer.modules():
            original = module.__dict__.pop("_config_without_recompute", None)
            if original is not None:
                module.config = original
        return
    module = attention_module(layer)
    if "_config_without_recompute" in module.__dict__:
        return
    name = module.config._attn_implementation
    wrapped = name + _SUFFIX
    if wrapped not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(wrapped, _recomputing(name))
    config = copy.copy(module.config)
    config._attn_implementation_internal = wrapped  # this config only (the setter would also walk sub-configs)
    module._config_without_recompute = module.config
    module.config = config


def recompute_layer(layer: nn.Module, mode: str) -> nn.Module:
    """`layer` as a stage in recompute `mode` runs it (module docstring): under ``full`` a checkpoint
    wrapper around it, else the layer itself, its attention core recomputing under ``selective``
    only. A wrapper passed in is unwrapped first, so a layer can be switched between modes."""
    if isinstance(layer, CheckpointWrapper):
        layer = layer._checkpoint_wrapped_module
    set_core_recompute(layer, mode == "selective")
    return checkpoint_wrapper(layer, checkpoint_fn=checkpointed_call) if mode == "full" else layer


def apply_recompute(stage: nn.Module, mode: str, where: str) -> None:
    """Make each of ``stage.layers`` (an ``nn.ModuleList`` of transformer layers) recompute as
    `mode` says, in place (`recompute_layer`), and record the mode as ``stage.recompute``.

    The stage's embeddings, image-feature tail and LM head are never recomputed. `where` names the
    stage in the error for an unknown mode."""
    check_mode(mode, where)
    for i, layer in enumerate(stage.layers):
        stage.layers[i] = recompute_layer(layer, mode)
    stage.recompute = mode
