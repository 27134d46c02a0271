"""The pieces of an LLM pipeline stage on a packed row: token embedding with the image splice,
decoder layers, and final norm + LM head + loss.

They wrap the transformers modules (sharing their parameters), so a stage computes what the full
transformers model computes, and the profiler times the same code the stages run.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from dflop.errors import UserError
from dflop.models.packing import PackedSequence


class TokenEmbedding(nn.Module):
    """Token ids [T] + image features [n_image_tokens, d] -> embeddings [1, T, d].

    Image features replace the embeddings of the image placeholder tokens, in order (as
    transformers' ``masked_scatter`` splice does).
    """

    def __init__(self, embed_tokens: nn.Module, image_token_id: int):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.image_token_id = image_token_id

    def forward(self, input_ids: torch.Tensor, image_features: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids.unsqueeze(0))
        is_image = input_ids == self.image_token_id
        n_slots = int(is_image.sum())
        n_features = 0 if image_features is None else image_features.shape[0]
        if n_slots != n_features:
            raise UserError(f"packed batch has {n_slots} image placeholder tokens (id {self.image_token_id}) "
                            f"but {n_features} image feature rows")
        if n_features == 0:
            return embeds
        mask = is_image.view(1, -1, 1).expand_as(embeds)
        return embeds.masked_scatter(mask, image_features.to(embeds.dtype))


class CausalLMHead(nn.Module):
    """Final norm + LM head + next-token cross-entropy: hidden [1, T, d] -> loss (scalar, float32).

    The loss is transformers' causal-LM loss on targets already shifted inside each sample
    (`PackedSequence.shift_labels`): the mean over target tokens, or the sum divided by
    ``num_items_in_batch`` when given (so microbatches of one step add up to the step's mean).
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor, shift_labels: torch.Tensor,
                num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        return ForCausalLMLoss(logits, None, logits.shape[-1], num_items_in_batch=num_items_in_batch,
                               shift_labels=shift_labels)


def run_decoder_layers(layers, hidden: torch.Tensor, packed: PackedSequence,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Decoder layers on one packed row: hidden [1, T, d] -> [1, T, d].

    `position_embeddings` is the rotary (cos, sin) for ``packed.position_ids``; the packed
    boundaries travel to the attention function (``dflop_packed`` or flash-attention) as kwargs.
    A layer may be wrapped for recomputation (`dflop.models.recompute.recompute_layer`).
    """
    kwargs = packed.attention_kwargs()
    position_ids = packed.position_ids.unsqueeze(0)
    for layer in layers:
        hidden = layer(hidden, attention_mask=None, position_ids=position_ids,
                       position_embeddings=position_embeddings, **kwargs)
    return hidden
