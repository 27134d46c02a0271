"""The per-sample load line (loader cost on the host): its fit, its JSON round trip, and where the one
pricing path charges it, each against a hand computation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dflop.costmodel.fit import fit_load_line
from dflop.costmodel.jsonio import cost_model_from_dict, cost_model_to_dict, load_cost_model, save_cost_model
from dflop.costmodel.model import BytesLine, CostModel, LoadLine, StepCosts
from dflop.errors import UserError
from dflop.plan import Layout
from dflop.pricing.pool import Pool
from planner_testlib import toy_cost_model, toy_shapes
from test_step_costs import _pricing

LINE = LoadLine((1e-3, 4e-4, 2.5e-3, 3e-3, 1e-6, 2e-8), n_samples=64)


def _with_pixels(shapes: pd.DataFrame) -> pd.DataFrame:
    """toy_shapes with media_pixels: images of 0.1-8 Mpx, video frames of 0.02-0.3 Mpx (seeded)."""
    rng = np.random.default_rng(len(shapes))
    return shapes.assign(media_pixels=shapes["n_images"] * rng.integers(100_000, 8_000_000, len(shapes))
                         + shapes["n_frames"] * rng.integers(20_000, 300_000, len(shapes)))


def _by_hand(shapes: pd.DataFrame) -> np.ndarray:
    c = LINE.coef
    return (c[0] + c[1] * shapes["n_tiles"] + c[2] * shapes["n_frames"] + c[3] * shapes["n_images"]
            + c[4] * shapes["text_tokens"] + c[5] * shapes["media_pixels"]).to_numpy()


def test_exact_timings_give_back_their_line():
    shapes = _with_pixels(toy_shapes(64, seed=3))
    table = shapes.assign(load_s=_by_hand(shapes))
    fitted = fit_load_line(table)
    assert np.allclose(fitted.coef, LINE.coef, rtol=1e-6, atol=1e-12)
    assert fitted.n_samples == 64
    with pytest.raises(UserError, match="load.parquet: not a load profile, missing columns \\['load_s'\\]"):
        fit_load_line(shapes, where="load.parquet")


def test_load_line_round_trips_exactly_and_bad_coefficients_are_refused(tmp_path):
    base = toy_cost_model(tp_degrees=(1,))
    model = CostModel(base.modules.values(), base.provenance, StepCosts(p2p=BytesLine(3e-5, 7e-10), loading=LINE))
    save_cost_model(model, tmp_path / "c.json")
    assert load_cost_model(tmp_path / "c.json").step_costs.loading == LINE
    data = cost_model_to_dict(model)
    data["step_costs"]["loading"]["coef_s"] = data["step_costs"]["loading"]["coef_s"][:5]
    with pytest.raises(UserError, match="c.json: invalid cost model at step_costs/loading/coef_s"):
        cost_model_from_dict(data, source="c.json")


@pytest.mark.parametrize("layout", [Layout("colocated", 1, 1, 2, 1, 2, 2, 2), Layout("disjoint", 1, 1, 1, 1, 2, 2, 2)])
def test_a_cpu_cluster_pays_each_samples_load_where_it_is_decoded(layout):
    shapes = _with_pixels(toy_shapes(32, seed=4))
    batch = Pool.from_shapes(shapes)
    loaded, _ = _pricing(StepCosts(loading=LINE), layout)
    plain, _ = _pricing(StepCosts(), layout)
    got, ref = loaded.batch(batch).costs, plain.batch(batch).costs
    load = _by_hand(shapes)
    if layout.colocated:  # the one stage 0 rank loads pixels and tokens
        assert np.allclose(got.llm_fwd[0] - ref.llm_fwd[0], load, rtol=1e-12)
        assert np.array_equal(got.vision_fwd, ref.vision_fwd)
    else:  # pixels where the vision tower starts; a text-only sample where the LLM does
        image = shapes["n_tiles"].to_numpy() > 0
        assert np.allclose(got.vision_fwd[0] - ref.vision_fwd[0], np.where(image, load, 0.0), rtol=1e-12)
        assert np.allclose(got.llm_fwd[0] - ref.llm_fwd[0], np.where(image, 0.0, load), rtol=1e-12)
    assert np.array_equal(got.llm_fwd[1:], ref.llm_fwd[1:]) and np.array_equal(got.llm_bwd, ref.llm_bwd)
    assert loaded.batch(batch).busy_gpu_s == plain.batch(batch).busy_gpu_s  # loading is not compute


def test_a_gpu_cluster_hides_the_load_behind_the_step():
    layout = Layout("colocated", 1, 1, 2, 1, 2, 2, 2)
    batch = Pool.from_shapes(_with_pixels(toy_shapes(32, seed=4)))
    for cost_device in ("cpu", "NVIDIA H100 80GB HBM3"):
        loaded, _ = _pricing(StepCosts(loading=LINE), layout, device="cuda", cost_device=cost_device)
        plain, _ = _pricing(StepCosts(), layout, device="cuda", cost_device=cost_device)
        assert loaded.load_s(batch) is None
        assert np.array_equal(loaded.batch(batch).costs.llm_fwd, plain.batch(batch).costs.llm_fwd)


def test_pool_keeps_frames_images_and_pixels_through_take():
    shapes = _with_pixels(toy_shapes(20, seed=5))
    pool = Pool.from_shapes(shapes)
    rows = np.array([3, 1, 7])
    for name in ("n_frames", "n_images", "media_pixels"):
        assert np.array_equal(getattr(pool.take(rows), name), shapes[name].to_numpy()[rows])
    bare = Pool.from_shapes(shapes.drop(columns=["n_frames", "n_images", "media_pixels"]))
    assert not bare.n_frames.any() and not bare.n_images.any() and not bare.media_pixels.any()


def test_simulate_says_whether_and_how_much_loading_is_charged():
    from dflop.planner.whatif import loading_note

    shapes = _with_pixels(toy_shapes(50, seed=6))
    pool = Pool.from_shapes(shapes)
    mean_ms = 1e3 * _by_hand(shapes).mean()
    layout = Layout("colocated", 1, 1, 2, 1, 2, 2, 2)
    cpu, model = _pricing(StepCosts(loading=LINE), layout)
    note = loading_note(model, cpu.cluster, pool, global_batch=16)
    assert note.startswith("charged") and f"{mean_ms:.3g} ms per sample" in note
    assert f"{mean_ms * 16 / 1e3:.3g} s of host time per global batch" in note
    for cost_device in ("cpu", "NVIDIA H100 80GB HBM3"):  # a CPU profile, and one taken on the GPUs themselves
        gpu, model = _pricing(StepCosts(loading=LINE), layout, device="cuda", cost_device=cost_device)
        assert loading_note(model, gpu.cluster, pool, global_batch=16).startswith("not charged on GPUs")
    _, plain = _pricing(StepCosts(), layout)
    assert loading_note(plain, cpu.cluster, pool, global_batch=16) is None


def test_a_shapes_file_from_before_media_pixels_still_reads_and_prices_without_it(tmp_path):
    from dflop.shapes import read_shapes

    shapes = _with_pixels(toy_shapes(20, seed=7))
    shapes.drop(columns=["media_pixels"]).to_parquet(tmp_path / "old.parquet", index=False)
    old = Pool.from_shapes(read_shapes(tmp_path / "old.parquet"))
    assert not old.media_pixels.any()
    shapes.drop(columns=["n_tiles"]).to_parquet(tmp_path / "bad.parquet", index=False)
    with pytest.raises(UserError, match="bad.parquet: missing column\\(s\\) n_tiles"):
        read_shapes(tmp_path / "bad.parquet")


@pytest.mark.parametrize("column,value,shown", [("load_s", np.nan, "nan"), ("load_s", np.inf, "inf"),
                                                ("media_pixels", np.inf, "inf"), ("text_tokens", -3.0, "-3.0")])
def test_a_load_profile_with_garbage_names_the_file_and_sample(tmp_path, column, value, shown):
    """A NaN load time used to reach the solver (NaN coefficients) or the JSON writer (a traceback)."""
    shapes = _with_pixels(toy_shapes(16, seed=3))
    table = shapes.assign(load_s=_by_hand(shapes))
    table[column] = table[column].astype(np.float64)
    table.loc[5, column] = value
    table.to_parquet(tmp_path / "load_profile.parquet")
    with pytest.raises(UserError, match=rf"^\S*load_profile.parquet: sample 's5' has invalid {column}={shown} "):
        fit_load_line(pd.read_parquet(tmp_path / "load_profile.parquet"), where=str(tmp_path / "load_profile.parquet"))
    table[column] = table[column].astype(str)
    with pytest.raises(UserError, match=rf"^load.parquet: column {column} holds \S+ values, expected numbers"):
        fit_load_line(table, where="load.parquet")
