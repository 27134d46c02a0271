"""Tensor parallelism with torch's DTensor: each rank keeps 1/tp of the heads, of the MLP width and
of the vocabulary, and ``parallelize_module`` inserts the collectives.

Layout (Megatron's, expressed as DTensor placements on a 1-D device mesh over the TP group):
- a block's hidden-state input is declared replicated once (``PrepareModuleInput``), so the
  gradient of that input is summed over the TP ranks by one all-reduce per block in backward;
- column-parallel projections (q, k, v, MLP up/gate, projector linear_1) keep their slice of output
  features (weight ``Shard(0)``) and hand a plain local tensor to the attention core / activation;
- row-parallel projections (attention output, MLP down, projector linear_2) take that local slice
  (weight ``Shard(1)``), all-reduce the partial products and add the bias once;
- the token embedding is row-parallel over the vocabulary (each rank looks up its rows, the rest
  are masked and summed in: `VocabParallelEmbedding`, see there why not ``RowwiseParallel``);
- the LM head is column-parallel over the vocabulary and its [T, V/tp] logits stay local: the
  loss is a vocabulary-parallel cross-entropy (`_VocabParallelCrossEntropy`) that never gathers
  them and whose backward needs no collective context around the pipeline (``loss_parallel``
  would have to enclose every backward the pipeline schedule runs).

Sequence parallelism (Megatron-SP, ``sequence_parallel=True``; LLM only) also shards what lies
between those regions along the sequence: each rank keeps tokens [r T/tp, (r+1) T/tp) of the
residual stream and runs the RMSNorms on them (``SequenceParallel``); the column-parallel
projections all-gather their input (``PrepareModuleInput`` Shard(1) -> Replicate: attention sees
the whole packed row, its sample boundaries and rotary positions are the full row's) and the
row-parallel ones reduce-scatter their output (``RowwiseParallel(output_layouts=Shard(1))``). So
each all-reduce becomes a reduce-scatter + all-gather of the same total traffic, and the
norms' and residuals' saved tensors are 1/tp. The packed row is padded to a multiple of tp
(`SequenceSharding`); a stage sends and receives its sequence shard [1, T/tp, d] (1/tp of the P2P
traffic, as Megatron does).

Parameters become DTensors (their ``shape`` is the global shape; ``to_local()`` is this rank's
slice), which the checkpoint (DCP) and export read directly. InternViT-6B's QK-norm normalises over
all heads at once; its weight is a ``Shard(0)`` DTensor and its sum of squares is all-reduced
(`TPRMSNorm`).

Vision heads that tp does not divide (InternViT-6B's 25 at TP 8) are padded with zero heads to
``padded_vision_heads`` (32; NVIDIA's recipe for NVLM): zero q/k/v rows (and biases, QK-norm
weights) and zero output-projection columns. A zero head's value is 0, it adds nothing through its
zero output columns, and every gradient reaching its weights is exactly 0, so AdamW (weight decay
on zero) keeps them 0. Those parameters' global shapes are the padded model's: the checkpoint
saves them so (a resume has the same plan, hence the same padding) and the export drops the
padding (`zero_head_padding`, `drop_head_padding`). The ``shard_*`` functions shard modules in place
and return them. The full module's values are scattered from TP rank 0 (``distribute_tensor``, a
collective: every rank shards the same modules in the same order), so a sharded module computes what
the full one computes (tests compare under torchrun).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from transformers.loss.loss_utils import fixed_cross_entropy

from dflop.errors import UserError
from dflop.models.info import padded_vision_heads
from dflop.models.packing import IGNORE_INDEX, PackedSequence
from dflop.models.stages import LLMStage, VisionStage

# (id of the group(s), device type) -> (group(s), mesh); holding the groups keeps their ids from being reused
_MESHES: dict[tuple, tuple[object, DeviceMesh]] = {}
DP_DIM, TP_DIM = "dp", "tp"  # dimension names of a (dp, tp) mesh (`TPGroup.dp_tp_mesh`)


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in a tensor-parallel group (``group=None``: the default process group).

    dp_group, grid: set where FSDP2 also shards the module over its data-parallel replicas
    (`dflop.runtime.sharding`): the replicas' group and the stage's global ranks [replica][tp rank].
    FSDP2 composes with TP only when the TP DTensors live on the "tp" dimension of the same 2-D
    mesh whose "dp" dimension it shards over (as torchtitan builds it), so TP then uses that."""

    rank: int
    size: int
    group: object = None
    dp_group: object = None
    grid: tuple[tuple[int, ...], ...] = ()

    def mesh(self, device_type: str) -> DeviceMesh:
        """The 1-D device mesh over this group that the DTensor placements refer to (one per group):
        the "tp" dimension of `dp_tp_mesh` where the module is also sharded over its replicas."""
        if self.dp_group is not None:
            return self.dp_tp_mesh(device_type)[TP_DIM]
        group = self.group if self.group is not None else dist.group.WORLD
        key = (id(group), device_type)
        if key not in _MESHES:
            _MESHES[key] = (group, DeviceMesh.from_group(group, device_type))
        return _MESHES[key][1]

    def dp_tp_mesh(self, device_type: str) -> DeviceMesh:
        """The 2-D (dp, tp) mesh over the stage's ranks, made from the existing groups (one per pair)."""
        key = (id(self.dp_group), id(self.group), device_type)
        if key not in _MESHES:
            mesh = DeviceMesh.from_group([self.dp_group, self.group], device_type, mesh=torch.tensor(self.grid),
                                         mesh_dim_names=(DP_DIM, TP_DIM))
            _MESHES[key] = ((self.dp_group, self.group), mesh)
        return _MESHES[key][1]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor, outside autograd: the local shard of a DTensor (the same
    storage, so in-place ops write through), any other tensor as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def is_tp_shard(tensor: torch.Tensor) -> bool:
    """Whether a DTensor holds only a slice of its global tensor on this rank along tensor
    parallelism (an unnamed TP mesh or the "tp" dimension; FSDP2's data-parallel shard is not one)."""
    if not isinstance(tensor, DTensor):
        return False
    names = tensor.device_mesh.mesh_dim_names
    return any(p.is_shard() for i, p in enumerate(tensor.placements) if names is None or names[i] == TP_DIM)


def _mesh_for(module: nn.Module, tp: TPGroup) -> DeviceMesh:
    return tp.mesh(next(module.parameters()).device.type)


def _split(n: int, tp: TPGroup, what: str) -> tuple[int, int]:
    if n % tp.size:
        raise UserError(f"tensor parallelism {tp.size} does not divide {what} ({n})")
    part = n // tp.size
    return tp.rank * part, part


def _replicated_input(keyword: bool) -> PrepareModuleInput:
    """Declare a block's hidden-state input (``hidden_states=`` or the first positional argument)
    replicated, so the column-parallel projections that share it sum its gradient once."""
    if keyword:
        return PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                  desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                  use_local_output=False)
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                              use_local_output=False)


def _sequence_sharded_input(keyword: bool) -> PrepareModuleInput:
    """Sequence parallelism: a block's input arrives as this rank's tokens (``Shard(1)``, the
    norm's output) and is all-gathered, so the column-parallel projections see the whole row."""
    if keyword:
        return PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                  desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                  use_local_output=False)
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                              use_local_output=False)


def _sequence_parallel_norm(norm: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``SequenceParallel`` on a norm, whose replicated weight's gradient is then summed over
    this rank's tokens only (a ``Partial`` DTensor): all-reduce it as it accumulates, so the
    gradient sync, clipping and optimizer read a complete replicated gradient, as without SP
    (Megatron all-reduces these once per step; here it is h numbers per norm per microbatch; the
    trainer pre-zeroes gradients, and adding a Partial gradient into a replicated one all-reduces it
    the same way, so there the hook finds nothing left to do)."""
    parallelize_module(norm, mesh, SequenceParallel())

    def reduce(param: torch.Tensor) -> None:
        if param.grad.placements != param.placements:
            param.grad = param.grad.redistribute(placements=param.placements)

    for param in norm.parameters():
        param.register_post_accumulate_grad_hook(reduce)
    return norm


class SequenceSharding:
    """Where an LLM stage's packed row is split along the sequence (sequence parallelism).

    The row is padded to a multiple of tp with one extra sample of ignored tokens: attention keeps
    samples apart and the padded labels are ignored, so the pad changes no loss and no gradient.
    Not DTensor's uneven sharding: the parallel styles build their DTensors with ``from_local``,
    which takes the global length to be tp x the local one, so uneven shards would be gathered
    and scattered at the wrong lengths.
    """

    def __init__(self, tp: TPGroup):
        self.tp = tp

    def pad(self, packed: PackedSequence, shift_labels: torch.Tensor | None):
        """The padded row's sample boundaries and (last stage) its labels."""
        pad = -packed.total_tokens % self.tp.size
        if not pad:
            return packed, shift_labels
        padded = PackedSequence.from_lengths(packed.lengths + (pad,), device=packed.position_ids.device)
        if shift_labels is not None:
            shift_labels = F.pad(shift_labels, (0, pad), value=IGNORE_INDEX)
        return padded, shift_labels

    def scatter(self, hidden: torch.Tensor, total_tokens: int) -> torch.Tensor:
        """Replicated embeddings [1, T, d] -> this rank's tokens of the padded row [1, T'/tp, d]
        (backward: all-gather of the gradient). Done after the image splice, which needs the
        whole row; the vocabulary-parallel lookup therefore still all-reduces."""
        hidden = F.pad(hidden, (0, 0, 0, total_tokens - hidden.shape[1]))
        mesh = self.tp.mesh(hidden.device.type)
        return DTensor.from_local(hidden, mesh, [Replicate()], run_check=False).redistribute(
            placements=[Shard(1)]).to_local()


class TPRMSNorm(nn.Module):
    """RMSNorm over a feature dimension split across ranks (InternViT-6B's QK-norm over all heads).

    full_dim: the width the mean of squares divides by, when the weight holds zero heads beyond
    it (their features are 0 and add nothing to the sum)."""

    def __init__(self, norm: nn.Module, tp: TPGroup, what: str, full_dim: int | None = None):
        super().__init__()
        _split(norm.weight.numel(), tp, what)
        self.tp = tp
        self.full_dim = full_dim or norm.weight.numel()
        self.eps = norm.variance_epsilon
        mesh = tp.mesh(norm.weight.device.type)
        self.weight = nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Shard(0)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        square_sum = x.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:  # each rank's x feeds every rank's variance: gradients are summed too
            square_sum = _AllReduceSum.apply(square_sum, self.tp)
        x = x * torch.rsqrt(square_sum / self.full_dim + self.eps)
        return self.weight.to_local() * x.to(dtype)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group whose output feeds every rank: the gradient is summed as well."""

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


def shard_llm_layer(layer: nn.Module, tp: TPGroup, sequence_parallel: bool = False) -> nn.Module:
    """Qwen2/Llama decoder layer -> this rank's heads and MLP columns (in place); with
    `sequence_parallel`, its input and output are this rank's tokens [1, T/tp, d]."""
    if tp.size == 1:
        return layer
    config = layer.self_attn.config
    _split(config.num_attention_heads, tp, "LLM attention heads")
    _split(config.num_key_value_heads, tp, "LLM key/value heads")
    _split(config.intermediate_size, tp, "LLM MLP width")
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()}
    if sequence_parallel:
        for name in ("input_layernorm", "post_attention_layernorm"):
            _sequence_parallel_norm(getattr(layer, name), _mesh_for(layer, tp))
        plan.update({"self_attn": _sequence_sharded_input(keyword=True), "mlp": _sequence_sharded_input(keyword=False),
                     "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                     "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
    else:
        plan.update({"self_attn": _replicated_input(keyword=True), "mlp": _replicated_input(keyword=False),
                     "self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    return parallelize_module(layer, _mesh_for(layer, tp), plan)


def shard_vision_layer(layer: nn.Module, tp: TPGroup) -> nn.Module:
    """SigLIP or InternViT encoder layer -> this rank's heads and MLP columns (in place); heads
    that tp does not divide are first padded with zero heads (module docstring)."""
    if tp.size == 1:
        return layer
    siglip = hasattr(layer, "self_attn")
    attn_name, out_name = ("self_attn", "out_proj") if siglip else ("attention", "projection_layer")
    attn = getattr(layer, attn_name)
    _split(layer.mlp.fc1.out_features, tp, "vision MLP width")
    real_width = attn.num_heads * attn.head_dim
    heads = _pad_heads(attn, out_name, tp.size)
    attn.num_heads = heads // tp.size  # InternViT reshapes with these; SigLIP infers them
    attn.embed_dim = attn.num_heads * attn.head_dim
    if not siglip:
        for name in ("q_norm", "k_norm"):
            if not isinstance(getattr(attn, name), nn.Identity):
                setattr(attn, name, TPRMSNorm(getattr(attn, name), tp, f"vision {name} width", real_width))
    plan = {attn_name: _replicated_input(keyword=siglip), "mlp": _replicated_input(keyword=False),
            f"{attn_name}.q_proj": ColwiseParallel(), f"{attn_name}.k_proj": ColwiseParallel(),
            f"{attn_name}.v_proj": ColwiseParallel(), f"{attn_name}.{out_name}": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    return parallelize_module(layer, _mesh_for(layer, tp), plan)


@dataclass(frozen=True)
class HeadPadding:
    """Zero heads appended to an attention (set as its ``zero_head_padding``): the real width
    (heads x head_dim) and, per parameter name within the attention, the dimension padded."""

    real_width: int
    dims: tuple[tuple[str, int], ...]


def _pad_heads(attn: nn.Module, out_name: str, tp: int) -> int:
    """Append zero heads to `attn` (in place) up to `padded_vision_heads`; returns the head count."""
    heads = padded_vision_heads(_VisionOnly(attn.config), tp)
    if heads == attn.num_heads:
        return heads
    real, width = attn.num_heads * attn.head_dim, heads * attn.head_dim
    dims = []
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm", out_name):
            module = getattr(attn, name, None)  # SigLIP has no QK-norm
            dim = 1 if name == out_name else 0
            for pname in ("weight", "bias"):
                param = getattr(module, pname, None)
                if param is None or param.dim() <= dim:  # the output projection's bias is not per head
                    continue
                pad = [0, 0] * (param.dim() - 1 - dim) + [0, width - real]
                setattr(module, pname, nn.Parameter(F.pad(param, pad), requires_grad=param.requires_grad))
                dims.append((f"{name}.{pname}", dim))
            if isinstance(module, nn.Linear):
                module.in_features, module.out_features = module.weight.shape[1], module.weight.shape[0]
    attn.zero_head_padding = HeadPadding(real, tuple(dims))
    return heads


class _VisionOnly:
    """`padded_vision_heads` reads the model config's vision part; an attention holds only that."""

    def __init__(self, vision_config):
        self.vision_config = vision_config


def zero_head_padding(module: nn.Module) -> dict[int, tuple[int, int]]:
    """id(parameter) -> (padded dimension, real length) of every parameter of `module` that holds
    zero heads (`shard_vision_layer`): what a reader of the weights must cut off."""
    out = {}
    for sub in module.modules():
        padding = getattr(sub, "zero_head_padding", None)
        for name, dim in padding.dims if padding is not None else ():
            out[id(sub.get_parameter(name))] = (dim, padding.real_width)
    return out


def drop_head_padding(name: str, tensor: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """The real part of a whole (gathered) padded tensor: its first `length` entries along `dim`.
    Raises RuntimeError naming parameter `name` if the cut part is not all zero (the zero heads
    would then have changed the trained function, so the unpadded model would not reproduce it)."""
    if tensor.shape[dim] < length:
        raise RuntimeError(f"parameter {name}: {tensor.shape[dim]} entries along dim {dim}, "
                           f"fewer than its real {length}")
    if tensor.narrow(dim, length, tensor.shape[dim] - length).count_nonzero():
        raise RuntimeError(f"parameter {name}: its zero-head padding is no longer zero; "
                           f"the padded heads were trained")
    return tensor.narrow(dim, 0, length).contiguous()


def shard_projector(projector: nn.Module, tp: TPGroup) -> nn.Module:
    """2-layer MLP projector (LLaVA-OV, InternVL): linear_1 column-, linear_2 row-parallel (in place).
    Anything before linear_1 (InternVL's LayerNorm) stays replicated."""
    if tp.size == 1:
        return projector
    _split(projector.linear_1.out_features, tp, "projector width")
    plan = {"linear_1": ColwiseParallel(), "linear_2": RowwiseParallel()}
    return parallelize_module(projector, _mesh_for(projector, tp), plan)


class VocabParallelEmbedding(nn.Module):
    """Token embedding holding rows [start, start + V/tp) as a ``Shard(0)`` DTensor; a token outside
    them looks up zeros here and its row on its owner, and the ranks' results are summed.

    Not ``RowwiseParallel`` on the ``nn.Embedding``: torch 2.13 has no row-sharded strategy for the
    embedding backward, so that gives every rank a replicated [V, d] weight gradient (the whole
    vocabulary, per TP rank, per microbatch). Here the lookup is local and so is its gradient.
    """

    def __init__(self, embedding: nn.Embedding, tp: TPGroup):
        super().__init__()
        self.start, part = _split(embedding.num_embeddings, tp, "vocabulary")
        self.tp = tp
        self.mesh = tp.mesh(embedding.weight.device.type)
        self.weight = nn.Parameter(distribute_tensor(embedding.weight.detach(), self.mesh, [Shard(0)]))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.to_local()
        local = input_ids - self.start
        outside = (local < 0) | (local >= rows.shape[0])
        embeds = F.embedding(local.masked_fill(outside, 0), rows).masked_fill(outside.unsqueeze(-1), 0.0)
        partial = DTensor.from_local(embeds, self.mesh, [Partial()], run_check=False)
        return partial.redistribute(placements=[Replicate()]).to_local()


class VocabParallelCausalLMHead(nn.Module):
    """Final norm + LM head over this rank's vocabulary slice + cross-entropy over the whole vocabulary.

    Same loss as `dflop.models.llm_parts.CausalLMHead` (float32, mean over targets or sum divided
    by ``num_items_in_batch``), without ever gathering the [T, V] logits. `lm_head` is sharded in
    place (column-parallel over the vocabulary, local logits out).
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, tp: TPGroup, sequence_parallel: bool = False):
        super().__init__()
        self.vocab_start, _ = _split(lm_head.out_features, tp, "vocabulary")
        self.tp = tp
        self.norm = norm
        if tp.size > 1 and sequence_parallel:  # norm on this rank's tokens, all-gathered into the head
            self.norm = _sequence_parallel_norm(norm, _mesh_for(norm, tp))
            self.lm_head = parallelize_module(lm_head, _mesh_for(lm_head, tp),
                                              ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1)))
        else:
            self.lm_head = lm_head if tp.size == 1 else parallelize_module(
                lm_head, _mesh_for(lm_head, tp), ColwiseParallel(output_layouts=Shard(-1)))

    def forward(self, hidden: torch.Tensor, shift_labels: torch.Tensor,
                num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        logits = logits.view(-1, logits.shape[-1])  # [T, V/tp]
        targets = shift_labels.view(-1).to(logits.device)
        if self.tp.size == 1:
            return fixed_cross_entropy(logits.float(), targets, num_items_in_batch, IGNORE_INDEX)
        per_token = _VocabParallelCrossEntropy.apply(logits, targets, self.vocab_start, self.tp)
        per_token = per_token[targets != IGNORE_INDEX]
        if num_items_in_batch is None:
            return per_token.mean()
        return per_token.sum() / num_items_in_batch


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy [T] (float32) of logits split over the vocabulary ([T, V/tp] on each
    rank, any float dtype; their gradient comes back in it).

    Computed in float32 whatever the logits' dtype: formed in place in bfloat16, the shifted logits,
    their exponentials and row sums keep 8 significant bits (the loss of [64, 2048] logits of scale
    4 was off by up to 0.07; `tests/models/test_tensor_parallel.py`). Keeps
    only the local float32 softmax [T, V/tp] for backward (autograd through the same formula would
    also keep the shifted logits: twice the memory of the largest activation of the model).
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, tp):
        ctx.logits_dtype = logits.dtype
        logits = logits.float()  # no copy when float32 already
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
        return grad.to(ctx.logits_dtype), None, None, None


def shard_stage(stage: VisionStage | LLMStage, tp: TPGroup, sequence_parallel: bool = False,
                materialize: Callable[[nn.Module], None] | None = None) -> VisionStage | LLMStage:
    """This rank's shard of a pipeline stage (in place): its layers, and projector, or token
    embedding and LM head + loss. An embedding and head tied in one stage stay tied.
    `sequence_parallel` (LLM stages, tp > 1): the stage's input and output are its sequence shard.
    `materialize`: fills a part's meta tensors (`dflop.models.materialize.Materializer.module`); it
    is called on each part just before that part is sharded, then on the whole stage, so a rank
    holds one unsharded part at a time, not its whole stage."""
    fill = materialize or (lambda module: None)
    if tp.size == 1:
        fill(stage)
        return stage
    if isinstance(stage, VisionStage):
        if sequence_parallel:
            raise UserError("vision.sequence_parallel: sequence parallelism is implemented for the LLM only; "
                            "set it to false for the vision tower")
        for layer in stage.layers:
            fill(layer)
            shard_vision_layer(layer, tp)
        if stage.image_features is not None:
            fill(stage.image_features)
            shard_projector(stage.image_features.projector, tp)
        fill(stage)
        return stage
    for layer in stage.layers:
        fill(layer)
        shard_llm_layer(layer, tp, sequence_parallel)
    if sequence_parallel:
        stage.sequence_sharding = SequenceSharding(tp)
    tied = (stage.embedding is not None and stage.head is not None
            and stage.head.lm_head.weight is stage.embedding.embed_tokens.weight)
    replaced = None
    if stage.embedding is not None:
        fill(stage.embedding)
        replaced = stage.embedding.embed_tokens
        stage.embedding.embed_tokens = VocabParallelEmbedding(replaced, tp)
    if stage.head is not None:
        fill(stage.head)
        whole_head = stage.head.lm_head.weight
        stage.head = VocabParallelCausalLMHead(stage.head.norm, stage.head.lm_head, tp, sequence_parallel)
        if tied:  # the same vocabulary slice on this rank: keep one tensor
            stage.head.lm_head.weight = stage.embedding.embed_tokens.weight
        elif stage.head.lm_head.weight is not whole_head:
            # the whole table the shard replaced: a head tied to a token embedding on another stage
            # is still registered there in the full model (which would keep it, [V, d], alive)
            _release(whole_head)
    if replaced is not None:
        _release(replaced.weight)
    fill(stage)
    return stage


def _release(param: nn.Parameter) -> None:
    """Free a whole tensor a sharded wrapper replaced (the full model's token embedding table, [V, d]
    on every TP rank): the same object stays registered, so global names still resolve, on the
    meta device."""
    with torch.no_grad():
        torch.utils.swap_tensors(param, nn.Parameter(torch.empty_like(param, device="meta"),
                                                     requires_grad=param.requires_grad))
