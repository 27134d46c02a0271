"""Sizes the planner needs without building the model: layers, heads, TP degrees, parameter counts.

Counts are exact: the model is built on PyTorch's ``meta`` device (shapes only, no memory) and its
parts are counted where the pipeline stages take them from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedConfig

from dflop.models.architectures import architecture_of
from dflop.models.builder import model_config

MAX_TP = 64


@dataclass(frozen=True)
class ModelInfo:
    """Structure of one multimodal model.

    vision_layers: layers the image features depend on (what vision stages split).
    vision_tokens_per_tile: tokens one tile is inside a vision layer.
    llm_tokens_per_tile: LLM tokens one tile becomes (LLaVA-OV adds a newline token per row).
    *_params: parameter counts (elements) of one part; ``llm_head_params`` includes the LM head
        matrix even when it is tied to the embedding (the last stage holds a copy of it), while
        ``total_params`` counts every distinct parameter of the model once.
    vision_attention_params: the parameters of one vision layer that grow with its head count
        (query, key, value and output projection weights, their biases but the output's, QK-norm
        weights): what `padded_vision_layer_params` scales.
    vision_tp_degrees, llm_tp_degrees: TP degrees up to MAX_TP the planner may use. LLM: they split
        query and key/value heads, MLP width and vocabulary evenly. Vision: they split the MLP width
        and the projector's width evenly; heads are padded with zero heads where needed
        (`padded_vision_heads`).
    vision_padded_heads: the vision head count at each of vision_tp_degrees (same order), after padding.
    """

    arch: str
    vision_layers: int
    vision_heads: int
    vision_hidden: int
    vision_tokens_per_tile: int
    llm_tokens_per_tile: int
    llm_layers: int
    llm_heads: int
    llm_kv_heads: int
    llm_hidden: int
    vocab_size: int
    tied_embeddings: bool
    vision_embed_params: int
    vision_layer_params: int
    projector_params: int
    llm_embed_params: int
    llm_layer_params: int
    llm_head_params: int
    total_params: int
    vision_tp_degrees: tuple[int, ...]
    llm_tp_degrees: tuple[int, ...]
    vision_attention_params: int = 0
    vision_padded_heads: tuple[int, ...] = ()

    def padded_vision_layer_params(self, padded_heads: int) -> int:
        """Parameters of one vision layer with `padded_heads` heads (the real ones plus zero heads):
        the attention part grows per head, the MLP and norms do not."""
        extra = padded_heads - self.vision_heads
        if extra < 0:
            raise ValueError(f"padded_heads={padded_heads} is below the tower's {self.vision_heads} heads")
        return self.vision_layer_params + self.vision_attention_params // self.vision_heads * extra


def vision_tp_divides(config: PreTrainedConfig, tp: int, *, padded: bool = False) -> bool:
    """Whether `tp` ranks can split the vision tower's MLP width and heads evenly; padded: heads
    count after zero-head padding (`padded_vision_heads`), so only the MLP width must divide."""
    v = config.vision_config
    heads = padded_vision_heads(config, tp) if padded else v.num_attention_heads
    return heads % tp == 0 and v.intermediate_size % tp == 0


def padded_vision_heads(config: PreTrainedConfig, tp: int) -> int:
    """Vision attention heads once padded with zero-weight heads to a multiple of `tp`.

    NVIDIA's recipe for InternViT-6B under TP 8 (25 heads -> 32): a padded head's query, key, value
    and output-projection weights are zero, so it adds nothing to the output and its gradients stay
    zero; it costs its share of the attention FLOPs and parameter bytes. Equal to the real head
    count when `tp` divides it."""
    heads = config.vision_config.num_attention_heads
    return -(-heads // tp) * tp


def llm_tp_divides(config: PreTrainedConfig, tp: int) -> bool:
    """Whether `tp` ranks can split the LLM's query and key/value heads, MLP and vocabulary evenly."""
    t = config.text_config
    return (t.num_attention_heads % tp == 0 and t.num_key_value_heads % tp == 0
            and t.intermediate_size % tp == 0 and t.vocab_size % tp == 0)


def projector_tp_divides(config: PreTrainedConfig, tp: int) -> bool:
    """Whether `tp` ranks can split the projector's hidden width (the LLM width) evenly."""
    return config.text_config.hidden_size % tp == 0


def vision_tp_degrees(config: PreTrainedConfig, *, padded: bool = False) -> tuple[int, ...]:
    """TP degrees (up to MAX_TP) a vision stage can use: they split the tower's heads and MLP width
    and, as the last vision stage shards the projector at the same degree, the projector's width.
    padded: heads may be padded with zero heads (`padded_vision_heads`), so any degree dividing the
    widths is admissible (what the planner prices); without it, heads must divide as they are.
    InternViT-6B (25 heads, MLP 12800 = 2^9 x 25) with Qwen2.5-72B (width 8192): 1 unpadded; padded
    1, 2, 4, 8, 16, 32, 64 (26, 28, 32, 32, 32, 64 heads from 2 on). SigLIP-so400m (16 heads, MLP
    4304 = 16 x 269) with Llama-3-8B (4096): 1, 2, 4, 8, 16 either way (16 heads divide)."""
    return tuple(t for t in range(1, MAX_TP + 1)
                 if vision_tp_divides(config, t, padded=padded) and projector_tp_divides(config, t))


def llm_tp_degrees(config: PreTrainedConfig) -> tuple[int, ...]:
    """TP degrees (up to MAX_TP) that split the LLM's heads, MLP width and vocabulary evenly."""
    return tuple(t for t in range(1, MAX_TP + 1) if llm_tp_divides(config, t))


@dataclass(frozen=True)
class SplitLimits:
    """What a plan is checked against (`dflop.plan.Plan.check`), read from the config alone: the
    layers each side's stages must cover and the TP degrees that split it evenly (vision: after
    zero-head padding). `ModelInfo` holds the same values; this needs no model built, so the
    launcher's check runs without transformers' model classes."""

    vision_layers: int
    llm_layers: int
    vision_tp_degrees: tuple[int, ...]
    llm_tp_degrees: tuple[int, ...]


def split_limits(config: PreTrainedConfig) -> SplitLimits:
    """`SplitLimits` of the model a transformers config describes."""
    return SplitLimits(vision_layers=architecture_of(config).n_feature_layers(config),
                       llm_layers=config.text_config.num_hidden_layers,
                       vision_tp_degrees=vision_tp_degrees(config, padded=True), llm_tp_degrees=llm_tp_degrees(config))


def model_info(arch: str, vision: str, llm: str, *, weights_dir: str | Path | None = None) -> ModelInfo:
    """`ModelInfo` of a preset combination (or of the model in `weights_dir`)."""
    return info_of(model_config(arch, vision, llm, weights_dir=weights_dir))


def info_of(config: PreTrainedConfig) -> ModelInfo:
    """`ModelInfo` of the model a transformers config describes (counted on the meta device)."""
    spec = architecture_of(config)
    with torch.device("meta"):
        model = spec.model_class._from_config(config)
    lm = model.model.language_model
    vision_cfg, text_cfg = config.vision_config, config.text_config
    image_features = spec.image_features(model)
    layer = spec.vision_layers(model)[0]
    limits = split_limits(config)
    return ModelInfo(
        arch=spec.name,
        vision_layers=limits.vision_layers,
        vision_heads=vision_cfg.num_attention_heads,
        vision_hidden=vision_cfg.hidden_size,
        vision_tokens_per_tile=spec.layer_tokens_per_tile(config),
        llm_tokens_per_tile=spec.llm_tokens_per_tile(config),
        llm_layers=limits.llm_layers,
        llm_heads=text_cfg.num_attention_heads,
        llm_kv_heads=text_cfg.num_key_value_heads,
        llm_hidden=text_cfg.hidden_size,
        vocab_size=text_cfg.vocab_size,
        tied_embeddings=model.lm_head.weight is lm.embed_tokens.weight,
        vision_embed_params=count_params(spec.vision_embeddings(model)),
        vision_layer_params=count_params(layer),
        projector_params=count_params(image_features),
        llm_embed_params=count_params(lm.embed_tokens),
        llm_layer_params=count_params(lm.layers[0]),
        llm_head_params=count_params(lm.norm) + count_params(model.lm_head),
        total_params=count_params(model),
        vision_tp_degrees=limits.vision_tp_degrees,
        llm_tp_degrees=limits.llm_tp_degrees,
        vision_attention_params=attention_params(layer),
        vision_padded_heads=tuple(padded_vision_heads(config, t) for t in limits.vision_tp_degrees),
    )


def attention_params(layer: nn.Module) -> int:
    """Parameters of a vision layer's attention module that grow with its head count: all of them
    but the output projection's bias (the projection is the module's last Linear in SigLIP and
    InternViT; its output is the hidden size, whatever the heads)."""
    attn = next(m for name, m in layer.named_children() if name in ("self_attn", "attention"))
    out = [m for m in attn.modules() if isinstance(m, nn.Linear)][-1]
    return count_params(attn) - (out.bias.numel() if out.bias is not None else 0)


def count_params(module: nn.Module) -> int:
    """Distinct parameter elements of `module` (a tied parameter counts once)."""
    return sum(p.numel() for p in module.parameters())
