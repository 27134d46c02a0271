"""The FLOP-count cost model against PyTorch's own FLOP counter on a real transformers model."""

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dflop.costmodel.analytic import analytic_cost_model


@pytest.fixture(scope="module")
def config():
    from dflop.models.builder import model_config

    return model_config("llava_ov", "siglip-tiny", "qwen2.5-tiny")


@pytest.fixture(scope="module")
def tiny(config):
    from dflop.models.info import info_of

    return info_of(config)


def counted_llm_flops(seq_lens):
    """Forward FLOPs of the tiny Qwen2 LM (layers + head) on one sequence of each length."""
    from transformers import Qwen2ForCausalLM

    from dflop.models.presets import llm_preset, text_config

    torch.manual_seed(0)
    cfg = text_config(llm_preset("qwen2.5-tiny"))
    cfg._attn_implementation = "eager"
    model = Qwen2ForCausalLM(cfg).eval()
    out = []
    for s in seq_lens:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.randint(0, 2000, (1, s)))
        out.append(counter.get_total_flops())
    return np.array(out, dtype=np.float64)


def test_llm_flops_match_the_flop_counter(config, tiny):
    tflops = 100.0
    cost = analytic_cost_model(config, tp_degrees=(1,), achieved_tflops=tflops, op_overhead_ms=0.0)
    flops_per_ms = tflops * 1e9
    layer, head = cost.module("llm_layer", 1), cost.module("llm_head", 1)
    coef = dict(zip(layer.features, layer.coefficients("fwd_ms")))
    head_coef = dict(zip(head.features, head.coefficients("fwd_ms")))
    s = np.array([32, 64, 128], dtype=np.float64)
    counted = counted_llm_flops(s.astype(int))
    # counted = a s + b s^2; the counter charges full (non-causal) attention matmuls
    b = (counted[1] - 2 * counted[0]) / (s[1] ** 2 - 2 * s[0] ** 2)
    a = (counted[0] - b * s[0] ** 2) / s[0]
    assert counted[2] == pytest.approx(a * s[2] + b * s[2] ** 2, rel=1e-9)
    L = tiny.llm_layers
    linear = (L * coef["tokens"] + head_coef["tokens"]) * flops_per_ms
    assert linear == pytest.approx(a, rel=0.01)  # parameters count norms and biases the counter does not
    assert L * coef["sq_tokens"] * flops_per_ms == pytest.approx(b / 2, rel=1e-9)  # causal: half the matmuls


def test_tensor_parallel_splits_flops_and_adds_communication(config, tiny):
    cost = analytic_cost_model(config, tp_degrees=(1, 2), tp_gbps=100.0, op_overhead_ms=0.0,
                               preset="llava_ov/siglip-tiny/qwen2.5-tiny")
    one, two = (dict(zip(cost.module("llm_layer", t).features, cost.module("llm_layer", t).coefficients("fwd_ms")))
                for t in (1, 2))
    h = tiny.llm_hidden
    allreduce_ms = 2 * (2 * (2 - 1) / 2 * 2 * h / 100e9) * 1e3  # two ring all-reduces of bf16 hidden states
    assert two["tokens"] == pytest.approx(one["tokens"] / 2 + allreduce_ms, rel=1e-12)
    assert two["sq_tokens"] == pytest.approx(one["sq_tokens"] / 2, rel=1e-12)
    assert cost.module("llm_layer", 2).param_bytes == pytest.approx(tiny.llm_layer_params * 2 / 2)
    assert cost.provenance.preset == "llava_ov/siglip-tiny/qwen2.5-tiny"
