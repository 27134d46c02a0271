"""Vision TP degrees reached by padding zero heads (NVLM's InternViT-6B recipe): admitted and priced.

References, all by hand: the admissible degrees of InternViT-6B and SigLIP-so400m from their
published widths; the parameter count, FLOPs and activation bytes of a padded SigLIP-like layer
(h 48, 3 heads of 16, MLP 256) written out tensor by tensor; and InternViT-6B's layer at TP 8
(25 heads padded to 32). The planner check compares the padded tower with its unpadded twin (6
heads of 8: the same weights' shapes, nothing to pad at TP 2), so what differs is exactly the
zero head's share of the attention: a model that ignored the padding, or padded the MLP too,
fails it.
"""

import copy

import numpy as np
import pytest

from dflop.costmodel.analytic import analytic_cost_model
from dflop.models.builder import model_config
from dflop.models.info import info_of, model_info, padded_vision_heads
from dflop.plan import Layout
from dflop.pricing.cluster import GB, Cluster
from dflop.pricing.pool import Pool, TransferSizes
from dflop.planner.planfile import vision_padding_record
from dflop.planner.search import prepare_means
from dflop.planner.space import ModelShape, build_space, describe_plan
from dflop.planner.stages import TransferMeans
from dflop.planner.technique_choice import TechniqueSpace

H, D, MLP, T, LV = 48, 16, 256, 16, 2  # the small tower: hidden, head dim, MLP width, tokens per tile, layers
TFLOPS = 1.0  # 1e9 FLOPs per millisecond


def small_config(heads: int):
    """siglip-tiny + qwen2.5-tiny with a 48-wide tower of `heads` heads (3 of 16, or 6 of 8)."""
    config = copy.deepcopy(model_config("llava_ov", "siglip-tiny", "qwen2.5-tiny"))
    config.vision_config.hidden_size, config.vision_config.num_attention_heads = H, heads
    return config


def padded_siglip_layer_params(padded_heads: int) -> int:
    """A SigLIP layer whose q/k/v/o are `padded_heads` heads of D wide (weights and biases; the
    output bias stays H wide), plus the unchanged MLP and two LayerNorms."""
    inner = padded_heads * D
    attention = 3 * (inner * H + inner) + (H * inner + H)
    return attention + (MLP * H + MLP) + (H * MLP + H) + 2 * (2 * H)


def test_admissible_degrees_against_the_published_widths():
    """InternViT-6B: 25 heads, MLP 12800 = 2^9 x 25, projector width 8192 (Qwen2.5-72B): every power
    of 2 up to 64 once heads pad (26, 28, 32, 32, 32, 64); SigLIP-so400m: 16 heads, MLP 4304 =
    16 x 269, width 4096 (Llama-3-8B): 1-16, nothing padded."""
    vit = model_info("internvl", "internvit-6b", "qwen2.5-72b")
    assert vit.vision_tp_degrees == (1, 2, 4, 8, 16, 32, 64)
    assert vit.vision_padded_heads == (25, 26, 28, 32, 32, 32, 64)
    siglip = model_info("llava_ov", "siglip-so400m", "llama3-8b")
    assert siglip.vision_tp_degrees == (1, 2, 4, 8, 16) and siglip.vision_padded_heads == (16,) * 5


def test_padded_layer_priced_by_hand():
    """3 heads at TP 2 -> 4 heads: parameters, forward FLOPs and kept bytes of the padded layer."""
    config = small_config(3)
    assert padded_vision_heads(config, 2) == 4 and padded_vision_heads(config, 1) == 3
    assert info_of(config).vision_layer_params == padded_siglip_layer_params(3)  # the unpadded count
    cost = analytic_cost_model(config, tp_degrees=(1, 2), achieved_tflops=TFLOPS, tp_gbps=300.0, op_overhead_ms=0.0)
    layer = cost.module("vision_layer", 2)
    params = padded_siglip_layer_params(4)
    assert layer.param_bytes == pytest.approx(4 * params / 2)  # float32 masters, split over 2 ranks
    assert cost.module("vision_layer", 1).param_bytes == pytest.approx(4 * padded_siglip_layer_params(3))
    fwd = dict(zip(layer.features, layer.coefficients("fwd_ms")))
    flops = (2 * params * T + 4 * T * T * 4 * D) / 2  # the core's QK^T and AV over 4 heads of D
    allreduce_ms = 2 * (2 * (2 - 1) / 2 * 2 * T * H / 300e9 * 1e3)  # two ring all-reduces of the h-wide output
    assert fwd["tiles"] == pytest.approx(flops / (TFLOPS * 1e9) + allreduce_ms, rel=1e-12)
    act = dict(zip(layer.features, layer.coefficients("act_bytes")))
    # per token, bf16 autocast: q, k, v, attention output 4 x 64/2 x 2 = 256; MLP in/out 2 x 256/2 x 2 = 512;
    # the two norms' float32 inputs 2 x 48 x 4 = 384; autocast's copies of their outputs for q, k, v
    # and fc1 4 x 48 x 2 = 384; float32 mean + rstd x 2 = 16; log-sum-exp 4 x 4/2 = 8
    assert act["tiles"] == pytest.approx(T * (256 + 512 + 384 + 384 + 16 + 8))
    assert act["const"] == pytest.approx(2 * params / 2)  # autocast's bf16 copy of the rank's weights
    sel = dict(zip(layer.features, layer.coefficients("act_bytes:selective")))
    assert sel["tiles"] == pytest.approx(T * (256 + 512 + 384 + 384 + 16))


def test_internvit_6b_layer_at_tp8_counts_32_heads():
    """InternViT-6B at TP 8: 32 heads of 128 in q/k/v/o and the QK-norm weights, the output bias,
    layer scales, MLP and norms as published: 134,388,992 parameters per layer, an eighth per rank."""
    d, h, mlp = 128, 3200, 12800
    attention = 4 * (32 * d) * h + 2 * (32 * d) + h
    rest = 2 * h + (2 * mlp * h + mlp + h) + 2 * h  # layer scales, MLP, two norms
    assert attention + rest == 134_388_992
    cost = analytic_cost_model(model_config("internvl", "internvit-6b", "qwen2.5-72b"), tp_degrees=(8,))
    assert cost.module("vision_layer", 8).param_bytes == pytest.approx(4 * 134_388_992 / 8)


def test_colocated_plan_pays_the_padded_share():
    """The planner admits the colocated layout with vision TP = LLM TP = 2 for the 3-head tower, and
    prices it above the unpadded twin by exactly one zero head per layer (by hand below)."""
    cluster = Cluster(nodes=1, gpus_per_node=2, gpu_memory_bytes=80 * GB, intra_node_bytes_per_s=300 * GB,
                      inter_node_bytes_per_s=50 * GB, p2p_latency_s=20e-6, device="cuda")
    n, tiles = 16, 2
    pool = Pool(np.array([f"s{i}" for i in range(n)]), np.full(n, tiles), np.full(n, 100), np.full(n, tiles * 16))
    layout = Layout("colocated", 2, 1, 1, 2, 1, 1, 1)  # m = 1: the whole batch is one microbatch
    priced = {}
    for heads in (3, 6):
        config = small_config(heads)
        shape = ModelShape.from_info(info_of(config))
        cost = analytic_cost_model(config, tp_degrees=(1, 2), achieved_tflops=TFLOPS, op_overhead_ms=0.0)
        space, rows = build_space(shape, cost, cluster, placements=("colocated",), microbatches=(1,), global_batch=n,
                                  mean_tiles=float(tiles))
        assert 2 in space.colocated_tp
        means = prepare_means(cost, shape, pool, space, TechniqueSpace.of("auto", False, False))
        sizes = TransferSizes.for_model(llm_hidden=shape.llm_hidden, vision_hidden=shape.vision_hidden,
                                        vision_tokens_per_tile=shape.vision_tokens_per_tile, dtype="bfloat16")
        sm = means.stage_model(layout, (False, False, False), cluster=cluster, global_batch=n,
                               transfer=TransferMeans.of(pool, sizes))
        split = [shape.llm_layers]
        priced[heads] = {mode: (sm.memory_at(split, [mode])[0], sm.stage_time_s(split, [mode])[0]) for mode in sm.modes}
        if heads == 3:
            assert describe_plan(sm.plan(split), shape).endswith("; vision tp2 (3 heads padded to 4)")
            assert vision_padding_record(sm.plan(split), shape) == {
                "vision_heads_padded": {"tp": 2, "heads": 3, "padded_heads": 4}}
            assert [r["tp_v"] for r in rows if r["reason"] == "vision_heads_padded"] == [2]
        else:
            assert describe_plan(sm.plan(split), shape) == sm.plan(split).describe()

    zero_head = 3 * (D * H + D) + H * D  # one head's q/k/v weights and biases and its output columns
    state = 4 + 4 + 8  # float32 weight + gradient + AdamW's m, v per parameter (bf16 autocast)
    static = LV * zero_head / 2 * state  # per rank at TP 2
    copies = LV * zero_head / 2 * 2  # autocast's bf16 weight copy of the one microbatch in flight
    tokens = T * tiles * n  # one microbatch of the whole batch
    # kept per token and layer, bf16 at TP 2: q/k/v/output 4 x (64 - 48)/2 x 2 = +64; log-sum-exp
    # 4 x (4 - 6)/2 = -4 (the twin has more, narrower heads)
    expected_memory = {"full": static, "none": static + copies + LV * tokens * (64 - 4),
                       "selective": static + copies + LV * tokens * 64}
    for mode, bytes_ in expected_memory.items():
        assert priced[3][mode][0] - priced[6][mode][0] == pytest.approx(bytes_, rel=1e-9), mode
    # forward FLOPs per tile and layer of the zero head: its projections 2 x zero_head x T and its
    # core 4 T^2 D, over 2 ranks; forward + backward = 3 x forward (full recompute reruns it: 4 x)
    extra_flops = (2 * zero_head * T + 4 * T * T * D) / 2 * tiles * n * LV
    for mode, passes in (("none", 3), ("selective", 3), ("full", 4)):
        core = 4 * T * T * D / 2 * tiles * n * LV if mode == "selective" else 0.0  # the recomputed core
        assert priced[3][mode][1] - priced[6][mode][1] == pytest.approx(
            (passes * extra_flops + core) / (TFLOPS * 1e12), rel=1e-9), mode
