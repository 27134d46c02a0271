"""Chained pipeline stages reproduce the full transformers model's loss and every gradient.

Reference: transformers' own ``LlavaOnevisionForConditionalGeneration`` /
``InternVLForConditionalGeneration`` forward with labels (SDPA attention, packed row with position
ids restarting per sample, ``use_cache=False``), on a separate copy of the same weights. The stages
run as a pipeline would: each stage gets a detached input and backward is driven stage by stage
with the gradient of the next stage's input.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

from dflop.errors import UserError
from dflop.models.architectures import ImageLayout
from dflop.models.builder import build_model
from dflop.models.packing import PackedSequence
from dflop.models.recompute import apply_recompute, attention_module
from dflop.models.stages import build_llm_stage, build_vision_stage
from dflop.plan import uniform_layer_split

PRESETS = {"llava_ov": ("siglip-tiny", "qwen2.5-tiny"), "internvl": ("internvit-tiny", "llama3-tiny")}


def _models(arch):
    vision, llm = PRESETS[arch]
    reference = build_model(arch, vision, llm, seed=0, llm_attention="sdpa")
    model = build_model(arch, vision, llm, seed=1)
    model.load_state_dict(reference.state_dict())
    return reference, model


def _batch(arch, reference, generator):
    """Three packed samples: image + text, text only, two images; labels -100 on images and first tokens."""
    config = reference.config
    if arch == "llava_ov":
        image_sizes = torch.tensor([[56, 112], [100, 60], [40, 40]])
        tiles = [image_size_to_num_patches(s, config.image_grid_pinpoints, config.vision_config.image_size)
                 for s in image_sizes]
    else:
        image_sizes = torch.tensor([[448, 896], [448, 448], [896, 1344]])
        tiles = [2, 1, 6]
    size = reference.config.vision_config.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    pixels = torch.randn(sum(tiles), 3, size, size, generator=generator)
    layout = ImageLayout(tuple(tiles), image_sizes)
    with torch.no_grad():  # how many placeholder tokens each image needs, as transformers computes them
        if arch == "llava_ov":
            features = reference.model.get_image_features(pixels, image_sizes).pooler_output
            n_tokens = [f.shape[0] for f in features]
        else:
            per_tile = reference.model.get_image_features(pixels).pooler_output.shape[1]
            n_tokens = [t * per_tile for t in tiles]

    image = config.image_token_id

    def text(n):
        return torch.randint(0, 2000, (n,), generator=generator)

    def img(i):
        return torch.full((n_tokens[i],), image)

    samples = [torch.cat([text(5), img(0), text(7)]), text(9), torch.cat([text(3), img(1), text(4), img(2), text(6)])]
    ids = torch.cat(samples)
    packed = PackedSequence.from_lengths([len(s) for s in samples])
    labels = ids.clone()
    labels[ids == image] = -100
    labels[packed.cu_seqlens[:-1].long()] = -100  # a sample's first token is never a target
    return pixels, layout, ids, packed, labels


def _reference_loss(arch, reference, pixels, layout, ids, packed, labels):
    kwargs = dict(input_ids=ids[None], pixel_values=pixels, position_ids=packed.position_ids[None],
                  labels=labels[None], use_cache=False)
    if arch == "llava_ov":
        kwargs["image_sizes"] = layout.image_sizes
    return reference(**kwargs).loss


def _pipeline_loss_and_backward(model, vision_ranges, llm_ranges, pixels, layout, ids, packed, labels,
                                recompute=None):
    """Forward through every stage on detached inputs, then backward stage by stage.
    recompute: (vision modes, LLM modes), one per stage (default none)."""
    v_modes, l_modes = recompute or (["none"] * len(vision_ranges), ["none"] * len(llm_ranges))
    vision = [build_vision_stage(model, i, len(vision_ranges), r, v_modes[i]) for i, r in enumerate(vision_ranges)]
    llm = [build_llm_stage(model, j, len(llm_ranges), r, l_modes[j]) for j, r in enumerate(llm_ranges)]
    records = []  # (stage input leaf or None, stage output)
    x = pixels
    for i, stage in enumerate(vision):
        leaf = x if i == 0 else x.detach().requires_grad_()
        x = stage(leaf, layout)
        records.append((None if i == 0 else leaf, x))
    features = x.detach().requires_grad_()
    x = ids
    for j, stage in enumerate(llm):
        leaf = x if j == 0 else x.detach().requires_grad_()
        if j == len(llm) - 1:
            out = stage(leaf, packed, image_features=features if j == 0 else None,
                        shift_labels=packed.shift_labels(labels))
        else:
            out = stage(leaf, packed, image_features=features if j == 0 else None)
        records.append((None if j == 0 else leaf, out))
        x = out
    loss = x
    grad = None
    for leaf, out in reversed(records[len(vision):]):
        out.backward(grad)
        grad = leaf.grad if leaf is not None else None
    grad = features.grad
    for leaf, out in reversed(records[:len(vision)]):
        out.backward(grad)
        grad = leaf.grad if leaf is not None else None
    return loss


SPLITS = [
    pytest.param([(0, 2)], [(0, 2)], id="pp1x1"),
    pytest.param([(0, 1), (1, 2)], [(0, 1), (1, 2)], id="pp2x2"),
    pytest.param([(0, 0), (0, 2)], [(0, 2), (2, 2), (2, 2)], id="uneven-empty-stages"),
]


def _assert_same_loss_and_gradients(loss, expected, model, reference):
    """The pipelined model's loss and every parameter's gradient equal the unsplit reference's."""
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    ref_params = dict(reference.named_parameters())
    n_compared = 0
    for name, param in model.named_parameters():
        ref_grad = ref_params[name].grad
        # Parameters the loss does not reach (e.g. SigLIP's post-layernorm) have no grad in either.
        assert (param.grad is None) == (ref_grad is None), name
        if ref_grad is not None:
            torch.testing.assert_close(param.grad, ref_grad, rtol=1e-5, atol=1e-6, msg=name)
            n_compared += 1
    assert n_compared >= len(ref_params) - 2


@pytest.mark.parametrize("arch", sorted(PRESETS))
@pytest.mark.parametrize("vision_ranges,llm_ranges", SPLITS)
def test_chained_stages_match_full_model_loss_and_gradients(arch, vision_ranges, llm_ranges):
    torch.manual_seed(0)
    reference, model = _models(arch)
    batch = _batch(arch, reference, torch.Generator().manual_seed(1))

    expected = _reference_loss(arch, reference, *batch)
    expected.backward()
    loss = _pipeline_loss_and_backward(model, vision_ranges, llm_ranges, *batch)

    _assert_same_loss_and_gradients(loss, expected, model, reference)


def test_uniform_split_covers_all_layers_once():
    assert uniform_layer_split(27, 4) == [(0, 7), (7, 14), (14, 21), (21, 27)]
    assert uniform_layer_split(2, 2) == [(0, 1), (1, 2)]
    with pytest.raises(UserError, match="cannot split 2 layers into 3"):
        uniform_layer_split(2, 3)


def test_bad_layer_ranges_are_refused():
    _, model = _models("llava_ov")
    with pytest.raises(UserError, match=r"LLM stage 0: layer range \[1, 3\) is outside \[0, 2\)"):
        build_llm_stage(model, 0, 2, (1, 3))
    with pytest.raises(UserError, match=r"vision stage 1: layer range \[2, 1\) is outside"):
        build_vision_stage(model, 1, 2, (2, 1))
    with pytest.raises(UserError, match="does not exist"):
        build_llm_stage(model, 2, 2)


def test_stage_refuses_attention_that_crosses_samples():
    reference, _ = _models("llava_ov")  # built with plain SDPA: a packed row would mix samples
    with pytest.raises(UserError, match="attend to each other"):
        build_llm_stage(reference, 0, 1)


def test_image_token_count_mismatch_is_one_line_error():
    _, model = _models("llava_ov")
    stage = build_llm_stage(model, 0, 1)
    ids = torch.tensor([1, model.config.image_token_id, 2])
    with pytest.raises(UserError, match="1 image placeholder tokens .* but 2 image feature rows"):
        stage(ids, PackedSequence.from_lengths([3]), image_features=torch.zeros(2, 64),
              shift_labels=torch.full((3,), -100))


# Activation recomputation (dflop.models.recompute) must not change the maths: the same comparison
# against transformers' own model, with each stage in a different mode.
RECOMPUTE_SPLITS = [
    pytest.param(("full", "selective"), ("selective", "full"), id="full-selective"),
    pytest.param(("selective", "none"), ("none", "selective"), id="selective-none"),
    pytest.param(("none", "full"), ("full", "none"), id="none-full"),
]


@pytest.mark.parametrize("arch", sorted(PRESETS))
@pytest.mark.parametrize("vision_modes,llm_modes", RECOMPUTE_SPLITS)
def test_recomputing_stages_match_full_model_loss_and_gradients(arch, vision_modes, llm_modes):
    torch.manual_seed(0)
    reference, model = _models(arch)
    batch = _batch(arch, reference, torch.Generator().manual_seed(1))
    expected = _reference_loss(arch, reference, *batch)
    expected.backward()
    ranges = [(0, 1), (1, 2)]
    loss = _pipeline_loss_and_backward(model, ranges, ranges, *batch, recompute=(vision_modes, llm_modes))

    _assert_same_loss_and_gradients(loss, expected, model, reference)


def test_selective_recompute_switches_only_its_stage_layers_and_back():
    """Selective mode gives each of its layers' attention a recomputing config; none restores it."""
    _, model = _models("internvl")
    config = model.config.vision_config
    stage = build_vision_stage(model, 1, 2, (1, 2), recompute="selective")
    attention = stage.layers[0].attention
    assert attention.config._attn_implementation == "sdpa+recompute"
    assert model.model.vision_tower.encoder.layer[0].attention.config is config  # other stage untouched
    assert config._attn_implementation == "sdpa"
    build_vision_stage(model, 1, 2, (1, 2), recompute="none")
    assert attention.config is config
    with pytest.raises(UserError, match="recompute mode 'partial'"):
        build_llm_stage(model, 0, 1, recompute="partial")


def test_recompute_is_a_wrapper_over_the_plain_layers():
    """Full recompute wraps each layer of the stage (the same module inside), selective only gives
    its attention the recomputing config, and mode none gives back exactly the plain layers."""
    _, model = _models("llava_ov")
    plain = list(build_llm_stage(model, 0, 1).layers)
    stage = build_llm_stage(model, 0, 1, recompute="full")
    assert stage.recompute == "full"
    assert all(isinstance(w, CheckpointWrapper) and w._checkpoint_wrapped_module is p for w, p in zip(stage.layers, plain))
    apply_recompute(stage, "selective", "LLM stage 0")
    assert [id(m) for m in stage.layers] == [id(p) for p in plain]
    assert all(attention_module(p).config._attn_implementation.endswith("+recompute") for p in plain)
    apply_recompute(stage, "full", "LLM stage 0")
    apply_recompute(stage, "none", "LLM stage 0")
    assert [id(m) for m in stage.layers] == [id(p) for p in plain] and stage.recompute == "none"
    assert all(attention_module(p).config is model.config.text_config for p in plain)
