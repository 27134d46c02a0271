"""The two multimodal architectures: their transformers config, where their parts live in the
model, and how the last vision layer's output becomes the image features spliced into the LLM.

- ``llava_ov``: SigLIP tower -> 2-layer GELU MLP projector -> AnyRes packing (unpad, image-newline
  token per row) -> LLM (`LlavaOnevisionForConditionalGeneration`).
- ``internvl``: InternViT tower (with a CLS token) -> drop CLS -> pixel shuffle 0.5 (4 patches
  become one token) -> LayerNorm + MLP projector -> LLM (`InternVLForConditionalGeneration`).

Besides the parts of a built model (shared parameters, for pipeline stages), each architecture can
build single parts from a config alone, so the profiler measures one layer of a 72B model without
building the model.
"""

from __future__ import annotations

import copy
import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import InternVLConfig, LlavaOnevisionConfig, PreTrainedConfig

from dflop.errors import UserError
from dflop.models.presets import LLMPreset, VisionPreset, text_config, vision_config

# transformers' modeling modules are imported where a part is built, not here: reading a config's
# structure (`n_feature_layers`, tokens per tile) is what the light commands need, and the model
# classes cost seconds of CPU to import in every process (tests/test_light_commands.py).
if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionForConditionalGeneration


@dataclass(frozen=True)
class ImageLayout:
    """How the tiles of a microbatch group into images (what the feature packing needs).

    tiles_per_image: tiles of each image in order (LLaVA-OV AnyRes: base image + crops; 1 for the
        images of multi-image samples and for video frames).
    image_sizes: [n_images, 2] original (height, width) in pixels, used by LLaVA-OV to unpad.
    """

    tiles_per_image: tuple[int, ...]
    image_sizes: torch.Tensor

    @property
    def n_tiles(self) -> int:
        return sum(self.tiles_per_image)


def pixel_shuffle(features: torch.Tensor, scale: float) -> torch.Tensor:
    """[n, w, h, c] -> [n, w*scale, h*scale, c/scale^2]: merge scale^-2 neighbouring patches per token.

    Same element order as InternVL's own implementation (checked against transformers in tests).
    """
    n, width, height, channels = features.shape
    if (height * scale) % 1 or (width * scale) % 1:
        raise ValueError(f"pixel shuffle: a {width}x{height} patch grid does not divide by {1 / scale:g}")
    x = features.view(n, width, int(height * scale), int(channels / scale))
    x = x.permute(0, 2, 1, 3).contiguous()
    x = x.view(n, int(height * scale), int(width * scale), int(channels / (scale * scale)))
    return x.permute(0, 2, 1, 3).contiguous()


class LlavaOneVisionImageFeatures(nn.Module):
    """Projector + AnyRes packing: [n_tiles, P, d_vision] -> [n_image_tokens, d_model].

    The packing (unpad each image's crop grid, add the image-newline embedding after every row,
    shrink grids above ``anyres_max_9``) is transformers' own `pack_image_features`.
    """

    def __init__(self, model: LlavaOnevisionForConditionalGeneration):
        super().__init__()
        inner = model.model
        self.projector = inner.multi_modal_projector
        self.image_newline = inner.image_newline
        self._pack = inner.pack_image_features  # a bound method, not a submodule: no parameters copied
        self.drop_first = model.config.vision_feature_select_strategy == "default"
        self.aspect_ratio = model.config.vision_aspect_ratio

    def forward(self, hidden: torch.Tensor, layout: ImageLayout) -> torch.Tensor:
        if self.drop_first:
            hidden = hidden[:, 1:]
        per_image = torch.split(self.projector(hidden), list(layout.tiles_per_image))
        packed, _ = self._pack(per_image, layout.image_sizes, image_newline=self.image_newline,
                               vision_aspect_ratio=self.aspect_ratio)
        return torch.cat(packed, dim=0)


class InternVLImageFeatures(nn.Module):
    """Final norm, drop CLS, pixel shuffle, projector: [n_tiles, 1 + P, d_vision] -> [n_tiles*P*r^2, d_model]."""

    def __init__(self, projector: nn.Module, final_norm: nn.Module, drop_first: bool, downsample_ratio: float):
        super().__init__()
        self.final_norm = final_norm
        self.projector = projector
        self.drop_first = drop_first
        self.downsample_ratio = downsample_ratio

    def forward(self, hidden: torch.Tensor, layout: ImageLayout | None = None) -> torch.Tensor:
        hidden = self.final_norm(hidden)
        if self.drop_first:
            hidden = hidden[:, 1:]
        n_tiles, n_patches, _ = hidden.shape
        side = math.isqrt(n_patches)
        grid = pixel_shuffle(hidden.reshape(n_tiles, side, side, -1), self.downsample_ratio)
        return self.projector(grid.reshape(n_tiles, -1, grid.shape[-1])).flatten(0, 1)


class Architecture:
    """What differs between LLaVA-OneVision and InternVL (subclasses below)."""

    name: str
    vision_family: str
    model_class: type[PreTrainedModel]

    def make_config(self, vision: VisionPreset, llm: LLMPreset) -> PreTrainedConfig:
        raise NotImplementedError

    # -- parts of a built model (the same parameter objects) --
    def vision_embeddings(self, model: PreTrainedModel) -> nn.Module:
        return model.model.vision_tower.embeddings

    def vision_layers(self, model: PreTrainedModel) -> nn.ModuleList:
        raise NotImplementedError

    def image_features(self, model: PreTrainedModel) -> nn.Module:
        raise NotImplementedError

    def run_vision_layer(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return layer(hidden)

    # -- single parts built from a config (profiler) --
    def new_vision_embeddings(self, config: PreTrainedConfig) -> nn.Module:
        raise NotImplementedError

    def new_vision_layer(self, config: PreTrainedConfig) -> nn.Module:
        raise NotImplementedError

    def new_projector(self, config: PreTrainedConfig) -> nn.Module:
        """The module mapping one vision layer's output [n_tiles, S, d_vision] to LLM tokens."""
        raise NotImplementedError

    # -- shapes --
    def layer_tokens_per_tile(self, config: PreTrainedConfig) -> int:
        """Tokens one tile is inside a vision layer (patches, plus CLS for InternViT)."""
        raise NotImplementedError

    def llm_tokens_per_tile(self, config: PreTrainedConfig) -> int:
        """LLM tokens one tile becomes (LLaVA-OV adds newline tokens per image on top)."""
        raise NotImplementedError

    def n_feature_layers(self, config: PreTrainedConfig) -> int:
        """How many vision layers the image features depend on (``vision_feature_layer``)."""
        layer = config.vision_feature_layer
        if not isinstance(layer, int):
            raise UserError(f"{self.name}: vision_feature_layer={layer!r}; only a single feature layer is supported")
        n = config.vision_config.num_hidden_layers
        return n + 1 + layer if layer < 0 else layer


def _with_attention(config: PreTrainedConfig, attn_implementation: str) -> PreTrainedConfig:
    """A copy of `config` naming its attention function (a standalone layer has none set)."""
    config = copy.deepcopy(config)
    config._attn_implementation = attn_implementation
    return config


def _patches(vision_config: PreTrainedConfig) -> int:
    image, patch = vision_config.image_size, vision_config.patch_size
    image = image[0] if isinstance(image, (tuple, list)) else image
    patch = patch[0] if isinstance(patch, (tuple, list)) else patch
    return (image // patch) ** 2


class LlavaOneVision(Architecture):
    name = "llava_ov"
    vision_family = "siglip"

    @property
    def model_class(self) -> type[PreTrainedModel]:
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionForConditionalGeneration

        return LlavaOnevisionForConditionalGeneration

    def make_config(self, vision: VisionPreset, llm: LLMPreset) -> LlavaOnevisionConfig:
        size = vision.image_size
        return LlavaOnevisionConfig(
            vision_config=vision_config(vision),
            text_config=text_config(llm),
            image_token_index=llm.image_token_id,
            video_token_index=llm.video_token_id,
            # The released grid: 1x1 ... 6x6 tiles of the tower's resolution.
            image_grid_pinpoints=[[size * i, size * j] for i in range(1, 7) for j in range(1, 7)],
            vision_feature_layer=-1,
            vision_feature_select_strategy="full",
            tie_word_embeddings=llm.tie_word_embeddings,
        )

    def vision_layers(self, model):
        return model.model.vision_tower.encoder.layers

    def image_features(self, model):
        return LlavaOneVisionImageFeatures(model)

    def run_vision_layer(self, layer, hidden):
        return layer(hidden, None)  # SigLIP layers take an explicit (absent) attention mask

    def new_vision_embeddings(self, config):
        from transformers.models.siglip.modeling_siglip import SiglipVisionEmbeddings

        return SiglipVisionEmbeddings(_with_attention(config.vision_config, "sdpa"))

    def new_vision_layer(self, config):
        from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

        return SiglipEncoderLayer(_with_attention(config.vision_config, "sdpa"))

    def new_projector(self, config):
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionMultiModalProjector

        return LlavaOnevisionMultiModalProjector(config)

    def layer_tokens_per_tile(self, config):
        return _patches(config.vision_config)

    def llm_tokens_per_tile(self, config):
        return _patches(config.vision_config) - (1 if config.vision_feature_select_strategy == "default" else 0)


class InternVL(Architecture):
    name = "internvl"
    vision_family = "internvit"

    @property
    def model_class(self) -> type[PreTrainedModel]:
        from transformers.models.internvl.modeling_internvl import InternVLForConditionalGeneration

        return InternVLForConditionalGeneration

    def make_config(self, vision: VisionPreset, llm: LLMPreset) -> InternVLConfig:
        return InternVLConfig(
            vision_config=vision_config(vision),
            text_config=text_config(llm),
            image_token_id=llm.image_token_id,
            image_seq_length=vision.patches_per_tile // 4,
            downsample_ratio=0.5,
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            tie_word_embeddings=llm.tie_word_embeddings,
        )

    def vision_layers(self, model):
        return model.model.vision_tower.encoder.layer

    def image_features(self, model):
        config = model.config
        final_norm = model.model.vision_tower.layernorm if config.vision_feature_layer == -1 else nn.Identity()
        return InternVLImageFeatures(model.model.multi_modal_projector, final_norm,
                                     config.vision_feature_select_strategy == "default", config.downsample_ratio)

    def new_vision_embeddings(self, config):
        from transformers.models.internvl.modeling_internvl import InternVLVisionEmbeddings

        return InternVLVisionEmbeddings(_with_attention(config.vision_config, "sdpa"))

    def new_vision_layer(self, config):
        from transformers.models.internvl.modeling_internvl import InternVLVisionLayer

        return InternVLVisionLayer(_with_attention(config.vision_config, "sdpa"))

    def new_projector(self, config):
        # The tower's final norm is an identity for InternVL (mean-pooling configs), so the profiled
        # unit is drop CLS + pixel shuffle + projector.
        from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector

        return InternVLImageFeatures(InternVLMultiModalProjector(config), nn.Identity(),
                                     config.vision_feature_select_strategy == "default", config.downsample_ratio)

    def layer_tokens_per_tile(self, config):
        return _patches(config.vision_config) + 1  # CLS token

    def llm_tokens_per_tile(self, config):
        return int(_patches(config.vision_config) * config.downsample_ratio**2)


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LlavaOneVision(), InternVL())}
_BY_MODEL_TYPE = {"llava_onevision": "llava_ov", "internvl": "internvl"}


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UserError(f"model.arch: unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}") from None


def architecture_of(model_or_config: PreTrainedModel | PreTrainedConfig) -> Architecture:
    """The architecture of a built model (or its config), from the transformers model type."""
    config = getattr(model_or_config, "config", model_or_config)
    try:
        return ARCHITECTURES[_BY_MODEL_TYPE[config.model_type]]
    except KeyError:
        raise UserError(f"model type {config.model_type!r} is not a supported architecture "
                        f"({', '.join(_BY_MODEL_TYPE)})") from None


def check_compatible(arch: Architecture, vision: VisionPreset) -> None:
    if vision.family != arch.vision_family:
        raise UserError(f"model.vision: architecture {arch.name!r} needs a {arch.vision_family} tower, "
                        f"got {vision.name!r} ({vision.family})")


# -- LLM parts by transformers model type: (module, decoder layer, RMS norm, rotary embedding) --
_LLM_PARTS = {
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer", "Qwen2RMSNorm", "Qwen2RotaryEmbedding"),
    "llama": ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer", "LlamaRMSNorm", "LlamaRotaryEmbedding"),
}


def _llm_parts(text_cfg: PreTrainedConfig) -> tuple[type[nn.Module], type[nn.Module], type[nn.Module]]:
    """(decoder layer, RMS norm, rotary embedding) classes of the LLM's transformers model type."""
    try:
        module, *names = _LLM_PARTS[text_cfg.model_type]
    except KeyError:
        raise UserError(f"LLM model type {text_cfg.model_type!r} is not supported ({', '.join(_LLM_PARTS)})") from None
    modeling = importlib.import_module(module)
    return tuple(getattr(modeling, name) for name in names)


def new_llm_layer(text_cfg: PreTrainedConfig) -> nn.Module:
    """One decoder layer with packed-row attention (``dflop_packed``)."""
    from dflop.models.packing import PACKED_ATTENTION  # also registers it with transformers

    return _llm_parts(text_cfg)[0](_with_attention(text_cfg, PACKED_ATTENTION), layer_idx=0)


def new_llm_norm(text_cfg: PreTrainedConfig) -> nn.Module:
    return _llm_parts(text_cfg)[1](text_cfg.hidden_size, eps=text_cfg.rms_norm_eps)


def new_rotary_embedding(text_cfg: PreTrainedConfig) -> nn.Module:
    return _llm_parts(text_cfg)[2](config=text_cfg)
