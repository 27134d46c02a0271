"""Stage predictions of a hand-built CostModel against the closed form written out by hand."""

import pytest

from dflop.costmodel.model import CostModel, ModuleCosts, Provenance
from dflop.errors import UserError


def _module(name, features, fwd, bwd, act, param_bytes, tp=1):
    return ModuleCosts(module=name, tp=tp, features=features, coef={"fwd_ms": fwd, "bwd_ms": bwd, "act_bytes": act},
                       param_bytes=param_bytes, n_shapes=5, profiled_batch=(1, 8), profiled_seq_len=(16, 2048))


def hand_model(dtype="float32"):
    tiles, tokens, attn = ("tiles", "const"), ("tokens", "const"), ("tokens", "tokens_pow1.5", "sq_tokens", "const")
    return CostModel([
        _module("vision_embed", tiles, (0.1, 1.0), (0.2, 2.0), (100.0, 10.0), 1000.0),
        _module("vision_layer", tiles, (1.0, 0.5), (2.0, 0.25), (1000.0, 0.0), 4000.0),
        _module("projector", tiles, (0.3, 0.7), (0.6, 0.9), (300.0, 5.0), 2000.0),
        _module("llm_embed", tokens, (1e-3, 0.1), (2e-3, 0.2), (8.0, 0.0), 8000.0),
        _module("llm_layer", attn, (1e-2, 1e-3, 1e-5, 0.4), (2e-2, 0.0, 3e-5, 0.6), (50.0, 0.0, 0.5, 7.0), 6000.0),
        _module("llm_head", tokens, (5e-3, 0.3), (1e-2, 0.5), (40.0, 3.0), 8000.0),
    ], Provenance(preset="hand", device="cpu", dtype=dtype))


def test_vision_stage_time_is_layers_plus_embed_and_projector():
    tiles = [2, 0, 5]  # 7 tiles in the microbatch
    got = hand_model().vision_stage_time(tiles, n_layers=3, first=True, last=True, tp=1)
    fwd_ms = 3 * (1.0 * 7 + 0.5) + (0.1 * 7 + 1.0) + (0.3 * 7 + 0.7)
    bwd_ms = 3 * (2.0 * 7 + 0.25) + (0.2 * 7 + 2.0) + (0.6 * 7 + 0.9)
    assert got.fwd_s == pytest.approx(fwd_ms / 1e3, rel=1e-12)
    assert got.bwd_s == pytest.approx(bwd_ms / 1e3, rel=1e-12)
    middle = hand_model().vision_stage_time(tiles, n_layers=3, first=False, last=False, tp=1)
    assert middle.fwd_s == pytest.approx(3 * (7 + 0.5) / 1e3, rel=1e-12)


def test_llm_stage_time_uses_per_sample_squared_lengths_not_the_packed_length():
    lens = [100, 300]
    got = hand_model().llm_stage_time(lens, n_layers=2, first=False, last=True, tp=1)
    # per-sample squares and powers, not those of the packed length (100 + 300)
    layer_fwd = 1e-2 * 400 + 1e-3 * (100**1.5 + 300**1.5) + 1e-5 * (100**2 + 300**2) + 0.4
    head_fwd = 5e-3 * 400 + 0.3
    assert got.fwd_s == pytest.approx((2 * layer_fwd + head_fwd) / 1e3, rel=1e-12)
    layer_bwd = 2e-2 * 400 + 3e-5 * (100**2 + 300**2) + 0.6
    assert got.bwd_s == pytest.approx((2 * layer_bwd + 1e-2 * 400 + 0.5) / 1e3, rel=1e-12)


@pytest.mark.parametrize("dtype, grad_per_param_byte, optimizer_per_param_byte", [
    ("float32", 4 / 4, 8 / 4),       # 4 B param, 4 B grad, 8 B moments
    ("bfloat16", 4 / 4, 8 / 4),      # the same: float32 master weights under bf16 autocast
])
def test_llm_stage_memory_is_training_state_plus_in_flight_activations(dtype, grad_per_param_byte, optimizer_per_param_byte):
    got = hand_model(dtype).llm_stage_memory([10, 20], n_layers=4, first=True, last=False, tp=1, in_flight=3)
    param_bytes = 4 * 6000.0 + 8000.0
    assert got.param_bytes == pytest.approx(param_bytes)
    assert got.grad_bytes == pytest.approx(param_bytes * grad_per_param_byte)
    assert got.optimizer_bytes == pytest.approx(param_bytes * optimizer_per_param_byte)
    activation = 4 * (50.0 * 30 + 0.5 * (100 + 400) + 7.0) + 8.0 * 30
    assert got.activation_bytes == pytest.approx(activation)
    assert got.total_bytes == pytest.approx(param_bytes * (1 + grad_per_param_byte + optimizer_per_param_byte) + 3 * activation)


def test_colocated_stage_adds_the_whole_vision_tower_to_the_first_llm_stage():
    model = hand_model()
    got = model.colocated_stage_time([3, 1], [50, 70], vision_layers=5, llm_layers=2, last=False, tp_v=1, tp_l=1)
    vision_fwd = 5 * (1.0 * 4 + 0.5) + (0.1 * 4 + 1.0) + (0.3 * 4 + 0.7)
    llm_fwd = 2 * (1e-2 * 120 + 1e-3 * (50**1.5 + 70**1.5) + 1e-5 * (50**2 + 70**2) + 0.4) + (1e-3 * 120 + 0.1)
    assert got.fwd_s == pytest.approx((vision_fwd + llm_fwd) / 1e3, rel=1e-12)
    memory = model.colocated_stage_memory([3, 1], [50, 70], vision_layers=5, llm_layers=2, last=False,
                                          tp_v=1, tp_l=1, in_flight=2)
    assert memory.param_bytes == pytest.approx(5 * 4000 + 1000 + 2000 + 2 * 6000 + 8000)


def test_bad_arguments_are_one_line_errors():
    model = hand_model()
    with pytest.raises(UserError, match=r"^seq_lens must be whole numbers >= 1, got 0$"):
        model.llm_stage_time([5, 0], n_layers=1, first=False, last=False, tp=1)
    with pytest.raises(UserError, match=r"^tiles_per_sample must be whole numbers >= 0, got 1.5$"):
        model.vision_stage_time([1.5], n_layers=1, first=False, last=False, tp=1)
    with pytest.raises(UserError, match=r"^n_layers must be a whole number >= 0, got -1$"):
        model.llm_stage_time([5], n_layers=-1, first=False, last=False, tp=1)
    with pytest.raises(UserError, match=r"^in_flight must be >= 1, got 0$"):
        model.llm_stage_memory([5], n_layers=1, first=False, last=False, tp=1, in_flight=0)
    with pytest.raises(UserError, match=r"^no profile for llm_layer at tp=2; profiled tp: 1$"):
        model.llm_stage_time([5], n_layers=1, first=False, last=False, tp=2)
    with pytest.raises(UserError, match=r"^unsupported training dtype 'int8'"):
        hand_model("int8")
