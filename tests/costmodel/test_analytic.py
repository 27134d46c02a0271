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
    assert cost.module("llm_layer", 2).param_bytes == pytest.approx(tiny.llm_layer_params * 4 / 2)  # fp32 masters
    assert cost.provenance.preset == "llava_ov/siglip-tiny/qwen2.5-tiny"


def counted_stage_flops(mode, seq_lens):
    """FLOPs of forward + backward of a 2-layer LLM stage of the tiny model (the counter charges the
    linear layers; the CPU flash-attention kernel is not in its table)."""
    from dflop.models.builder import build_model
    from dflop.models.packing import PackedSequence
    from dflop.models.stages import build_llm_stage

    model = build_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", seed=0)
    stage = build_llm_stage(model, 1, 3, (0, 2), recompute=mode)
    x = torch.randn(1, sum(seq_lens), model.config.text_config.hidden_size, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        stage(x, PackedSequence.from_lengths(seq_lens)).sum().backward()
    return counter.get_total_flops()


def test_recompute_full_backward_adds_the_counted_forward(config, tiny):
    """Full recomputation runs each layer's forward again in backward (up to its last saved tensor:
    not the MLP down projection): the analytic backward grows by the forward FLOPs the counter sees
    in a real recomputing stage."""
    tflops, seq_lens = 100.0, [37, 50, 24]
    cost = analytic_cost_model(config, tp_degrees=(1,), achieved_tflops=tflops, op_overhead_ms=0.0)
    extra = counted_stage_flops("full", seq_lens) - counted_stage_flops("none", seq_lens)
    kw = dict(n_layers=2, first=False, last=False, tp=1)
    none, full = (cost.llm_stage_time(seq_lens, recompute=m, **kw) for m in ("none", "full"))
    predicted = (full.bwd_s - none.bwd_s) * 1e3 * tflops * 1e9
    attention = 2 * 2 * tiny.llm_hidden * sum(s * s for s in seq_lens)  # analytic causal attention, 2 layers
    assert full.fwd_s == none.fwd_s
    # minus attention: the counter has no formula for the CPU flash kernel; rel: norms and biases
    assert predicted - attention == pytest.approx(extra, rel=0.01)


def test_recompute_selective_and_full_memory_and_time(config, tiny):
    cost = analytic_cost_model(config, tp_degrees=(1, 2), op_overhead_ms=0.0)
    kw = dict(n_layers=3, first=False, last=False, in_flight=2)
    lens = [100, 20]
    for t in (1, 2):
        none, sel, full = (cost.llm_stage_memory(lens, tp=t, recompute=m, **kw) for m in ("none", "selective", "full"))
        assert full.activation_bytes == pytest.approx(3 * 120 * 4 * tiny.llm_hidden)  # float32 layer inputs
        text = config.text_config
        heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
        head_dim = text.hidden_size // heads
        # selective drops the float32 log-sum-exp (its checkpoint keeps the kernel's bf16 q, k, v)
        assert none.activation_bytes - sel.activation_bytes == pytest.approx(3 * 120 * 4 * heads / t)
        # autocast's bf16 weight copies: 2 bytes per layer parameter per microbatch in flight (2 here),
        # kept by none and selective, dropped by full (the one per-microbatch constant of a layer)
        copies = 2 * 3 * 2 * tiny.llm_layer_params / t
        assert cost.module("llm_layer", t).coefficients("act_bytes")[-1] == pytest.approx(2 * tiny.llm_layer_params / t)
        assert none.activation_bytes - full.activation_bytes > copies
        assert full.static_bytes == none.static_bytes
        times = {m: cost.llm_stage_time(lens, n_layers=3, first=False, last=False, tp=t, recompute=m)
                 for m in ("none", "selective", "full")}
        attention_fwd_s = 3 * 2 * tiny.llm_hidden / t * (100**2 + 20**2) / 400e12
        assert times["selective"].bwd_s - times["none"].bwd_s == pytest.approx(attention_fwd_s, rel=1e-9)
        # the forward again, less the MLP down projection and its all-reduce (early stop)
        h, inner = tiny.llm_hidden, config.text_config.intermediate_size
        allreduce_s = 0.0 if t == 1 else 2 * (t - 1) / t * 2 * h / 300e9
        skipped_s = 3 * 120 * (2 * h * inner / t / 400e12 + allreduce_s)
        assert times["full"].bwd_s - times["none"].bwd_s == pytest.approx(times["none"].fwd_s - skipped_s, rel=1e-9)
    vision = {m: cost.vision_stage_memory([2, 1], n_layers=2, first=False, last=False, tp=1, in_flight=1,
                                          recompute=m).activation_bytes for m in ("none", "full")}
    assert vision["full"] == pytest.approx(2 * 3 * tiny.vision_tokens_per_tile * 4 * tiny.vision_hidden)


def test_fitted_model_without_recompute_costs_says_so(config):
    from dataclasses import replace

    from dflop.costmodel.model import CostModel
    from dflop.errors import UserError

    cost = analytic_cost_model(config, tp_degrees=(1,))
    plain = CostModel([replace(m, coef={k: v for k, v in m.coef.items() if ":" not in k}) for m in cost.modules.values()],
                      cost.provenance)
    plain.llm_stage_time([10], n_layers=1, first=False, last=False, tp=1)
    with pytest.raises(UserError, match="no full-recompute costs for llm_layer"):
        plain.llm_stage_time([10], n_layers=1, first=False, last=False, tp=1, recompute="full")


@pytest.mark.parametrize("arch", [("llava_ov", "siglip-tiny", "qwen2.5-tiny"),
                                  ("internvl", "internvit-tiny", "llama3-tiny")], ids=["tied", "untied"])
def test_one_stage_holding_the_whole_model_prices_its_distinct_parameters(arch):
    """Reference: the transformers model's distinct parameters (a tied LM head is the embedding).
    Within 0.1 %: the stages do not run the SigLIP tower's post-layernorm (128 parameters); a tied table
    counted twice would be 30 % over."""
    from dflop.models.builder import build_model, model_config
    from dflop.models.info import info_of

    config = model_config(*arch)
    info = info_of(config)
    cost = analytic_cost_model(config, tp_degrees=(1,), dtype="float32")
    memory = cost.colocated_stage_memory([1], [16], vision_layers=info.vision_layers, llm_layers=info.llm_layers,
                                         last=True, tp_v=1, tp_l=1, in_flight=1)
    distinct = {id(p): p.numel() for p in build_model(*arch).parameters()}
    assert memory.param_bytes == pytest.approx(4 * sum(distinct.values()), rel=1e-3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_lm_heads_transient_bounds_what_the_profiler_measures(config, dtype):
    """The LM head + loss's closed-form transient (`activations.llm_head_transient_bytes`) against
    what the model profiler measures on the real module (allocations traced op by op, gradients
    already there): never below it, and above it by at most its per-microbatch constant (the
    weight gradient's peak, which comes after the loss's); with a vocabulary 8x the tiny one's."""
    import copy

    from dflop.models.architectures import architecture
    from dflop.models.precision import Precision
    from dflop.models.tensor_parallel import TPGroup
    from dflop.profiling.model_modules import build_benches
    from dflop.profiling.model_profiler import _measured_run, _RankSync

    wide = copy.deepcopy(config)
    wide.text_config.vocab_size = 8 * config.text_config.vocab_size
    cost = analytic_cost_model(wide, tp_degrees=(1,), dtype=dtype)
    cpu = torch.device("cpu")
    (head,) = build_benches(architecture("llava_ov"), wide, modules=("llm_head",), tp=TPGroup(0, 1), device=cpu,
                            precision=Precision.of(dtype))
    V, h = wide.text_config.vocab_size, wide.text_config.hidden_size
    for tokens in (16, 128, 1024):
        inputs = head.make_inputs(1, tokens)
        leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]

        def forward():
            with head.precision.autocast("cpu"):  # the forward only, as the stages and the profiler run it
                return head.forward(*inputs)

        _, measured = _measured_run(forward, list(head.module.parameters()), leaves, _RankSync(cpu))
        predicted = cost.llm_stage_memory([tokens], n_layers=0, first=False, last=True, tp=1, in_flight=1)
        assert measured <= predicted.transient_bytes <= measured + 4 * V * h, tokens
    assert measured >= 8 * V * tokens  # the loss's backward, at a size where it is the peak
