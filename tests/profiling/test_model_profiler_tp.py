"""TP=2 profile: torchrun-launched gloo workers, each holding half of the heads and MLP."""

from __future__ import annotations

import pytest
import torch

from dflop.costmodel import activations
from dflop.models.builder import model_config
from dflop.models.info import model_info
from dflop.profiling.model_modules import MODULES
from dflop.profiling.columns import LINK_MODULES
from dflop.profiling.step_costs import link_sizes
from profiling_testlib import profile


@pytest.mark.distributed
def test_tp2_profile_under_torchrun_holds_half_of_each_split_module(tmp_path):
    arch, vision, llm = "llava_ov", "siglip-tiny", "qwen2.5-tiny"
    # min_measure_ms=0: each shape runs `repeats` times (the default 50 ms repeats a tiny module's shape up
    # to 40 times for a steady median); what this test checks is bytes and which rows exist, not times
    table = profile(arch, vision, llm, tmp_path / "model_profile.parquet", tp_degrees=[1, 2], max_tiles=4,
                    max_seq_len=128, repeats=2, warmup=1, min_measure_ms=0.0, time_budget_s=5.0)
    assert set(table["tp"]) == {1, 2}
    links = table[table.module.isin(LINK_MODULES)]
    assert set(links["tp"]) == {2} and set(links["batch"]) == {2}  # only the 2-rank run measures links
    table = table[table.module.isin(MODULES)]
    tp2 = table[table.tp == 2]
    assert set(tp2["module"]) == set(table[table.tp == 1]["module"])
    assert set(tp2["threads"]) == {1}  # one torch thread per rank on CPU

    # Reference: closed form from the full model's part sizes; replicated tensors stay whole.
    info = model_info(arch, vision, llm)
    d, dv, vocab = info.llm_hidden, info.vision_hidden, info.vocab_size
    replicated_llm_layer = 2 * d  # two RMSNorm weights
    replicated_vision_layer = 6 * dv  # two LayerNorms (weight + bias) + biases of out_proj and fc2
    projector = info.projector_params - d  # without LLaVA-OV's image_newline
    expected = {
        "llm_layer": (info.llm_layer_params - replicated_llm_layer) // 2 + replicated_llm_layer,
        "vision_layer": (info.vision_layer_params - replicated_vision_layer) // 2 + replicated_vision_layer,
        "projector": (projector - d) // 2 + d,  # linear_2's bias is added once, after the all-reduce
        "llm_embed": vocab * d // 2,
        "llm_head": d + vocab * d // 2,
        "vision_embed": info.vision_embed_params,  # replicated
        "llm_attention": 0,
    }
    got = tp2.groupby("module")["param_bytes"].unique()
    for module, params in expected.items():
        assert list(got[module]) == [4 * params], module

    # Attention keeps per-head tensors only: half the heads, exactly half the saved bytes.
    attention = table[table.module == "llm_attention"].groupby(["tp", "batch", "seq_len"])["act_bytes"].first()
    shared = attention.loc[1].index.intersection(attention.loc[2].index)
    assert len(shared) > 3
    assert (attention.loc[2][shared] * 2 == attention.loc[1][shared]).all()
    # The vocabulary-parallel loss keeps only its half of the [T, V] softmax.
    head = table[table.module == "llm_head"].groupby(["tp", "batch", "seq_len"])["act_bytes"].first()
    largest = head.loc[1].index.intersection(head.loc[2].index).max()
    assert head.loc[2][largest] < 0.6 * head.loc[1][largest]
    # Each rank's bytes kept under recompute (and without): the closed form at tp=2 (split heads and MLP,
    # replicated norms, residuals and a fully recomputed layer's input).
    config = model_config(arch, vision, llm)
    for r in tp2[(tp2.module == "vision_layer") & (tp2.repeat == 0)].itertuples():
        for mode, column in (("none", "act_bytes"), ("selective", "act_bytes:selective"), ("full", "act_bytes:full")):
            assert tp2.loc[r.Index, column] == activations.vision_stage_layer_bytes(config, r.batch, 1, mode, "float32",
                                                                                     tp=2), (mode, r.batch)
    for r in tp2[(tp2.module == "llm_layer") & (tp2.repeat == 0)].itertuples():
        for mode, column in (("none", "act_bytes"), ("selective", "act_bytes:selective"), ("full", "act_bytes:full")):
            expected = activations.llm_stage_layer_bytes(config.text_config, [r.seq_len] * r.batch, 1, mode, "float32",
                                                         tp=2)
            assert tp2.loc[r.Index, column] == expected, (mode, r.batch, r.seq_len)
    assert tp2.loc[tp2.module == "llm_layer", "bwd_ms:full"].notna().any()


@pytest.mark.distributed
def test_co_runners_time_whole_modules_on_a_loaded_machine(tmp_path):
    """Two co-running TP=1 ranks: rank 0's rows, each module whole (not split as TP=2 would), and the
    bytes those of a profile taken alone."""
    arch, vision, llm = "llava_ov", "siglip-tiny", "qwen2.5-tiny"
    grid = dict(tp_degrees=[1], max_tiles=2, max_seq_len=64, repeats=1, warmup=0, min_measure_ms=0.0,
                time_budget_s=2.0)
    together = profile(arch, vision, llm, tmp_path / "together.parquet", co_runners=2, **grid)
    alone = profile(arch, vision, llm, tmp_path / "alone.parquet", **grid)
    assert set(together["co_runners"]) == {2} and set(alone["co_runners"]) == {1}
    # Two ranks also measure the links, at every size of the sweep (4 KiB to 16 MiB by 4x on CPU);
    # alone there is nothing to measure them with.
    links = together[together.module.isin(LINK_MODULES)]
    assert sorted(links["bytes"].unique()) == [4096 * 4**k for k in range(7)] == link_sizes(torch.device("cpu"))
    assert set(links["batch"]) == {2} and (links["fwd_ms"] > 0).all()
    assert not alone["module"].isin(LINK_MODULES).any()
    together = together[together.module.isin(MODULES)].astype({"batch": int, "seq_len": int, "act_bytes": int})
    # every module with parameters timed its optimizer step; attention has none to step
    optim = together.groupby("module")["optim_ms"].unique()
    assert list(optim["llm_attention"]) == [0.0]
    assert all(len(v) == 1 and v[0] > 0 for m, v in optim.items() if m != "llm_attention")
    assert set(together["tp"]) == {1} and set(together["threads"]) == {1}
    info = model_info(arch, vision, llm)
    params = together.groupby("module")["param_bytes"].unique()
    assert list(params["llm_layer"]) == [4 * info.llm_layer_params]
    assert list(params["vision_layer"]) == [4 * info.vision_layer_params]
    keys = ["module", "batch", "seq_len"]
    bytes_together = together.groupby(keys)[["act_bytes", "param_bytes"]].first()
    bytes_alone = alone.groupby(keys)[["act_bytes", "param_bytes"]].first()
    shared = bytes_together.index.intersection(bytes_alone.index)
    assert len(shared) >= 7  # every module at its first shapes at least
    assert (bytes_together.loc[shared].to_numpy() == bytes_alone.loc[shared].to_numpy()).all()
