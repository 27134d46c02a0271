"""Tensor parallelism (Megatron-style) for the parts of a model: each rank keeps 1/tp of the heads
and of the MLP width, and the partial results are summed with one all-reduce per block.

A block's input goes through `copy_to_tp` (identity forward, all-reduce of the gradient backward),
the column-parallel projections (q, k, v, MLP up/gate) keep their slice of output features, and the
row-parallel projection (attention output, MLP down) sums the partial products with
`reduce_from_tp` (all-reduce forward, identity backward) before adding its bias once. Token
embedding and LM head split the vocabulary; the loss is a vocabulary-parallel cross-entropy.

The functions shard modules in place and return them; a full module is sliced, so a sharded
module computes what the full one computes (tests compare under torchrun with gloo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import fixed_cross_entropy

from dflop.errors import UserError
from dflop.models.packing import IGNORE_INDEX
from dflop.models.stages import LLMStage, VisionStage


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in a tensor-parallel group (``group=None``: the default process group)."""

    rank: int
    size: int
    group: object = None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        x = x.clone()
        dist.all_reduce(x, group=tp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        x = x.clone()
        dist.all_reduce(x, group=tp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Input of a column-parallel block: every rank uses all of it, so input gradients are summed."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum of the ranks' partial results; the output is replicated, so its gradient is not."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def _split(n: int, tp: TPGroup, what: str) -> tuple[int, int]:
    if n % tp.size:
        raise UserError(f"tensor parallelism {tp.size} does not divide {what} ({n})")
    part = n // tp.size
    return tp.rank * part, part


def _column_parallel(linear: nn.Linear, tp: TPGroup, what: str) -> nn.Linear:
    """Keep this rank's slice of output features (heads or MLP columns)."""
    start, part = _split(linear.out_features, tp, what)
    local = nn.Linear(linear.in_features, part, bias=linear.bias is not None,
                      device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        local.weight.copy_(linear.weight[start:start + part])
        if linear.bias is not None:
            local.bias.copy_(linear.bias[start:start + part])
    return local


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: this rank's slice of input features, bias added once."""

    def __init__(self, linear: nn.Linear, tp: TPGroup, what: str):
        super().__init__()
        start, part = _split(linear.in_features, tp, what)
        self.tp = tp
        self.weight = nn.Parameter(linear.weight.detach()[:, start:start + part].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


class TPRMSNorm(nn.Module):
    """RMSNorm over a feature dimension split across ranks (InternViT-6B's QK-norm over all heads)."""

    def __init__(self, norm: nn.Module, tp: TPGroup, what: str):
        super().__init__()
        start, part = _split(norm.weight.numel(), tp, what)
        self.tp = tp
        self.full_dim = norm.weight.numel()
        self.eps = norm.variance_epsilon
        self.weight = nn.Parameter(norm.weight.detach()[start:start + part].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        square_sum = x.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:  # each rank's x feeds every rank's variance: gradients are summed too
            square_sum = _AllReduceSum.apply(square_sum, self.tp)
        x = x * torch.rsqrt(square_sum / self.full_dim + self.eps)
        return self.weight * x.to(dtype)


def _copy_input_to_tp(block: nn.Module, tp: TPGroup) -> None:
    """Route a block's hidden-state input (first positional or ``hidden_states=``) through copy_to_tp."""

    def hook(module, args, kwargs):
        if args:
            return (copy_to_tp(args[0], tp), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": copy_to_tp(kwargs["hidden_states"], tp)}

    block.register_forward_pre_hook(hook, with_kwargs=True)


def shard_llm_layer(layer: nn.Module, tp: TPGroup) -> nn.Module:
    """Qwen2/Llama decoder layer -> this rank's heads and MLP columns (in place)."""
    if tp.size == 1:
        return layer
    attn, mlp = layer.self_attn, layer.mlp
    _split(attn.config.num_attention_heads, tp, "LLM attention heads")
    _split(attn.config.num_key_value_heads, tp, "LLM key/value heads")
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, _column_parallel(getattr(attn, name), tp, f"LLM attention {name} heads"))
    attn.o_proj = RowParallelLinear(attn.o_proj, tp, "LLM attention heads")
    for name in ("gate_proj", "up_proj"):
        setattr(mlp, name, _column_parallel(getattr(mlp, name), tp, "LLM MLP width"))
    mlp.down_proj = RowParallelLinear(mlp.down_proj, tp, "LLM MLP width")
    _copy_input_to_tp(attn, tp)
    _copy_input_to_tp(mlp, tp)
    return layer


def shard_vision_layer(layer: nn.Module, tp: TPGroup) -> nn.Module:
    """SigLIP or InternViT encoder layer -> this rank's heads and MLP columns (in place)."""
    if tp.size == 1:
        return layer
    siglip = hasattr(layer, "self_attn")
    attn, out_name = (layer.self_attn, "out_proj") if siglip else (layer.attention, "projection_layer")
    _split(attn.num_heads, tp, "vision attention heads")
    attn.num_heads //= tp.size  # InternViT reshapes with these; SigLIP infers them
    attn.embed_dim //= tp.size
    if not siglip:
        for name in ("q_norm", "k_norm"):
            if not isinstance(getattr(attn, name), nn.Identity):
                setattr(attn, name, TPRMSNorm(getattr(attn, name), tp, f"vision {name} width"))
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, _column_parallel(getattr(attn, name), tp, f"vision attention {name} heads"))
    setattr(attn, out_name, RowParallelLinear(getattr(attn, out_name), tp, "vision attention heads"))
    layer.mlp.fc1 = _column_parallel(layer.mlp.fc1, tp, "vision MLP width")
    layer.mlp.fc2 = RowParallelLinear(layer.mlp.fc2, tp, "vision MLP width")
    _copy_input_to_tp(attn, tp)
    _copy_input_to_tp(layer.mlp, tp)
    return layer


def shard_projector(projector: nn.Module, tp: TPGroup) -> nn.Module:
    """2-layer MLP projector (LLaVA-OV, InternVL): linear_1 column-, linear_2 row-parallel (in place).
    Anything before linear_1 (InternVL's LayerNorm) stays replicated."""
    if tp.size == 1:
        return projector
    projector.linear_1 = _column_parallel(projector.linear_1, tp, "projector width")
    projector.linear_2 = RowParallelLinear(projector.linear_2, tp, "projector width")
    _copy_input_to_tp(projector.linear_1, tp)
    return projector


class VocabParallelEmbedding(nn.Module):
    """Token embedding holding rows [start, start + V/tp); other ranks fill the other tokens."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup):
        super().__init__()
        self.start, part = _split(embedding.num_embeddings, tp, "vocabulary")
        self.tp = tp
        self.weight = nn.Parameter(embedding.weight.detach()[self.start:self.start + part].clone())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        embeds = F.embedding(local.masked_fill(outside, 0), self.weight)
        embeds = embeds.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(embeds, self.tp)


class VocabParallelCausalLMHead(nn.Module):
    """Final norm + LM head over this rank's vocabulary slice + cross-entropy over the whole vocabulary.

    Same loss as `dflop.models.llm_parts.CausalLMHead` (float32, mean over targets or sum divided
    by ``num_items_in_batch``), without ever gathering the [T, V] logits.
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, tp: TPGroup):
        super().__init__()
        self.start, part = _split(lm_head.out_features, tp, "vocabulary")
        self.tp = tp
        self.norm = norm
        self.weight = nn.Parameter(lm_head.weight.detach()[self.start:self.start + part].clone())

    def forward(self, hidden: torch.Tensor, shift_labels: torch.Tensor,
                num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
        hidden = copy_to_tp(self.norm(hidden), self.tp)
        logits = F.linear(hidden, self.weight).float().view(-1, self.weight.shape[0])  # [T, V/tp]
        targets = shift_labels.view(-1).to(logits.device)
        if self.tp.size == 1:
            return fixed_cross_entropy(logits, targets, num_items_in_batch, IGNORE_INDEX)
        per_token = _VocabParallelCrossEntropy.apply(logits, targets, self.start, self.tp)
        per_token = per_token[targets != IGNORE_INDEX]
        if num_items_in_batch is None:
            return per_token.mean()
        return per_token.sum() / num_items_in_batch


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy [T] of logits split over the vocabulary ([T, V/tp] on each rank).

    Keeps only the local softmax [T, V/tp] for backward (autograd through the same formula would
    also keep the shifted logits: twice the memory of the largest activation of the model).
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, tp):
        row_max = logits.amax(-1, keepdim=True)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - row_max
        local = targets - vocab_start
        mine = (local >= 0) & (local < logits.shape[1])
        index = local.clamp(0, logits.shape[1] - 1).unsqueeze(1)
        target_logit = shifted.gather(1, index).squeeze(1) * mine
        dist.all_reduce(target_logit, group=tp.group)
        softmax = shifted.exp_()
        sum_exp = softmax.sum(-1)
        dist.all_reduce(sum_exp, group=tp.group)
        softmax.div_(sum_exp.unsqueeze(1))
        ctx.save_for_backward(softmax, index, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, mine = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - one_hot(target), in place as backward runs once
        grad.scatter_add_(1, index, -mine.to(grad.dtype).unsqueeze(1))
        grad.mul_(grad_loss.unsqueeze(1))
        return grad, None, None, None


def shard_stage(stage: VisionStage | LLMStage, tp: TPGroup) -> VisionStage | LLMStage:
    """This rank's shard of a pipeline stage (in place): its layers, and projector, or token
    embedding and LM head + loss. An embedding and head tied in one stage stay tied."""
    if tp.size == 1:
        return stage
    if isinstance(stage, VisionStage):
        for layer in stage.layers:
            shard_vision_layer(layer, tp)
        if stage.image_features is not None:
            shard_projector(stage.image_features.projector, tp)
        return stage
    for layer in stage.layers:
        shard_llm_layer(layer, tp)
    embedding = None
    if stage.embedding is not None:
        full_table = stage.embedding.embed_tokens
        embedding = stage.embedding.embed_tokens = VocabParallelEmbedding(full_table, tp)
    if stage.head is not None:
        tied = embedding is not None and stage.head.lm_head.weight is full_table.weight
        stage.head = VocabParallelCausalLMHead(stage.head.norm, stage.head.lm_head, tp)
        if tied:
            stage.head.weight = embedding.weight
    return stage
