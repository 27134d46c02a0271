"""The random init by name draws what transformers' own init draws (per-tensor statistics, exact
constants and buffers), and filling a model in several calls gives what one call gives."""

from __future__ import annotations

import math

import pytest
import torch

from dflop.models.architectures import architecture_of
from dflop.models.builder import build_model, build_on_meta, model_config
from dflop.models.materialize import Materializer, named_tensors

MODELS = {"llava_ov-small": ("llava_ov", "siglip-small", "qwen2.5-small"),
          "internvl-tiny": ("internvl", "internvit-tiny", "qwen2.5-small")}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_init_statistics_match_transformers_own_init(model):
    spec = MODELS[model]
    ours = build_model(*spec, seed=0, llm_attention="sdpa")
    config = model_config(*spec)
    torch.manual_seed(0)
    theirs = architecture_of(config).model_class._from_config(config, attn_implementation="sdpa")
    ref = {**dict(theirs.named_parameters()), **dict(theirs.named_buffers())}
    got = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}
    assert got.keys() == ref.keys()
    checked = 0
    for name, expected in ref.items():
        value = got[name]
        assert value.dtype == expected.dtype and value.shape == expected.shape, name
        if not expected.is_floating_point() or expected.std() == 0 or name.endswith("inv_freq"):
            assert torch.equal(value, expected), name  # constants (norms, zero biases, layer scale) and buffers
            continue
        n = expected.numel()
        if n < 1000:
            continue
        std = expected.double().std().item()
        # five standard errors of a sample's std and mean
        assert abs(value.double().std().item() / std - 1) < 5 / math.sqrt(2 * n), (name, value.std(), std)
        assert abs(value.double().mean().item() - expected.double().mean().item()) < 5 * std * math.sqrt(2 / n), name
        checked += 1
    assert checked >= 20


def test_filling_tensor_by_tensor_gives_what_one_call_gives():
    # SigLIP's attention rule also draws its projections: a later call must not redraw those filled before
    spec = ("llava_ov", "siglip-tiny", "qwen2.5-tiny")
    whole = build_model(*spec, seed=5)
    model = build_on_meta(model_config(*spec))
    fill = Materializer(model, seed=5)
    for name in sorted(named_tensors(model), reverse=True):
        fill([name])
    expected = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(tensor, expected[name]), name
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
