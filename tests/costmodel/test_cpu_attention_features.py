"""The CPU flash-attention work features: checked against a literal transcription of the kernel's
loops, then that fits of CPU profiles use them and that such models survive the JSON round trip."""

import json

import numpy as np
import pytest

from dflop.costmodel.features import (
    CPU_KERNEL_FEATURES,
    MODULE_FEATURES,
    ShapeKind,
    allowed_features,
    cpu_attention_work,
    module_features,
    profile_features,
    sample_features,
)
from dflop.costmodel.fit import fit_profile
from dflop.costmodel.jsonio import cost_model_to_dict
from dflop.costmodel.profile_table import summarize_profile
from dflop.costmodel.synthetic import synthetic_profile
from dflop.errors import UserError
from dflop.costmodel.jsonio import load_cost_model, save_cost_model


def kernel_loops(length: int) -> tuple[int, int]:
    """(pairs, key blocks) by walking the loops of PyTorch's cpu_flash_attention(_backward), causal:
    for each query block, key blocks of 512 from 0 while n < min(m + qBlockSize, kvSize), each
    min(512, kvSize - n) wide."""
    q_split = 256 if length >= 768 else 64 if length >= 192 else 32
    q_split, kv_split = min(q_split, length), min(512, length)
    pairs = blocks = 0
    for m in range(0, length, q_split):
        q_block = min(q_split, length - m)
        num_keys = min(m + q_block, length)
        for n in range(0, num_keys, kv_split):
            pairs += q_block * min(kv_split, length - n)
            blocks += 1
    return pairs, blocks


LENGTHS = [1, 2, 31, 32, 33, 100, 191, 192, 193, 255, 256, 511, 512, 513, 700, 767, 768, 769, 1000, 1024,
           1500, 2048, 2049, 4096, 5000]


def test_work_matches_the_kernel_loops():
    lengths = sorted(set(LENGTHS) | set(range(1, 2600)))  # every length through all three block sizes
    pairs, blocks = cpu_attention_work(np.array(lengths))
    expected = np.array([kernel_loops(L) for L in lengths], dtype=np.float64)
    np.testing.assert_array_equal(pairs, expected[:, 0])
    np.testing.assert_array_equal(blocks, expected[:, 1])


def test_work_in_closed_form_where_it_has_one():
    # Up to one key block (L <= 512) every query block sees all L keys: L**2 pairs, not L**2 / 2.
    for L in (1, 100, 512):
        assert cpu_attention_work(np.array([L]))[0][0] == L * L
    # L = 1024: query blocks of 256 see 1, 1, 2, 2 key blocks of 512.
    pairs, blocks = cpu_attention_work(np.array([1024]))
    assert pairs[0] == 256 * (512 + 512 + 1024 + 1024) and blocks[0] == 6
    # Zero-length samples (padding) cost nothing; repeated lengths give repeated values.
    pairs, blocks = cpu_attention_work(np.array([0, 700, 700]))
    assert pairs[0] == blocks[0] == 0 and pairs[1] == pairs[2] > 0


def test_cpu_profiles_get_the_kernel_features_and_gpus_the_smooth_ones():
    for module, features in CPU_KERNEL_FEATURES.items():
        assert module_features(module, "cpu") == features
        assert module_features(module, "NVIDIA H100 80GB HBM3") == MODULE_FEATURES[module][1]
        assert allowed_features(module) == (MODULE_FEATURES[module][1], features)
    assert module_features("vision_layer", "cpu") == MODULE_FEATURES["vision_layer"][1]
    with pytest.raises(UserError, match="unknown module 'mlp'"):
        module_features("mlp", "cpu")


def test_a_packed_row_is_the_sum_of_its_samples():
    features = CPU_KERNEL_FEATURES["llm_attention"]
    row = profile_features(features, np.array([4]), np.array([900]))[0]
    per_sample = sample_features(features, ShapeKind.TOKENS, np.full(4, 900)).sum(axis=0)
    const = np.array([f == "const" for f in features], dtype=np.float64)
    np.testing.assert_array_equal(row, per_sample + const)


def _cpu_profile(coef):
    """A CPU profile whose llm_layer and llm_attention times are exactly
    coef @ (tokens, kernel pairs, kernel blocks, const) per row (backward: twice that)."""
    profile = synthetic_profile(modules=("llm_layer", "llm_attention", "llm_embed"), llm_batches=(1, 3),
                                llm_seq_lens=(64, 200, 512, 800, 1024, 1700, 2048), device="cpu")
    rows = profile["module"].isin(["llm_layer", "llm_attention"])
    b = profile.loc[rows, "batch"].to_numpy()
    s = profile.loc[rows, "seq_len"].to_numpy()
    work = np.array([kernel_loops(int(L)) for L in s], dtype=np.float64)
    X = np.stack([b * s, b * work[:, 0], b * work[:, 1], np.ones(len(b))], axis=1)
    profile.loc[rows, "fwd_ms"] = X @ np.asarray(coef)
    profile.loc[rows, "bwd_ms"] = 2 * X @ np.asarray(coef)
    return profile


COEF = (1e-4, 2e-7, 1e-3, 0.05)  # ms per token, per pair, per block, per call


def test_fit_of_a_cpu_profile_recovers_the_kernel_coefficients():
    model, validation = fit_profile(summarize_profile(_cpu_profile(COEF)))
    attention = model.modules[("llm_attention", 1)]
    assert attention.features == CPU_KERNEL_FEATURES["llm_attention"]
    np.testing.assert_allclose(attention.coefficients("fwd_ms"), COEF, rtol=1e-6)
    assert model.modules[("llm_embed", 1)].features == MODULE_FEATURES["llm_embed"][1]
    held_out = validation[validation.module.isin(["llm_layer", "llm_attention"]) & (validation.target == "fwd_ms")]
    assert held_out["mape_max"].max() < 1e-6
    # A stage of 2 layers on a bin of 700 + 900 tokens: each sample's kernel work, summed.
    stage = model.llm_stage_time([700, 900], n_layers=2, first=False, last=False, tp=1)
    per_sample = [COEF[0] * L + COEF[1] * kernel_loops(L)[0] + COEF[2] * kernel_loops(L)[1] for L in (700, 900)]
    assert stage.fwd_s == pytest.approx(2 * (sum(per_sample) + COEF[3]) / 1e3, rel=1e-6)


def test_cpu_features_survive_the_json_round_trip_and_bad_lists_are_named(tmp_path):
    model, _ = fit_profile(summarize_profile(_cpu_profile(COEF)))
    path = tmp_path / "costmodel.json"
    save_cost_model(model, path)
    loaded = load_cost_model(path)
    assert loaded.modules[("llm_attention", 1)].features == CPU_KERNEL_FEATURES["llm_attention"]
    data = cost_model_to_dict(model)
    entry = next(i for i, m in enumerate(data["modules"]) if m["module"] == "llm_attention")
    data["modules"][entry]["features"] = ["tokens", "cpu_attn_pairs", "const"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=rf"modules/{entry} \(llm_attention\) has features .* expected .* or .*cpu_attn_pairs"):
        load_cost_model(tmp_path / "bad.json")


def test_packed_cpu_attention_runs_the_kernel_these_features_count():
    """The features assume SDPA picks the CPU flash kernel for our packed calls (causal, no mask,
    grouped-query heads), one sample per call or equal-length samples batched (as the profiler
    runs them): a torch upgrade that changes that choice fails here. (One that changed the
    kernel's block sizes would not; the held-out error of bench_costmodel.py would show it.)"""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dflop.models.packing import PackedSequence, _sdpa

    for lengths in ([100, 200], [150, 150]):  # per-sample calls; one batched call
        q = torch.randn(1, 4, 300, 16, requires_grad=True)
        k, v = (torch.randn(1, 2, 300, 16, requires_grad=True) for _ in range(2))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _sdpa(q, k, v, PackedSequence.from_lengths(lengths), True, None, 0.0).sum().backward()
        ops = {event.key for event in prof.key_averages()}
        assert {"aten::_scaled_dot_product_flash_attention_for_cpu",
                "aten::_scaled_dot_product_flash_attention_for_cpu_backward"} <= ops, lengths
