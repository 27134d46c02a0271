"""The closed-form bytes saved for backward per recompute mode (`dflop.costmodel.activations`)
match what autograd actually keeps, counted by saved-tensor hooks on real stages (float32, CPU).

Prediction: widths, heads and dtype of the config only. Measurement: `saved_tensor_bytes` around the
stage's forward; with non-reentrant checkpoint the hooks see what the checkpoint keeps (its inputs),
since its own hooks replace the layer-internal saves by recomputation.
"""

from __future__ import annotations

import pytest
import torch

from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

from dflop.costmodel import activations
from dflop.models.architectures import ImageLayout, architecture_of
from dflop.models.builder import build_model
from dflop.models.packing import PackedSequence
from dflop.models.stages import build_llm_stage, build_vision_stage
from dflop.profiling._memory import saved_tensor_bytes
from dflop.runtime.vision import VisionRunner

MODELS = {"tiny-llava_ov": ("llava_ov", "siglip-tiny", "qwen2.5-tiny"),
          "tiny-internvl": ("internvl", "internvit-tiny", "llama3-tiny"),
          "small-llava_ov": ("llava_ov", "siglip-small", "qwen2.5-small")}
MODES = ("none", "selective", "full")


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    torch.set_num_threads(1)
    return build_model(*MODELS[request.param], seed=0)


def _measure_vision(model, mode, n_tiles, n_layers=2):
    stage = build_vision_stage(model, 1, 3, (0, n_layers), recompute=mode)  # a middle stage: layers only
    config = model.config
    tokens = architecture_of(config).layer_tokens_per_tile(config)
    x = torch.randn(n_tiles, tokens, config.vision_config.hidden_size, requires_grad=True)
    with saved_tensor_bytes(model.parameters()) as saved:
        stage(x, ImageLayout((n_tiles,), torch.zeros(1, 2)))
    return saved.bytes


def _measure_llm(model, mode, lengths, n_layers=2):
    stage = build_llm_stage(model, 1, 3, (0, n_layers), recompute=mode)
    x = torch.randn(1, sum(lengths), model.config.get_text_config().hidden_size, requires_grad=True)
    with saved_tensor_bytes(model.parameters()) as saved:
        stage(x, PackedSequence.from_lengths(lengths))
    return saved.bytes


def test_vision_saved_bytes_match_closed_form(model):
    measured = {mode: _measure_vision(model, mode, n_tiles=3) for mode in MODES}
    predicted = {mode: activations.vision_stage_layer_bytes(model.config, 3, 2, mode, "float32") for mode in MODES}
    for mode in MODES:
        assert measured[mode] == pytest.approx(predicted[mode], rel=0.05), mode
    # selective saves little with the flash-style SDPA kernel; the saving itself is predicted exactly
    assert measured["none"] - measured["selective"] == pytest.approx(predicted["none"] - predicted["selective"])
    assert measured["full"] < measured["selective"] < measured["none"]


def test_trainer_vision_runner_saves_what_the_mode_says(model):
    """The trainer runs vision stages through `VisionRunner`, not `VisionStage.forward`: its saved
    bytes per recompute mode must match the same closed form (it once ignored full recompute)."""
    config = model.config
    tokens = architecture_of(config).layer_tokens_per_tile(config)
    for mode in MODES:
        runner = VisionRunner(build_vision_stage(model, 1, 3, (0, 2), recompute=mode), model)
        x = torch.randn(3, tokens, config.vision_config.hidden_size, requires_grad=True)
        with saved_tensor_bytes(model.parameters()) as saved:
            runner(x, [])
        predicted = activations.vision_stage_layer_bytes(config, 3, 2, mode, "float32")
        assert saved.bytes == pytest.approx(predicted, rel=0.05), mode


@pytest.mark.parametrize("lengths", [(37, 50, 24), (40, 40)], ids=["unequal", "equal"])
def test_llm_saved_bytes_match_closed_form(model, lengths):
    text = model.config.get_text_config()
    measured = {mode: _measure_llm(model, mode, list(lengths)) for mode in MODES}
    predicted = {mode: activations.llm_stage_layer_bytes(text, lengths, 2, mode, "float32") for mode in MODES}
    for mode in MODES:
        assert measured[mode] == pytest.approx(predicted[mode], rel=0.05), mode
    assert measured["none"] - measured["selective"] == pytest.approx(predicted["none"] - predicted["selective"])
    assert measured["full"] < measured["selective"] < measured["none"]


def _image_layout(model):
    """Two images of a microbatch and their tiles (LLaVA-OV: AnyRes base + crops of these sizes)."""
    config = model.config
    sizes = torch.tensor([[56, 112], [100, 60]])
    if architecture_of(config).vision_family == "siglip":
        tiles = [image_size_to_num_patches(s, config.image_grid_pinpoints, config.vision_config.image_size)
                 for s in sizes]
    else:
        tiles = [2, 1]
    return ImageLayout(tuple(tiles), sizes)


def test_first_and_last_vision_stage_keep_the_embedding_and_projector_closed_forms(model):
    """A whole one-stage vision tower (pixels in, features out) with its layers: the layers plus the
    embeddings' and projector's closed forms, exactly."""
    config = model.config
    layout = _image_layout(model)
    size = config.vision_config.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    stage = build_vision_stage(model, 0, 1)
    with saved_tensor_bytes(model.parameters()) as saved:
        stage(torch.randn(layout.n_tiles, 3, size, size), layout)
    per_tile, const = activations.vision_embed_bytes(config, "float32")
    predicted = (activations.vision_stage_layer_bytes(config, layout.n_tiles, len(stage.layers), "none", "float32")
                 + layout.n_tiles * (per_tile + activations.projector_bytes_per_tile(config, "float32")) + const)
    assert saved.bytes == pytest.approx(predicted, rel=1e-6)


def test_first_and_last_llm_stage_keep_the_embedding_and_head_closed_forms(model):
    """A one-stage LLM (ids and image features in, loss out) on a packed row: the
    layers plus the token embedding's and the head's closed forms (4 bytes: the loss's scalar)."""
    text = model.config.get_text_config()
    lengths = [37, 50, 24]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (sum(lengths),), generator=generator)
    ids[5:17] = model.config.image_token_id
    features = torch.randn(12, text.hidden_size, requires_grad=True)
    packed = PackedSequence.from_lengths(lengths)
    shift = packed.shift_labels(torch.randint(0, 1000, (sum(lengths),), generator=generator))
    stage = build_llm_stage(model, 0, 1)
    with saved_tensor_bytes(model.parameters()) as saved:
        stage(ids, packed, image_features=features, shift_labels=shift, num_items_in_batch=1)
    tokens = sum(lengths)
    predicted = (activations.llm_stage_layer_bytes(text, lengths, len(stage.layers), "none", "float32")
                 + tokens * activations.LLM_EMBED_BYTES_PER_TOKEN
                 + tokens * activations.llm_head_bytes_per_token(text, "float32"))
    assert saved.bytes == pytest.approx(predicted, abs=64)
