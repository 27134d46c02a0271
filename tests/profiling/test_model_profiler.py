"""The model profiler writes the docs/design.md table with exact parameter and activation bytes."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from dflop.costmodel import activations
from dflop.errors import UserError
from dflop.models.builder import model_config
from dflop.models.info import model_info
from dflop.profiling import model_profiler
from dflop.profiling.model_grid import AdaptiveCurve
from dflop.config import ConfigError
from dflop.profiling.model_profiler import COLUMNS, modules_for_tp, summarize
from profiling_testlib import SMALL_GRID, profile

CONTRACT = ["module", "tp", "batch", "seq_len", "n_layers", "fwd_ms", "bwd_ms", "act_bytes", "param_bytes",
            "peak_bytes", "device", "dtype", "repeat"]


@pytest.fixture(scope="module", params=[("llava_ov", "siglip-tiny", "qwen2.5-tiny"),
                                        ("internvl", "internvit-tiny", "llama3-tiny")], ids=["llava_ov", "internvl"])
def profiled(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "model_profile.parquet"
    threads = torch.get_num_threads()
    table = profile(*request.param, out, tp_degrees=[1], **SMALL_GRID)  # measures on 1 thread
    assert torch.get_num_threads() == threads  # and gives the caller its threads back
    return request.param, out, table


def test_table_has_the_contract_columns_and_one_row_per_repeat(profiled):
    _, out, table = profiled
    assert list(table.columns[:len(CONTRACT)]) == CONTRACT and list(table.columns) == list(COLUMNS)
    pd.testing.assert_frame_equal(pd.read_parquet(out), table)
    assert not [p for p in out.parent.iterdir() if p.name != out.name]  # no temp files left behind
    assert set(table["module"]) == {"vision_embed", "vision_layer", "projector", "llm_embed", "llm_layer",
                                    "llm_attention", "llm_head"}
    for shape, runs in table.groupby(["module", "tp", "batch", "seq_len"]):
        # 2 repeats, or as many as make 40 ms at the first run's pace, at most 4.
        first = runs[runs["repeat"] == 0].iloc[0]
        wanted = max(2, min(4, math.ceil(40.0 / (first["fwd_ms"] + first["bwd_ms"]))))
        assert sorted(runs["repeat"]) == list(range(wanted)), shape
    assert (table["fwd_ms"] > 0).all() and (table["bwd_ms"] > 0).all()
    for module in ("vision_embed", "vision_layer", "projector"):  # tile grid of ratio sqrt 2 up to 4
        assert sorted(table.loc[table["module"] == module, "batch"].unique()) == [1, 2, 3, 4], module
    assert table["peak_bytes"].isna().all() and set(table["device"]) == {"cpu"}
    assert set(table["dtype"]) == {"float32"} and set(table["tp"]) == {1}
    layers = table["module"].isin(["vision_layer", "llm_layer", "llm_attention"])
    assert (table.loc[layers, "n_layers"] == 1).all() and (table.loc[~layers, "n_layers"] == 0).all()
    # Recompute columns: the layer modules a stage checkpoints have them, the others NaN; each mode
    # is timed min(count, max(2, ceil(0.25 count))) = 2 times here (2 to 4 runs of mode none).
    recomputed = table["module"].isin(["vision_layer", "llm_layer"])
    for column in ("bwd_ms:selective", "act_bytes:selective", "transient_bytes:selective", "bwd_ms:full",
                   "act_bytes:full", "transient_bytes:full"):
        assert table.loc[~recomputed, column].isna().all() and table.loc[recomputed, column].notna().any(), column
    # Transient bytes: every module's, measured once per shape, on CPU as on any device.
    assert (table["transient_bytes"] >= 0).all()
    assert (table.groupby(["module", "batch", "seq_len"])["transient_bytes"].nunique() == 1).all()
    for shape, runs in table[recomputed].groupby(["module", "batch", "seq_len"]):
        for mode in ("selective", "full"):
            assert sorted(runs.loc[runs[f"bwd_ms:{mode}"].notna(), "repeat"]) == [0, 1], (shape, mode)
            assert (runs[f"bwd_ms:{mode}"].dropna() > 0).all()
            assert runs[f"act_bytes:{mode}"].nunique() == 1 and runs[f"transient_bytes:{mode}"].nunique() == 1


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


def test_recompute_activation_bytes_match_the_closed_form(profiled):
    """Reference: `dflop.costmodel.activations`, read off the transformers layers' code (widths,
    heads and dtype of the config only): what one layer of a stage in each mode keeps, plus what
    its stage keeps once (rotary cos/sin; position ids and cu_seqlens as checkpoint inputs)."""
    (arch, vision, llm), _, table = profiled
    config = model_config(arch, vision, llm)
    columns = {"none": "act_bytes", "selective": "act_bytes:selective", "full": "act_bytes:full"}
    shapes = table[table["repeat"] == 0]
    for mode, column in columns.items():
        for r in shapes[shapes.module == "vision_layer"].itertuples():
            expected = activations.vision_stage_layer_bytes(config, r.batch, 1, mode, "float32")
            assert shapes.loc[r.Index, column] == pytest.approx(expected, rel=1e-9), (mode, r.batch)
        for r in shapes[shapes.module == "llm_layer"].itertuples():
            expected = activations.llm_stage_layer_bytes(config.text_config, [r.seq_len] * r.batch, 1, mode, "float32")
            assert shapes.loc[r.Index, column] == pytest.approx(expected, rel=1e-9), (mode, r.batch, r.seq_len)


def test_summary_names_every_module(profiled):
    _, _, table = profiled
    text = summarize(table)
    for module in set(table["module"]):
        assert module in text


def test_modules_for_tp_follow_divisibility():
    # 25 vision heads (padded with zero heads: 26 at tp 2), MLP 12800; 28/4 LLM heads, width 3584
    config = model_config("internvl", "internvit-6b", "qwen2.5-7b")
    assert modules_for_tp(config, 2) == ("vision_embed", "vision_layer", "projector", "llm_embed", "llm_layer",
                                         "llm_attention", "llm_head")
    assert modules_for_tp(config, 5) == ("vision_embed", "vision_layer")  # 3584 / 5: no projector, no LLM
    assert modules_for_tp(config, 8) == ("vision_embed", "vision_layer", "projector")  # 28 heads / 8: no LLM
    assert modules_for_tp(config, 3) == ()
    assert len(modules_for_tp(config, 1)) == 7


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="profile.device: 'tpu' is not one of"):
        profile("llava_ov", "siglip-tiny", "qwen2.5-tiny", tmp_path / "p.parquet", device="tpu")
    with pytest.raises(ConfigError, match="profile.max_seq_len: 8 is less than the minimum"):
        profile("llava_ov", "siglip-tiny", "qwen2.5-tiny", tmp_path / "p.parquet", max_seq_len=8)
    with pytest.raises(UserError, match="profile.max_seq_len"):
        profile("llava_ov", "siglip-tiny", "qwen2.5-tiny", tmp_path / "p.parquet", max_seq_len=16, min_seq_len=32)
    with pytest.raises(UserError, match=r"profile.max_repeats \(3\) must be >= repeats \(5\)"):
        profile("llava_ov", "siglip-tiny", "qwen2.5-tiny", tmp_path / "p.parquet", max_repeats=3)
    with pytest.raises(UserError, match="no degree divides"):
        profile("internvl", "internvit-6b", "qwen2.5-7b", tmp_path / "p.parquet", tp_degrees=[3])
    assert not (tmp_path / "p.parquet").exists()


def _measure_logged_round(names: str, settings, ticks: bool = False) -> tuple[list[str], list]:
    """Run `_measure_round` over one tiny shape per name; returns the forward calls in order
    (one name per run, untimed runs included; with `ticks`, "|" for each progress tick) and the shapes."""
    from dflop.profiling._timing import Timer
    from dflop.profiling.model_modules import ModuleBench
    from dflop.profiling.model_profiler import _measure_round, _RankSync, _Shape

    calls = []
    layer = torch.nn.Linear(4, 4)

    def bench(name):
        def forward(x):
            calls.append(name)
            return layer(x).sum()
        return ModuleBench(name, layer, lambda b, s: (torch.randn(b, s, 4, requires_grad=True),), forward)

    shapes = [_Shape(bench(n), None, 1, 1, 8) for n in names]
    _measure_round(shapes, settings, _RankSync(torch.device("cpu")), Timer(torch.device("cpu")),
                   **({"tick": lambda: calls.append("|")} if ticks else {}))
    return calls, shapes


@pytest.mark.parametrize("repeats, expected", [(3, "AA|BB|CC|" + "A|B|C|" * 2), (1, "AA|BB|CC|" + "|||")])
def test_a_round_ticks_once_per_shape_and_pass_as_its_progress_total_says(repeats, expected):
    """The round's progress total, shapes x passes, is known before it starts and met exactly,
    each tick after its shape's runs of the pass (with one repeat the second pass is empty)."""
    from dflop.profiling.model_profiler import ProfileSettings, _round_passes

    settings = ProfileSettings(repeats=repeats, warmup=1, min_measure_ms=0.0, max_repeats=repeats)
    calls, _ = _measure_logged_round("ABC", settings, ticks=True)
    assert "".join(calls) == expected
    assert _round_passes(settings) * 3 == expected.count("|")


def test_a_rounds_repeats_are_interleaved_across_its_shapes():
    """Repeats are spread over passes through all of a round's shapes (a slow phase of the
    machine then hits one repeat of many shapes, not every repeat of one): with 3 repeats the
    timed runs go A B C, A B C, A B C; with min_measure_ms 0 no shape is light, so only the first
    pass has untimed warm-up runs."""
    from dflop.profiling.model_profiler import ProfileSettings

    settings = ProfileSettings(repeats=3, warmup=2, min_measure_ms=0.0, max_repeats=3)
    calls, shapes = _measure_logged_round("ABC", settings)
    untimed_then_timed = "AAABBBCCC" + "ABC" * 2
    assert "".join(calls) == untimed_then_timed
    assert [len(s.timed) for s in shapes] == [3, 3, 3]
    assert all(s.act_bytes == 8 * 4 * 4 for s in shapes)  # the Linear saves its input


def test_light_shapes_are_warmed_up_again_in_every_pass():
    """A shape faster than min_measure_ms gets one untimed run before its runs of each later pass
    (the first run on returning to it is the cold one); extra runs come back to back."""
    from dflop.profiling.model_profiler import ProfileSettings

    settings = ProfileSettings(repeats=3, warmup=1, min_measure_ms=1e6, max_repeats=5)
    calls, shapes = _measure_logged_round("AB", settings)
    # pass 0: warm-up + 1 timed; passes 1-2: 1 untimed + 2 timed each (4 more timed runs per shape)
    assert "".join(calls) == "AABB" + "AAABBB" * 2
    assert [len(s.timed) for s in shapes] == [5, 5]


class _AlwaysBentCurve(AdaptiveCurve):
    """A curve that wants every coarse interval refined, whatever was measured."""

    def _bent_coarse_intervals(self):
        return [(a, b) for a, b in zip(self.coarse, self.coarse[1:]) if self._splittable(a, b)]


def test_spent_time_budget_stops_refinement_after_the_coarse_round(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(model_profiler, "AdaptiveCurve", _AlwaysBentCurve)
    settings = dict(SMALL_GRID, time_budget_s=1e-6)
    with caplog.at_level("INFO", logger="dflop.profiling.model_profiler"):
        table = profile("llava_ov", "siglip-tiny", "qwen2.5-tiny", tmp_path / "p.parquet", tp_degrees=[1],
                        **settings)
    assert set(table["round"]) == {0}
    assert "time budget of 0 s spent; refinement stopped before round 1" in caplog.text
    assert (table.groupby(["module", "batch", "seq_len"]).size() >= 2).all()  # coarse shapes are complete


def test_recompute_modes_run_after_each_pass_of_mode_none():
    """A layer bench's modes get one untimed run in pass 0 that measures its bytes and one timed run,
    and the rest of their runs (a quarter of mode none's, at least 2) in later passes, each right after
    the shape's mode-none runs, and leave the bench in mode none."""
    from dflop.profiling._timing import Timer
    from dflop.profiling.model_modules import ModuleBench
    from dflop.profiling.model_profiler import ProfileSettings, _measure_round, _RankSync, _Shape

    calls, state = [], {"mode": "none"}
    layer = torch.nn.Linear(4, 4)

    def recompute(mode):
        state["mode"] = mode
        return forward

    def forward(x):
        calls.append(state["mode"][0])
        return layer(x).sum()

    bench = ModuleBench("vision_layer", layer, lambda b, s: (torch.randn(b, s, 4, requires_grad=True),), forward,
                        recompute)
    shape = _Shape(bench, None, 1, 1, 8)
    settings = ProfileSettings(repeats=3, warmup=1, min_measure_ms=0.0, max_repeats=8, recompute_share=0.25)
    cpu = torch.device("cpu")
    _measure_round([shape], settings, _RankSync(cpu), Timer(cpu))
    assert "".join(calls) == "nnssff" + "nsf" + "n"  # 3 runs of none; 2 timed of each mode, 1 measuring
    assert state["mode"] == "none"
    assert [len(shape.recompute_timed[m]) for m in ("selective", "full")] == [2, 2]
    assert shape.act_bytes == 8 * 4 * 4 and shape.recompute_act_bytes == {"selective": 128, "full": 128}
    assert shape.transient_bytes > 0 and set(shape.recompute_transient_bytes) == {"selective", "full"}
    row = shape.recompute_columns(1)
    assert row["bwd_ms:full"] == shape.recompute_timed["full"][1]["bwd_ms"] and row["act_bytes:full"] == 128
    assert math.isnan(shape.recompute_columns(2)["bwd_ms:selective"])  # mode none's third run has no partner


def test_a_stage_holding_the_whole_llm_prices_its_distinct_parameters(profiled):
    """Reference: the distinct parameters of the transformers model's language model and LM head (a
    tied head is the embedding: one tensor). The cost model fitted on the profile prices an LLM
    stage holding every layer, the embedding and the head at exactly those bytes, and the two
    stages of a split at the embedding's copy more (pipelines replicate a tied table)."""
    from dflop.costmodel.fit import fit_profile
    from dflop.costmodel.profile_table import read_profile
    from dflop.models.builder import build_model

    (arch, vision, llm), out, table = profiled
    model = build_model(arch, vision, llm)
    distinct = {id(p): p.numel() for p in [*model.model.language_model.parameters(), *model.lm_head.parameters()]}
    tied = model.lm_head.weight is model.model.language_model.embed_tokens.weight
    head = table[table["module"] == "llm_head"]["tied_bytes"].unique().tolist()
    assert head == [4 * model.lm_head.weight.numel() if tied else 0]
    cost, _ = fit_profile(read_profile(out))
    layers = model.config.get_text_config().num_hidden_layers

    def param_bytes(n, first, last):
        return cost.llm_stage_memory([16], n_layers=n, first=first, last=last, tp=1, in_flight=1).param_bytes

    assert param_bytes(layers, True, True) == 4 * sum(distinct.values())
    split = param_bytes(1, True, False) + param_bytes(layers - 1, False, True)
    assert split == 4 * sum(distinct.values()) + (4 * model.lm_head.weight.numel() if tied else 0)


def test_the_optimizer_is_measured_per_module_and_per_call(profiled):
    """Every module with parameters gets its own optimizer step (`ModuleCosts.optimizer_s`) and the
    profile the one-element step, so a stage is priced as one call plus its modules' steps."""
    from dflop.costmodel.fit import fit_profile
    from dflop.costmodel.profile_table import read_profile

    _, out, table = profiled
    assert table["optim_call_ms"].nunique() == 1 and float(table["optim_call_ms"].iloc[0]) > 0
    cost, _ = fit_profile(read_profile(out))
    assert cost.step_costs.optimizer_call_s == pytest.approx(float(table["optim_call_ms"].iloc[0]) * 1e-3)
    for (module, _), m in cost.modules.items():  # a module without parameters steps nothing
        assert m.optimizer_s is not None and (m.optimizer_s >= 0 if m.param_bytes > 0 else m.optimizer_s == 0), module
