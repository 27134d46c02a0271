"""Named vision towers and LLMs with their published shapes, and the transformers configs for them.

A preset is plain data (`VisionPreset`, `LLMPreset`); `vision_config` / `text_config` turn it into
the transformers config class the Hugging Face model is built from, so every module of a preset
model is the transformers implementation itself.

Published shapes (from the models' own config.json files):
- SigLIP so400m-patch14-384: width 1152, 27 layers, 16 heads, MLP 4304, 384 px, patch 14 (729
  patches per tile). LLaVA-OneVision's released checkpoints keep only the first 26 layers; the
  preset is the full published tower, and a local weights directory brings its own layer count.
- InternViT-300M-448px (V2.5): width 1024, 24 layers, 16 heads, MLP 4096, LayerNorm, qkv bias.
- InternViT-6B-448px (V1.5/V2.5, as used by InternVL 2.5 26B-78B): width 3200, 45 layers, 25 heads,
  MLP 12800, RMSNorm, QK-norm, no qkv bias.
- Qwen2.5 0.5B/1.5B/7B/32B/72B and Llama 3 8B/70B: see `_LLM_PRESETS`.

Small presets keep the families' layer structure and rough width ratios:
- ``*-tiny``: a few milliseconds per step on CPU, for tests. The tiny towers use 56 px tiles (4x4
  patches of 14 px) and the tiny LLMs a 2048-token vocabulary, so token ids must be below 2048.
- ``siglip-small`` + ``qwen2.5-small``: about 10M + 48M parameters, the CPU cost-model benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from transformers import InternVLVisionConfig, LlamaConfig, Qwen2Config, SiglipVisionConfig

from dflop.errors import UserError


@dataclass(frozen=True)
class VisionPreset:
    """Shape of a ViT vision tower. Sizes in pixels; ``hidden_act`` is a transformers activation."""

    name: str
    family: str  # "siglip" | "internvit"
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    image_size: int
    patch_size: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-6
    norm_type: str = "layer_norm"  # InternViT: "layer_norm" | "rms_norm"
    qk_norm: bool = False
    attention_bias: bool = True

    @property
    def patches_per_tile(self) -> int:
        """Patch tokens one tile (crop or frame) becomes, e.g. 729 for 384 px / 14 px."""
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class LLMPreset:
    """Shape of a decoder-only LLM (Qwen2 or Llama family)."""

    name: str
    family: str  # "qwen2" | "llama"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    image_token_id: int
    video_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _siglip(name: str, **shape) -> VisionPreset:
    return VisionPreset(name=name, family="siglip", hidden_act="gelu_pytorch_tanh", **shape)


def _internvit(name: str, **shape) -> VisionPreset:
    return VisionPreset(name=name, family="internvit", hidden_act="gelu", **shape)


_VISION_PRESETS = {
    p.name: p
    for p in (
        _siglip("siglip-so400m", hidden_size=1152, num_layers=27, num_heads=16, intermediate_size=4304,
                image_size=384, patch_size=14),
        _siglip("siglip-small", hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1536,
                image_size=224, patch_size=14),
        _siglip("siglip-tiny", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256,
                image_size=56, patch_size=14),
        _internvit("internvit-300m", hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096,
                   image_size=448, patch_size=14),
        _internvit("internvit-6b", hidden_size=3200, num_layers=45, num_heads=25, intermediate_size=12800,
                   image_size=448, patch_size=14, norm_type="rms_norm", qk_norm=True, attention_bias=False),
        _internvit("internvit-tiny", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256,
                   image_size=56, patch_size=14),
    )
}

# Qwen2.5 reserves <|image_pad|>-style ids inside its vocabulary; LLaVA-OV uses 151646/151647.
# Llama 3 has reserved special tokens from 128002 on. Tiny vocabularies keep the last ids.
_QWEN_IMAGE_IDS = dict(image_token_id=151646, video_token_id=151647)
_LLAMA_IMAGE_IDS = dict(image_token_id=128002, video_token_id=128003)
_TINY_IMAGE_IDS = dict(image_token_id=2040, video_token_id=2041)


def _qwen(name: str, vocab_size: int, ids: dict, **shape) -> LLMPreset:
    return LLMPreset(name=name, family="qwen2", vocab_size=vocab_size, rope_theta=1_000_000.0,
                     rms_norm_eps=1e-6, max_position_embeddings=32768, **ids, **shape)


def _llama(name: str, vocab_size: int, ids: dict, **shape) -> LLMPreset:
    return LLMPreset(name=name, family="llama", vocab_size=vocab_size, rope_theta=500_000.0,
                     rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False,
                     **ids, **shape)


_LLM_PRESETS = {
    p.name: p
    for p in (
        _qwen("qwen2.5-0.5b", 151936, _QWEN_IMAGE_IDS, hidden_size=896, num_layers=24, num_heads=14,
              num_kv_heads=2, intermediate_size=4864, tie_word_embeddings=True),
        _qwen("qwen2.5-1.5b", 151936, _QWEN_IMAGE_IDS, hidden_size=1536, num_layers=28, num_heads=12,
              num_kv_heads=2, intermediate_size=8960, tie_word_embeddings=True),
        _qwen("qwen2.5-7b", 152064, _QWEN_IMAGE_IDS, hidden_size=3584, num_layers=28, num_heads=28,
              num_kv_heads=4, intermediate_size=18944, tie_word_embeddings=False),
        _qwen("qwen2.5-32b", 152064, _QWEN_IMAGE_IDS, hidden_size=5120, num_layers=64, num_heads=40,
              num_kv_heads=8, intermediate_size=27648, tie_word_embeddings=False),
        _qwen("qwen2.5-72b", 152064, _QWEN_IMAGE_IDS, hidden_size=8192, num_layers=80, num_heads=64,
              num_kv_heads=8, intermediate_size=29568, tie_word_embeddings=False),
        _qwen("qwen2.5-small", 16384, dict(image_token_id=16376, video_token_id=16377), hidden_size=512,
              num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=2816, tie_word_embeddings=True),
        _qwen("qwen2.5-tiny", 2048, _TINY_IMAGE_IDS, hidden_size=64, num_layers=2, num_heads=4,
              num_kv_heads=2, intermediate_size=344, tie_word_embeddings=True),
        _llama("llama3-8b", 128256, _LLAMA_IMAGE_IDS, hidden_size=4096, num_layers=32, num_heads=32,
               num_kv_heads=8, intermediate_size=14336),
        _llama("llama3-70b", 128256, _LLAMA_IMAGE_IDS, hidden_size=8192, num_layers=80, num_heads=64,
               num_kv_heads=8, intermediate_size=28672),
        _llama("llama3-tiny", 2048, _TINY_IMAGE_IDS, hidden_size=64, num_layers=2, num_heads=8,
               num_kv_heads=2, intermediate_size=224),
    )
}


def vision_preset(name: str) -> VisionPreset:
    """The vision tower preset called `name` (e.g. "siglip-so400m")."""
    try:
        return _VISION_PRESETS[name]
    except KeyError:
        raise UserError(f"model.vision: unknown vision preset {name!r}; known: {', '.join(_VISION_PRESETS)}") from None


def llm_preset(name: str) -> LLMPreset:
    """The LLM preset called `name` (e.g. "qwen2.5-7b")."""
    try:
        return _LLM_PRESETS[name]
    except KeyError:
        raise UserError(f"model.llm: unknown LLM preset {name!r}; known: {', '.join(_LLM_PRESETS)}") from None


def vision_preset_names() -> tuple[str, ...]:
    return tuple(_VISION_PRESETS)


def llm_preset_names() -> tuple[str, ...]:
    return tuple(_LLM_PRESETS)


def vision_config(preset: VisionPreset) -> SiglipVisionConfig | InternVLVisionConfig:
    """The transformers config of a vision tower preset (no pooling head)."""
    common = dict(
        hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        intermediate_size=preset.intermediate_size,
        image_size=preset.image_size,
        patch_size=preset.patch_size,
        hidden_act=preset.hidden_act,
        layer_norm_eps=preset.layer_norm_eps,
    )
    if preset.family == "siglip":
        return SiglipVisionConfig(vision_use_head=False, **common)
    if preset.family == "internvit":
        common["image_size"] = (preset.image_size, preset.image_size)
        common["patch_size"] = (preset.patch_size, preset.patch_size)
        return InternVLVisionConfig(norm_type=preset.norm_type, use_qk_norm=preset.qk_norm,
                                    attention_bias=preset.attention_bias, use_mean_pooling=True, **common)
    raise UserError(f"vision preset {preset.name!r}: unknown family {preset.family!r}")


def text_config(preset: LLMPreset) -> Qwen2Config | LlamaConfig:
    """The transformers config of an LLM preset."""
    common = dict(
        hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        intermediate_size=preset.intermediate_size,
        vocab_size=preset.vocab_size,
        rms_norm_eps=preset.rms_norm_eps,
        tie_word_embeddings=preset.tie_word_embeddings,
        max_position_embeddings=preset.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
        hidden_act="silu",
    )
    if preset.family == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    if preset.family == "llama":
        return LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    raise UserError(f"LLM preset {preset.name!r}: unknown family {preset.family!r}")


def tower_arch_params(arch: str, vision: str, arch_params: Mapping[str, Any]) -> dict:
    """The config's token rules completed with the vision tower's geometry.

    Tiles are the tower's input size, so a tower with other tiles than the released checkpoints
    (e.g. the 56 px tiny towers) gets AnyRes canvases / InternVL tiles of its own size, and the
    shapes match the tensors the trainer builds for that tower.
    """
    tower = vision_preset(vision)
    params = dict(arch_params)
    if arch == "llava_ov":
        params.update(image_size=tower.image_size, patch_size=tower.patch_size)
        params["grid_pinpoints"] = [(tower.image_size * h, tower.image_size * w) for h in range(1, 7) for w in range(1, 7)]
    else:
        # pixel shuffle 0.5 keeps a quarter of the patch tokens of each tile
        params.update(tile_size=tower.image_size, tokens_per_tile=tower.patches_per_tile // 4)
    return params
