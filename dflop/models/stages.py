"""Pipeline-stage modules: views of a built model that share its parameters.

Vision stage i of pp_v runs the patch embeddings (first stage), a range of vision layers, and the
image-feature tail (last stage: projector, packing) -> image features [n_image_tokens, d_model].
LLM stage j of pp_l runs the token embedding + image splice (first stage), a range of decoder
layers on one packed row, and final norm + LM head + loss (last stage).

Chaining the stages computes exactly what the full transformers model computes (tests check the
loss and every gradient against ``model(..., labels=...)``). Between stages only activations
travel: vision [n_tiles, S, d_vision], LLM [1, T, d_model].

The stages are plain model code: memory techniques are applied over them as wrappers, in place
(`dflop.runtime.parallelize.parallelize_stage`: tensor parallelism, then activation recomputation,
then FSDP2). ``build_*_stage(..., recompute=mode)`` applies the recompute wrappers alone
(`dflop.models.recompute.apply_recompute`), for single-process use.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from dflop.errors import UserError
from dflop.models.architectures import ImageLayout, architecture_of
from dflop.models.llm_parts import CausalLMHead, TokenEmbedding, run_decoder_layers
from dflop.models.packing import PACKED_ATTENTION, PackedSequence
from dflop.models.recompute import apply_recompute
from dflop.plan import uniform_layer_split

_PACKING_ATTENTIONS = (PACKED_ATTENTION, "flash_attention_2", "flash_attention_3")


def _check_range(kind: str, stage: int, n_stages: int, layer_range: Sequence[int] | None,
                 n_layers: int) -> tuple[int, int]:
    if not 0 <= stage < n_stages:
        raise UserError(f"{kind} stage {stage} does not exist in a pipeline of {n_stages} stages")
    if layer_range is None:
        return uniform_layer_split(n_layers, n_stages)[stage]
    start, stop = (int(x) for x in layer_range)
    if not 0 <= start <= stop <= n_layers:  # what slicing the layers needs; a plan's split is `Plan.check`'s
        raise UserError(f"{kind} stage {stage}: layer range [{start}, {stop}) is outside [0, {n_layers})")
    return start, stop


class VisionStage(nn.Module):
    """Vision stage: pixels [n_tiles, 3, H, W] (first) or hidden [n_tiles, S, d_vision] in;
    hidden out, or image features [n_image_tokens, d_model] from the last stage."""

    def __init__(self, model: PreTrainedModel, stage: int, n_stages: int, layer_range: Sequence[int] | None = None):
        super().__init__()
        arch = architecture_of(model)
        n_layers = arch.n_feature_layers(model.config)
        self.layer_range = _check_range("vision", stage, n_stages, layer_range, n_layers)
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self._run_layer = arch.run_vision_layer
        self.embeddings = arch.vision_embeddings(model) if self.is_first else None
        self.layers = nn.ModuleList(arch.vision_layers(model)[self.layer_range[0]:self.layer_range[1]])
        self.image_features = arch.image_features(model) if self.is_last else None
        self.recompute = "none"  # the mode `apply_recompute` wrapped the layers in

    def forward(self, x: torch.Tensor, layout: ImageLayout) -> torch.Tensor:
        if x.shape[0] != layout.n_tiles:
            raise UserError(f"vision stage got {x.shape[0]} tiles but the image layout has {layout.n_tiles}")
        hidden = self.run_layers(self.embeddings(x) if self.is_first else x)
        return self.image_features(hidden, layout) if self.is_last else hidden

    def run_layers(self, hidden: torch.Tensor) -> torch.Tensor:
        """The stage's layers (as wrapped) on hidden [n_tiles, P, d_vision] -> [n_tiles, P, d_vision]
        (also the trainer's `VisionRunner`)."""
        for layer in self.layers:
            hidden = self._run_layer(layer, hidden)
        return hidden


class LLMStage(nn.Module):
    """LLM stage on one packed row: token ids [T] (first) or hidden [1, T, d] in; hidden out, or
    the loss (scalar) from the last stage."""

    def __init__(self, model: PreTrainedModel, stage: int, n_stages: int, layer_range: Sequence[int] | None = None):
        super().__init__()
        lm = model.model.language_model
        attn = lm.config._attn_implementation
        if attn not in _PACKING_ATTENTIONS:
            raise UserError(f"LLM attention {attn!r} would let packed samples attend to each other; "
                            f"build the model with one of {', '.join(_PACKING_ATTENTIONS)}")
        self.layer_range = _check_range("LLM", stage, n_stages, layer_range, lm.config.num_hidden_layers)
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.rotary_emb = lm.rotary_emb
        self.embedding = TokenEmbedding(lm.embed_tokens, model.config.image_token_id) if self.is_first else None
        self.layers = nn.ModuleList(lm.layers[self.layer_range[0]:self.layer_range[1]])
        self.head = CausalLMHead(lm.norm, model.lm_head) if self.is_last else None
        self.recompute = "none"  # the mode `apply_recompute` wrapped the layers in
        self.sequence_sharding = None  # set by tensor_parallel.shard_stage for sequence parallelism

    def forward(
        self,
        x: torch.Tensor,
        packed: PackedSequence,
        image_features: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: token ids [T] on the first stage, else hidden [1, T, d]. The last stage needs
        `shift_labels` [T] (`PackedSequence.shift_labels`) and returns the loss. Sequence-parallel:
        hidden in and out is this rank's shard [1, T'/tp, d] of the row padded to T' tokens."""
        sharding = self.sequence_sharding
        if sharding is not None:
            packed, shift_labels = sharding.pad(packed, shift_labels)
        hidden = self.embedding(x, image_features) if self.is_first else x
        if sharding is not None and self.is_first:
            hidden = sharding.scatter(hidden, packed.total_tokens)
        position_embeddings = self.rotary_emb(hidden, packed.position_ids.unsqueeze(0))
        hidden = run_decoder_layers(self.layers, hidden, packed, position_embeddings)
        if not self.is_last:
            return hidden
        if shift_labels is None:
            raise UserError("the last LLM stage needs shift_labels to compute the loss")
        return self.head(hidden, shift_labels, num_items_in_batch)


def build_vision_stage(model: PreTrainedModel, stage: int, n_stages: int,
                       layer_range: Sequence[int] | None = None, recompute: str = "none") -> VisionStage:
    """Vision stage `stage` of `n_stages` over layers [start, stop) (default: uniform split), its
    layers recomputing as `recompute` says (mode none also switches off a selective mode an earlier
    stage over the same layers set)."""
    built = VisionStage(model, stage, n_stages, layer_range)
    apply_recompute(built, recompute, f"vision stage {stage}")
    return built


def build_llm_stage(model: PreTrainedModel, stage: int, n_stages: int,
                    layer_range: Sequence[int] | None = None, recompute: str = "none") -> LLMStage:
    """LLM stage `stage` of `n_stages` over decoder layers [start, stop) (default: uniform split),
    its layers recomputing as `recompute` says (as `build_vision_stage`)."""
    built = LLMStage(model, stage, n_stages, layer_range)
    apply_recompute(built, recompute, f"LLM stage {stage}")
    return built
