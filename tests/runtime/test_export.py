"""Hugging Face export: the directory loads with transformers' Auto class, holds exactly the trained
weights and computes the same forward; multi-rank exports (pipeline stages on different ranks,
DTensor tensor-parallel shards) give the weights of the single-process model they were cut from.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText
from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

from dflop.errors import UserError
from dflop.models.builder import build_model
from dflop.runtime.param_names import rank_parameters
from dflop.runtime.export import HeldTensor, export_hf, transfer_plan
from test_checkpoint_helpers import (
    INTERNVL,
    LAYOUTS,
    LLAVA,
    perturbed_weights,
    spawn,
    tensor_parallel_layout,
    toy_batch,
)

torch.set_num_threads(1)


def _train_a_little(model) -> None:
    """Two AdamW steps on a text loss, so the weights are not the init."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        ids = toy_batch(3, step, 0, 1)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _image_and_text_input(model, generator) -> dict:
    """One image between text tokens, as the full transformers model takes it."""
    config = model.config
    size = config.vision_config.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    with torch.no_grad():
        if config.model_type == "llava_onevision":
            image_sizes = torch.tensor([[56, 112]])
            tiles = image_size_to_num_patches(image_sizes[0], config.image_grid_pinpoints, size)
            pixels = torch.randn(tiles, 3, size, size, generator=generator)
            n_image = model.model.get_image_features(pixels, image_sizes).pooler_output[0].shape[0]
            extra = {"image_sizes": image_sizes}
        else:
            pixels = torch.randn(2, 3, size, size, generator=generator)
            n_image = 2 * model.model.get_image_features(pixels).pooler_output.shape[1]
            extra = {}
    text = torch.randint(0, 2000, (10,), generator=generator)
    ids = torch.cat([text[:4], torch.full((n_image,), config.image_token_id), text[4:]])
    return {"input_ids": ids[None], "pixel_values": pixels, "use_cache": False, **extra}


@pytest.mark.parametrize("spec", [LLAVA, INTERNVL], ids=["llava_ov", "internvl"])
def test_export_loads_with_transformers_and_computes_the_same_forward(tmp_path, spec):
    model = build_model(*spec, seed=0)
    _train_a_little(model)
    out = export_hf(tmp_path / "final", rank_parameters(model))

    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no temporary left behind
    assert "dflop" not in (out / "config.json").read_text()  # loadable without dflop installed
    loaded = AutoModelForImageTextToText.from_pretrained(out)
    assert type(loaded) is type(model)
    trained = model.state_dict()
    assert set(loaded.state_dict()) == set(trained)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, trained[name]), name

    inputs = _image_and_text_input(model, torch.Generator().manual_seed(0))
    model.eval(), loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-6)


def test_export_replaces_an_existing_directory_and_casts(tmp_path):
    model = build_model(*LLAVA, seed=0)
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "stale.bin").write_bytes(b"old")
    out = export_hf(tmp_path / "final", rank_parameters(model), dtype="bfloat16")
    assert not (out / "stale.bin").exists()
    loaded = AutoModelForImageTextToText.from_pretrained(out, dtype="auto")
    for name, value in loaded.state_dict().items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, model.state_dict()[name].to(torch.bfloat16)), name


def _held(name, rank):
    return HeldTensor(name, rank, (4, 4), "float32")


def test_transfer_plan_takes_each_tensor_once_from_its_lowest_rank():
    manifests = [[_held("a", 0)], [_held("a", 1), _held("w", 1)], [_held("w", 2)], [_held("b", 3), _held("w", 3)]]
    plan = {t.name: t.rank for t in transfer_plan(manifests, {"a", "b", "w"})}
    assert plan == {"a": 0, "b": 3, "w": 1}


def test_transfer_plan_names_what_is_missing():
    with pytest.raises(UserError, match="no rank holds parameter b"):
        transfer_plan([[_held("a", 0)]], {"a", "b"})
    with pytest.raises(UserError, match="parameter z is not a parameter of the model"):
        transfer_plan([[_held("z", 0)]], set())


def _distributed_exports(rank: int, tmp: str) -> None:
    for kind, make in LAYOUTS.items():
        export_hf(f"{tmp}/{kind}", make(rank, 2).params)


@pytest.mark.distributed
def test_multi_rank_exports_equal_the_single_process_model(tmp_path):
    """Ranks hold NaN in every parameter they do not run, so a weight taken from the wrong rank shows."""
    spawn(_distributed_exports, 2, tmp_path, str(tmp_path))
    for kind in LAYOUTS:
        spec = INTERNVL if kind == "tensor_parallel" else LLAVA
        reference = build_model(*spec, seed=0)
        reference.load_state_dict(perturbed_weights(spec), strict=False)
        loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / kind)
        expected = reference.state_dict()
        assert set(loaded.state_dict()) == set(expected), kind
        for name, value in loaded.state_dict().items():
            assert torch.equal(value, expected[name]), (kind, name)


def _export_tp_groups_with_replicas(rank: int, tmp: str) -> None:
    export_hf(f"{tmp}/final", tensor_parallel_layout(rank, 4, tp_size=2).params)


@pytest.mark.distributed
def test_export_with_tp_subgroups_and_data_parallel_replicas(tmp_path):
    """4 ranks: TP groups {0, 1} and {2, 3}, each a full replica; every shard is taken once."""
    spawn(_export_tp_groups_with_replicas, 4, tmp_path, str(tmp_path))
    reference = build_model(*INTERNVL, seed=0)
    reference.load_state_dict(perturbed_weights(INTERNVL))
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "final")
    expected = reference.state_dict()
    assert set(loaded.state_dict()) == set(expected)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), name
