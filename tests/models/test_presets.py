"""Presets have the published shapes; parameter counts and weight loading are right."""

from __future__ import annotations

import pytest
import torch

from dflop.errors import UserError
from dflop.models.builder import build_model, model_config
from dflop.models.info import count_params, model_info, vision_tp_degrees
from dflop.models.presets import llm_preset, llm_preset_names, vision_preset, vision_preset_names

# Parameter counts published for the released checkpoints (model cards / safetensors index).
PUBLISHED_LLM_PARAMS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
}


@pytest.mark.parametrize("llm", sorted(PUBLISHED_LLM_PARAMS))
def test_llm_presets_have_published_parameter_counts(llm):
    info = model_info("llava_ov", "siglip-tiny", llm)
    embed = info.llm_embed_params
    head = info.llm_head_params - (embed if info.tied_embeddings else 0)  # a tied head is the embedding
    assert embed + info.llm_layers * info.llm_layer_params + head == PUBLISHED_LLM_PARAMS[llm]


def test_vision_presets_have_published_shapes():
    so400m = vision_preset("siglip-so400m")
    assert (so400m.hidden_size, so400m.num_layers, so400m.num_heads, so400m.intermediate_size) == (1152, 27, 16, 4304)
    assert so400m.patches_per_tile == 729
    info = model_info("internvl", "internvit-300m", "qwen2.5-0.5b")
    tower = info.vision_embed_params + info.vision_layers * info.vision_layer_params
    assert 300e6 < tower < 310e6  # InternViT-300M
    assert info.vision_tokens_per_tile == 1025 and info.llm_tokens_per_tile == 256
    info = model_info("internvl", "internvit-6b", "qwen2.5-0.5b")
    assert 5.5e9 < info.vision_embed_params + info.vision_layers * info.vision_layer_params < 5.6e9
    # 25 heads and MLP 12800 = 2^9 x 25 split by 1, 5, 25, but the last vision stage also shards the
    # projector (width = the LLM's, 896 = 2^7 x 7 here) at the vision TP degree: only LLM widths
    # divisible by 5 allow 5. The planner's degrees pad heads with zero heads (NVLM's recipe), so
    # there only the widths must divide: powers of 2 up to 64 here.
    assert vision_tp_degrees(model_config("internvl", "internvit-6b", "qwen2.5-0.5b")) == (1,)
    assert info.vision_tp_degrees == (1, 2, 4, 8, 16, 32, 64)
    config_32b = model_config("internvl", "internvit-6b", "qwen2.5-32b")  # width 5120 = 2^10 x 5
    assert vision_tp_degrees(config_32b) == (1, 5)
    assert model_info("internvl", "internvit-6b", "qwen2.5-32b").vision_tp_degrees == (1, 2, 4, 5, 8, 10, 16, 20, 32,
                                                                                      40, 64)


def test_part_counts_add_up_to_the_built_model():
    """Reference: the parameters of the full transformers model built from the presets."""
    for arch, vision, llm in [("llava_ov", "siglip-small", "qwen2.5-small"),
                              ("internvl", "internvit-tiny", "llama3-tiny")]:
        info = model_info(arch, vision, llm)
        model = build_model(arch, vision, llm, seed=0)
        tied = info.llm_embed_params if info.tied_embeddings else 0
        parts = (info.vision_embed_params + info.vision_layers * info.vision_layer_params + info.projector_params
                 + info.llm_embed_params + info.llm_layers * info.llm_layer_params + info.llm_head_params - tied)
        unused = sum(p.numel() for n, p in model.named_parameters()
                     if "post_layernorm" in n or n.endswith("vision_tower.layernorm.weight"))
        assert parts + unused == count_params(model) == info.total_params


def test_small_presets_are_about_fifty_million_parameters():
    info = model_info("llava_ov", "siglip-small", "qwen2.5-small")
    assert 45e6 < info.total_params < 65e6


def test_tp_degrees_divide_heads():
    info = model_info("llava_ov", "siglip-so400m", "qwen2.5-7b")  # 28 heads, 4 kv heads
    assert info.llm_tp_degrees == (1, 2, 4)
    assert info.vision_tp_degrees == (1, 2, 4, 8, 16)


def test_unknown_names_and_wrong_tower_are_one_line_errors():
    with pytest.raises(UserError, match="model.llm: unknown LLM preset 'qwen9'"):
        llm_preset("qwen9")
    with pytest.raises(UserError, match="model.vision: unknown vision preset"):
        vision_preset("vit-huge")
    with pytest.raises(UserError, match="'internvl' needs a internvit tower, got 'siglip-tiny'"):
        build_model("internvl", "siglip-tiny", "qwen2.5-tiny")
    with pytest.raises(UserError, match="model.arch: unknown architecture"):
        build_model("flamingo", "siglip-tiny", "qwen2.5-tiny")
    assert "qwen2.5-72b" in llm_preset_names() and "internvit-6b" in vision_preset_names()


def test_weights_load_from_local_safetensors_directory(tmp_path):
    model = build_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", seed=3)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = build_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", weights_dir=tmp_path / "ckpt")
    expected = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    assert loaded.config.text_config._attn_implementation == "dflop_packed"

    with pytest.raises(UserError, match="holds a 'llava_ov' model but model.arch is 'internvl'"):
        build_model("internvl", "internvit-tiny", "qwen2.5-tiny", weights_dir=tmp_path / "ckpt")
    with pytest.raises(UserError, match="not a Hugging Face model directory"):
        build_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", weights_dir=tmp_path)
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(UserError, match="no \\*.safetensors files"):
        build_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", weights_dir=tmp_path / "ckpt")
