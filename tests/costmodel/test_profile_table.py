"""Profile checks: bad input is one line naming the file, column and row."""

import numpy as np
import pytest

from dflop.costmodel.profile_table import read_profile, summarize_profile
from dflop.costmodel.synthetic import synthetic_profile
from dflop.errors import UserError


def test_repeats_reduce_to_the_median_per_shape_and_layers_to_one_layer():
    profile = synthetic_profile(modules=("llm_layer",), llm_batches=(2,), llm_seq_lens=(64,), n_layers=4, repeats=3)
    profile["fwd_ms"] = [40.0, 4.0, 8.0]  # median 8 ms for 4 layers -> 2 ms per layer
    shapes = summarize_profile(profile).shapes
    assert len(shapes) == 1
    assert shapes["fwd_ms"].iloc[0] == pytest.approx(2.0)
    assert shapes["n_repeats"].iloc[0] == 3


def test_missing_file_and_columns(tmp_path):
    with pytest.raises(UserError, match=r"nope\.parquet: no such file \(run `dflop profile-model` first\)"):
        read_profile(tmp_path / "nope.parquet")
    path = tmp_path / "model_profile.parquet"
    synthetic_profile().drop(columns=["bwd_ms", "dtype"]).to_parquet(path)
    with pytest.raises(UserError, match=r"model_profile.parquet: missing column\(s\) bwd_ms, dtype$"):
        read_profile(path)


def test_bad_value_names_the_row():
    profile = synthetic_profile(modules=("llm_head",))
    profile.loc[5, "fwd_ms"] = np.nan
    with pytest.raises(UserError, match=r"^p.parquet: row 5 \(module=llm_head tp=1 batch=1 seq_len=4096\) has invalid fwd_ms=nan \(must be a "
                                        r"finite number >= 0\)$"):
        summarize_profile(profile, source="p.parquet")


def test_mixed_devices_and_tile_sizes_are_refused():
    profile = synthetic_profile(modules=("llm_head",))
    profile.loc[0, "device"] = "cuda"
    with pytest.raises(UserError, match="column 'device' must hold one value per profile, found: cuda, synthetic"):
        summarize_profile(profile)
    tiles = synthetic_profile(modules=("vision_layer",))
    tiles.loc[0, "seq_len"] = 1025
    with pytest.raises(UserError, match=r"vision_layer at tp=1 profiled with several patches per tile \(729, 1025\)"):
        summarize_profile(tiles)


def test_unknown_modules_are_ignored_with_a_warning(caplog):
    profile = synthetic_profile(modules=("llm_head",))
    profile.loc[0, "module"] = "llm_mlp"
    shapes = summarize_profile(profile).shapes
    assert set(shapes["module"]) == {"llm_head"}
    assert "llm_mlp" in caplog.text


def test_recompute_columns_take_the_median_of_the_measured_repeats_per_layer():
    """The profiler times a recompute mode fewer times than mode none: the rest of the rows are NaN."""
    profile = synthetic_profile(modules=("llm_layer", "llm_head"), llm_batches=(2,), llm_seq_lens=(64,), n_layers=2,
                                repeats=3, recompute=True)
    layer = profile["module"] == "llm_layer"
    profile.loc[layer, "bwd_ms:full"] = [12.0, 6.0, np.nan]  # median 9 ms of 2 layers
    shapes = summarize_profile(profile).shapes.set_index("module")
    assert shapes.loc["llm_layer", "bwd_ms:full"] == pytest.approx(4.5)
    assert np.isnan(shapes.loc["llm_head", "bwd_ms:full"])


def test_bad_recompute_value_names_the_row():
    profile = synthetic_profile(modules=("llm_layer",), recompute=True)
    profile.loc[3, "act_bytes:selective"] = -1.0
    with pytest.raises(UserError, match=r"row 3 \(module=llm_layer .*\) has invalid act_bytes:selective=-1.0 \(must be a finite number >= 0\)"):
        summarize_profile(profile)


@pytest.mark.parametrize("column,value,message", [
    ("repeat", np.nan, r"row 2 \(module=llm_head .*\) has invalid repeat=nan \(must be a whole number >= 0\)"),
    ("act_bytes", np.inf, r"row 2 \(module=llm_head .*\) has invalid act_bytes=inf \(must be a finite number\)"),
    ("tp", 1.5, r"row 2 \(module=llm_head .*\) has invalid tp=1.5 \(must be a whole number >= 1\)"),
    ("peak_bytes", -np.inf, r"row 2 \(module=llm_head .*\) has invalid peak_bytes=-inf"),
])
def test_non_finite_or_fractional_numbers_name_the_file_and_row(tmp_path, column, value, message):
    """A NaN repeat and a fractional tp used to be fitted silently."""
    profile = synthetic_profile(modules=("llm_head",))
    profile[column] = profile[column].astype(np.float64)
    profile.loc[2, column] = value
    profile.to_parquet(tmp_path / "model_profile.parquet")
    with pytest.raises(UserError, match=rf"^\S*model_profile.parquet: {message}"):
        read_profile(tmp_path / "model_profile.parquet")


def test_a_column_of_strings_is_refused(tmp_path):
    """pd.to_numeric used to turn "4.25" into a number and the profile fitted."""
    profile = synthetic_profile(modules=("llm_head",))
    profile["bwd_ms"] = profile["bwd_ms"].astype(str)
    profile.to_parquet(tmp_path / "model_profile.parquet")
    with pytest.raises(UserError, match=r"^\S*model_profile.parquet: column bwd_ms holds \S+ values, expected numbers "
                                        r"\(row 0 \(module=llm_head .*\): '[0-9.e+-]+'\)$"):
        read_profile(tmp_path / "model_profile.parquet")
