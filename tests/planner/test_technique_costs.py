"""`technique_costs`: what a plan's memory techniques cost and save per stage, against the closed
forms of the analytic cost model (`dflop.costmodel.analytic`: full recompute reruns a layer's
forward except the MLP down projection, and keeps only the layer input) and of the training state
(`dflop.costmodel.memory`), computed here from the model's shapes, not from the code under test."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from dflop.config import Config
from dflop.costmodel.analytic import analytic_cost_model
from dflop.models.handle import ModelHandle
from dflop.plan import Layout, Plan, Techniques
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool
from dflop.pricing.pricing import Pricing
from dflop.planner.techniques import format_techniques, technique_costs
from synthetic_mix import llava_ov_mix

B = 16
F = 400e12 / 1e3  # the analytic model's default FLOPs per millisecond
OVERHEAD_MS = 0.03  # its default op overhead per layer per microbatch
NBYTES = 4  # float32


@pytest.fixture(scope="module")
def setup():
    model = ModelHandle.resolve(Config.from_dict({"model": {"arch": "llava_ov", "vision": "siglip-tiny",
                                                            "llm": "qwen2.5-tiny"}}).model)
    cost = analytic_cost_model(model.config, tp_degrees=[1, 2], dtype="float32")
    cluster = Cluster.from_section(Config.from_dict({}).cluster)
    pool = Pool.from_shapes(llava_ov_mix(64, seed=1))
    return model, cost, cluster, pool


def _table(setup, plan):
    model, cost, cluster, pool = setup
    return technique_costs(plan, cost, pool, cluster, Pricing.of(plan, cost, model, cluster).sizes, global_batch=B)


def _llm_layer(model):
    """(extra backward ms per token, per squared token, per layer per microbatch; bytes saved per token)."""
    info, text = model.info, model.config.get_text_config()
    h, inter = info.llm_hidden, text.intermediate_size
    extra_tok = 2 * info.llm_layer_params / F - 2 * h * inter / F  # rerun forward, less the down projection
    H, Hkv = text.num_attention_heads, text.num_key_value_heads
    d = h // H
    # kept without recomputation (float32, the activations closed form) less the layer input full keeps
    none = NBYTES * (6 * h + 2 * H * d + 2 * Hkv * d + 4 * inter) + 4 * (2 + H)
    return extra_tok, 2 * h / F, OVERHEAD_MS, none - NBYTES * h


def _vision_layer(model):
    """(extra backward ms per tile, per layer per microbatch; bytes saved per tile)."""
    info, vc = model.info, model.config.vision_config
    T, h, inter = info.vision_tokens_per_tile, info.vision_hidden, vc.intermediate_size
    extra = (2 * info.vision_layer_params * T + 4 * T * T * h) / F - 2 * h * inter * T / F
    none = NBYTES * (8 * h + 2 * inter) + 4 * (4 + vc.num_attention_heads)  # SigLIP, float32
    return extra, OVERHEAD_MS, T * (none - NBYTES * h)


def test_full_recompute_and_sharding_costs_follow_the_closed_forms(setup):
    model, cost, cluster, pool = setup
    info = model.info
    lay = Layout("disjoint", 1, 1, 2, 1, 2, 2, 2)  # in flight [2, 2, 1]; 16 / (2 * 2) = 4 samples a microbatch
    plan = Plan.uniform(lay, info.vision_layers, info.llm_layers).with_forced_techniques("full", shard_optimizer=True)
    t = _table(setup, plan)
    assert list(t["name"]) == ["vision stage 0", "llm stage 0", "llm stage 1"]
    nu, s = 4.0, pool.seq_len.astype(float)
    tok, sq, const, saved_tok = _llm_layer(model)
    for row, n, f in ((1, plan.llm_layers[0], 2), (2, plan.llm_layers[1], 1)):
        extra_s = n * (const + nu * (tok * s.mean() + sq * (s * s).mean())) / 1e3
        assert t["recompute_extra_s"][row] == pytest.approx(extra_s, rel=1e-9)
        assert t["activation_saved_bytes"][row] == pytest.approx(f * n * nu * s.mean() * saved_tok, rel=1e-9)
    v_extra, v_const, v_saved = _vision_layer(model)
    tiles, n_v = pool.n_tiles.astype(float).mean(), info.vision_layers
    assert t["recompute_extra_s"][0] == pytest.approx(n_v * (v_const + nu * tiles * v_extra) / 1e3, rel=1e-9)
    assert t["activation_saved_bytes"][0] == pytest.approx(2 * n_v * nu * tiles * v_saved, rel=1e-9)
    # sharded over dp 2 in float32 (4 + 4 + 8 bytes a parameter): a rank holds 4 * 1.5 + 4 + 8 / 2
    saved_per_param = 16 - (4 * 1.5 + 4 + 8 / 2)
    params = [info.vision_embed_params + n_v * info.vision_layer_params + info.projector_params,
              info.llm_embed_params + plan.llm_layers[0] * info.llm_layer_params,
              plan.llm_layers[1] * info.llm_layer_params + info.llm_head_params]
    np.testing.assert_allclose(t["state_saved_bytes"], np.array(params) * saved_per_param, rtol=1e-9)
    # the last stage's peak: sharded state + 1 microbatch of layer inputs and the head's activations
    # final RMSNorm (input, normed, rstd), the LM head's input, float32 log-softmax, int64 label;
    # + the larger transient: the head's (the loss's float32 gradients, 8 V per token, and the weight's
    # gradient) or a fully recomputed layer's (its activations again while its backward runs)
    head_tok = 3 * NBYTES * info.llm_hidden + 4 + 4 * info.vocab_size + 8
    transient = 4 * info.vocab_size * info.llm_hidden + nu * s.mean() * max(8 * info.vocab_size, saved_tok)
    peak = (params[2] * (4 * 1.5 + 4 + 8 / 2)
            + nu * s.mean() * (plan.llm_layers[1] * NBYTES * info.llm_hidden + head_tok) + transient)
    assert t["peak_bytes"][2] == pytest.approx(peak, rel=1e-9)
    assert (t["sp_saved_bytes"] == 0).all()  # no sequence parallelism, nothing to save


def test_techniques_off_cost_and_save_nothing_and_say_so(setup):
    info = setup[0].info
    plan = Plan.uniform(Layout("disjoint", 1, 1, 2, 1, 2, 2, 2), info.vision_layers, info.llm_layers)
    t = _table(setup, plan)
    cols = ["recompute_extra_s", "activation_saved_bytes", "state_saved_bytes", "sp_saved_bytes", "shard_comm_extra_s"]
    assert (t[cols] == 0).all().all()
    assert format_techniques(t) == "memory techniques: none"


def test_colocated_vision_tower_uses_the_vision_mode_on_llm_stage_0(setup):
    model, cost, cluster, pool = setup
    info = model.info
    lay = Layout("colocated", 1, 1, 2, 1, 2, 2, 4)  # in flight [2, 1]; 16 / (4 * 2) = 2 samples a bin
    plan = Plan.uniform(lay, info.vision_layers, info.llm_layers)
    plan = plan.with_techniques(Techniques(("full",)), Techniques(("none", "none")))
    t = _table(setup, plan)
    assert list(t["stage"]) == [0, 0, 1] and list(t["module"]) == ["vision", "llm", "llm"]
    assert list(t["recompute"]) == ["full", "none", "none"]
    _, _, v_saved = _vision_layer(model)
    expected = 2 * info.vision_layers * 2.0 * pool.n_tiles.mean() * v_saved
    assert t["activation_saved_bytes"][0] == pytest.approx(expected, rel=1e-9)
    assert t["activation_saved_bytes"][1] == 0 and t["recompute_extra_s"][1] == 0
    # the stage's peak counts both parts: the same number on both rows
    assert t["peak_bytes"][0] == t["peak_bytes"][1]
    solo = technique_costs(Plan(Layout("disjoint", 1, 1, 2, 1, 2, 2, 4), plan.vision_layers, plan.llm_layers),
                           cost, pool, cluster, Pricing.of(plan, cost, model, cluster).sizes, global_batch=B)
    assert t["peak_bytes"][0] > solo["peak_bytes"][1]  # more than the LLM stage 0 alone
    text = format_techniques(t)
    assert "llm stage 0: vision" in text and text.splitlines()[0].startswith("memory techniques")


def test_sequence_parallel_saving_is_the_closed_form(setup):
    model, cost, cluster, pool = setup
    info = model.info
    plan = Plan.uniform(Layout("disjoint", 1, 1, 2, 2, 2, 1, 2), info.vision_layers, info.llm_layers)
    plan = plan.with_forced_techniques(sequence_parallel=True)
    t = _table(setup, plan)
    assert list(t["sequence_parallel"]) == [False, True, True]
    assert t["sp_saved_bytes"][0] == 0
    # (1 - 1/tp) of what the two RMSNorms keep per token
    h = info.llm_hidden
    per_tok = 2 * ((4 + NBYTES) * h + 4) * (1 - 1 / 2)
    nu, s = 16 / (2 * 1), pool.seq_len.mean()
    for row, f in ((1, 2), (2, 1)):
        expected = f * plan.llm_layers[row - 1] * nu * s * per_tok
        assert t["sp_saved_bytes"][row] == pytest.approx(expected, rel=1e-9)
    assert not math.isnan(t["peak_bytes"][1])


def test_optimizer_sharding_is_only_on_modules_with_replicas(setup):
    """Sharding over one replica changes nothing (the trainer shards over a module's dp group; there
    is none), so a plan may not claim it: forcing it on a plan whose vision tower has dp 1 shards
    only the LLM, the table shows vision "no" and saves it nothing, and a plan naming it is refused."""
    model, cost, cluster, pool = setup
    info = model.info
    lay = Layout("disjoint", 1, 1, 1, 1, 2, 2, 2)  # vision dp 1, llm dp 2
    plan = Plan.uniform(lay, info.vision_layers, info.llm_layers).with_forced_techniques(shard_optimizer=True)
    assert not plan.vision_techniques.shard_optimizer and plan.llm_techniques.shard_optimizer
    table = _table(setup, plan)
    assert list(table["shard_optimizer"]) == [False, True, True]
    assert table["state_saved_bytes"].iloc[0] == 0 and (table["state_saved_bytes"].iloc[1:] > 0).all()
    shown = [re.split(r"\s{2,}", row.strip()) for row in format_techniques(table).splitlines()[2:]]
    assert [row[2] for row in shown] == ["no", "yes", "yes"]  # stage, recompute, shard opt, ...
    with pytest.raises(ValueError, match="vision optimizer sharding needs data-parallel replicas"):
        plan.with_techniques(Techniques(("none",), shard_optimizer=True), plan.llm_techniques)
