"""Loader profiler: which samples it times, what it records of them, and that it times the full load."""

import pandas as pd

from dflop.config import Config
from dflop.costmodel.fit import fit_load_line
from dflop.profiling.data_profiler import profile_data
from dflop.profiling.load_profiler import LOAD_PROFILE_COLUMNS, pick_samples, profile_loading
from dflop.shapes import read_shapes


def test_loads_of_each_modality_are_timed_and_described_by_their_shapes(tmp_path, demo_manifest):
    cfg = Config.from_dict({"data": {"datasets": [{"name": "demo", "path": str(demo_manifest)}],
                                     "load_profile_samples": 3}})
    profile_data(cfg, shapes_path=tmp_path / "shapes.parquet", histograms_path=tmp_path / "h.parquet", workers=1,
                 progress=False)
    shapes = read_shapes(tmp_path / "shapes.parquet")
    table = profile_loading(cfg, tmp_path / "shapes.parquet", tmp_path / "load.parquet")
    assert list(pd.read_parquet(tmp_path / "load.parquet").columns) == list(LOAD_PROFILE_COLUMNS)
    counts = shapes["modality"].value_counts()
    assert table["modality"].value_counts().to_dict() == {m: min(3, n) for m, n in counts.items()}
    # each row carries its sample's shape as shapes.parquet has it
    merged = table.merge(shapes, on=["dataset", "sample_id"], suffixes=("", "_shapes"))
    assert len(merged) == len(table)
    for column in ("modality", "n_tiles", "n_frames", "n_images", "text_tokens", "media_pixels"):
        assert (merged[column] == merged[column + "_shapes"]).all(), column
    # the full load is timed: decoding a video's frames costs far more than tokenising a text-only sample
    by_modality = table.groupby("modality")["load_s"].median()
    assert (table["load_s"] > 0).all()
    assert by_modality["video"] > 3 * by_modality["text"]
    line = fit_load_line(table)
    assert line.n_samples == len(table) and all(c >= 0 for c in line.coef)
    # two loaders in lockstep (a node's training ranks): the same samples, timed on the first
    paired = profile_loading(cfg, tmp_path / "shapes.parquet", tmp_path / "load2.parquet", co_runners=2)
    assert paired["sample_id"].tolist() == table["sample_id"].tolist() and (paired["load_s"] > 0).all()


def test_samples_are_picked_per_modality_and_seeded():
    shapes = pd.DataFrame({"modality": ["text"] * 10 + ["video"] * 2, "sample_id": [f"s{i}" for i in range(12)]})
    picked = pick_samples(shapes, 4, seed=1)
    assert picked["modality"].value_counts().to_dict() == {"text": 4, "video": 2}
    assert picked["sample_id"].tolist() == pick_samples(shapes, 4, seed=1)["sample_id"].tolist()
    assert picked["sample_id"].tolist() != pick_samples(shapes, 4, seed=2)["sample_id"].tolist()
    assert picked["sample_id"].map(lambda s: int(s[1:])).is_monotonic_increasing  # file order kept
