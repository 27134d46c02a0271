"""The model profiler writes the DESIGN.md §4 table with exact parameter and activation bytes."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from dflop.errors import UserError
from dflop.models.builder import model_config
from dflop.models.info import model_info
from dflop.profiling.model_profiler import COLUMNS, modules_for_tp, profile_model, summarize

CONTRACT = ["module", "tp", "batch", "seq_len", "n_layers", "fwd_ms", "bwd_ms", "act_bytes", "param_bytes",
            "peak_bytes", "device", "dtype", "repeat"]
SMALL_GRID = dict(max_tiles=4, max_seq_len=128, min_seq_len=16, repeats=2, warmup=1, time_budget_s=5.0,
                  progress=False)


@pytest.fixture(scope="module", params=[("llava_ov", "siglip-tiny", "qwen2.5-tiny"),
                                        ("internvl", "internvit-tiny", "llama3-tiny")], ids=["llava_ov", "internvl"])
def profiled(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "model_profile.parquet"
    threads = torch.get_num_threads()
    table = profile_model(*request.param, out, tp_degrees=(1,), **SMALL_GRID)  # measures on 1 thread
    assert torch.get_num_threads() == threads  # and gives the caller its threads back
    return request.param, out, table


def test_table_has_the_contract_columns_and_one_row_per_repeat(profiled):
    _, out, table = profiled
    assert list(table.columns[:len(CONTRACT)]) == CONTRACT and list(table.columns) == list(COLUMNS)
    pd.testing.assert_frame_equal(pd.read_parquet(out), table)
    assert not [p for p in out.parent.iterdir() if p.name != out.name]  # no temp files left behind
    assert set(table["module"]) == {"vision_embed", "vision_layer", "projector", "llm_embed", "llm_layer",
                                    "llm_attention", "llm_head"}
    per_shape = table.groupby(["module", "tp", "batch", "seq_len"])["repeat"].agg(sorted)
    assert all(r == [0, 1] for r in per_shape)
    assert (table["fwd_ms"] > 0).all() and (table["bwd_ms"] > 0).all()
    assert table["peak_bytes"].isna().all() and set(table["device"]) == {"cpu"}
    assert set(table["dtype"]) == {"float32"} and set(table["tp"]) == {1}
    layers = table["module"].isin(["vision_layer", "llm_layer", "llm_attention"])
    assert (table.loc[layers, "n_layers"] == 1).all() and (table.loc[~layers, "n_layers"] == 0).all()


def test_shape_grid_covers_tiles_and_packed_lengths(profiled):
    (arch, vision, llm), _, table = profiled
    config = model_config(arch, vision, llm)
    tiles = table[table.module == "vision_layer"]
    assert set(tiles["batch"]) >= {1, 2, 4}
    assert set(tiles["seq_len"]) == {model_info(arch, vision, llm).vision_tokens_per_tile}
    layer = table[table.module == "llm_layer"]
    assert set(layer["batch"]) >= {1, 4}  # rows packing several samples, for the per-sample attention term
    assert (layer["batch"] * layer["seq_len"]).max() <= 128 and layer["seq_len"].min() == 16
    assert config.text_config.num_hidden_layers >= 1


def test_parameter_bytes_match_the_full_transformers_model(profiled):
    """Reference: parts of the full transformers model (counted by model_info), float32."""
    (arch, vision, llm), _, table = profiled
    info = model_info(arch, vision, llm)
    got = table.groupby("module")["param_bytes"].unique()
    newline = info.llm_hidden if arch == "llava_ov" else 0  # LLaVA-OV's image_newline is not in the MLP
    expected = {
        "vision_embed": info.vision_embed_params,
        "vision_layer": info.vision_layer_params,
        "projector": info.projector_params - newline,
        "llm_embed": info.llm_embed_params,
        "llm_layer": info.llm_layer_params,
        "llm_attention": 0,
        "llm_head": info.llm_head_params,
    }
    for module, params in expected.items():
        assert list(got[module]) == [4 * params], module
    grads = table.groupby("module")[["param_bytes", "grad_bytes", "optim_bytes"]].first()
    assert (grads["grad_bytes"] == grads["param_bytes"]).all()
    assert (grads["optim_bytes"] == 2 * grads["param_bytes"]).all()  # Adam: two fp32 moments


def test_activation_bytes_scale_exactly_with_tokens(profiled):
    """Every saved tensor of a layer is per token (attention inside samples keeps no T x T matrix)."""
    _, _, table = profiled
    for module in ("llm_layer", "llm_attention", "vision_layer", "projector"):
        rows = table[table.module == module]
        per_unit = rows["act_bytes"] / (rows["batch"] * rows["seq_len"])
        assert per_unit.nunique() == 1, module
        assert per_unit.iloc[0] > 0


def test_summary_names_every_module(profiled):
    _, _, table = profiled
    text = summarize(table)
    for module in set(table["module"]):
        assert module in text


def test_modules_for_tp_follow_divisibility():
    config = model_config("internvl", "internvit-6b", "qwen2.5-7b")  # 25 vision heads, 28/4 LLM heads
    assert modules_for_tp(config, 2) == ("projector", "llm_embed", "llm_layer", "llm_attention", "llm_head")
    assert modules_for_tp(config, 5) == ("vision_embed", "vision_layer")
    assert modules_for_tp(config, 3) == ()
    assert len(modules_for_tp(config, 1)) == 7


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="profile.device must be 'cpu' or 'cuda'"):
        profile_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", tmp_path / "p.parquet", device="tpu")
    with pytest.raises(UserError, match="profile.max_seq_len"):
        profile_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", tmp_path / "p.parquet", max_seq_len=8)
    with pytest.raises(UserError, match="no degree divides"):
        profile_model("internvl", "internvit-6b", "qwen2.5-7b", tmp_path / "p.parquet", tp_degrees=(3,))
    assert not (tmp_path / "p.parquet").exists()
