"""Shape histograms: the bars drawn equal numpy histograms of the samples, per dataset and modality."""

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from dflop.errors import UserError
from dflop.profiling.data_profiler import histogram_edges, histograms
from dflop.report.data_plots import FEATURES, datasets_of, draw_shape_histograms, feature_histogram, \
    modality_counts, plot_shape_histograms


def _shapes(seed: int = 0) -> pd.DataFrame:
    """Two datasets with different modality mixes; a few skipped samples that must not be counted."""
    rng = np.random.default_rng(seed)
    rows = []
    for dataset, n, modalities in (("alpha", 120, ["text", "image", "video"]), ("beta", 80, ["image", "multi_image"])):
        for i in range(n):
            modality = modalities[rng.integers(len(modalities))]
            tiles = {"text": 0, "image": int(rng.integers(1, 11)), "multi_image": int(rng.integers(2, 20)),
                     "video": 32}[modality]
            vision = tiles * 10 if modality != "video" else 129
            text = int(rng.integers(20, 900))
            rows.append({"sample_id": f"{dataset}-{i}", "dataset": dataset, "modality": modality,
                         "n_images": int(modality in ("image", "multi_image")), "n_frames": 32 * (modality == "video"),
                         "n_tiles": tiles, "vision_tokens": vision, "text_tokens": text, "seq_len": vision + text,
                         "status": "ok" if i % 37 else "skipped:unreadable"})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def shapes():
    return _shapes()


@pytest.fixture(scope="module")
def hist(shapes):
    return histograms(shapes)


def _reference(shapes: pd.DataFrame, dataset: str, feature: str, modality: str) -> tuple[np.ndarray, np.ndarray]:
    """numpy counts of `feature` for the ok samples of (dataset, modality), on the profiler's bin edges."""
    ok = shapes[shapes["status"] == "ok"]
    edges = histogram_edges(ok[feature].to_numpy())
    part = ok[ok["modality"] == modality]
    if dataset != "all":
        part = part[part["dataset"] == dataset]
    counts, _ = np.histogram(part[feature].to_numpy(), bins=edges)
    return counts, edges


@pytest.mark.parametrize("dataset", ["all", "alpha", "beta"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_counts_match_numpy_histograms_of_the_samples(shapes, hist, dataset, feature):
    h = feature_histogram(hist, dataset, feature)
    ok = shapes[shapes["status"] == "ok"]
    expected_modalities = set(ok["modality"] if dataset == "all" else ok[ok["dataset"] == dataset]["modality"])
    assert set(h.modalities) == expected_modalities
    for modality, counts in zip(h.modalities, h.counts):
        ref, edges = _reference(shapes, dataset, feature, modality)
        first = int(np.searchsorted(edges, h.bin_lo[0]))
        assert list(zip(h.bin_lo, h.bin_hi)) == list(zip(edges[first:], edges[first + 1:]))[:len(h.bin_lo)]
        assert counts.tolist() == ref[first:first + len(counts)].tolist()
        assert counts.sum() == ref.sum()  # trimming drops only empty bins
    total = h.counts.sum(axis=0)
    assert total[0] > 0 and total[-1] > 0


def test_modality_mix_and_dataset_rows(shapes, hist):
    ok = shapes[shapes["status"] == "ok"]
    assert datasets_of(hist) == ["all", "alpha", "beta"]
    for dataset in ("alpha", "beta"):
        part = ok[ok["dataset"] == dataset]
        assert modality_counts(hist, dataset).to_dict() == part["modality"].value_counts().to_dict()
    pooled = modality_counts(hist, "all")
    assert pooled.to_dict() == ok["modality"].value_counts().to_dict()
    assert list(pooled.index) == ["text", "image", "multi_image", "video"]  # the plotting order
    one = histograms(shapes[shapes["dataset"] == "beta"])
    assert datasets_of(one) == ["beta"]  # no pooled row for a single dataset


def test_bars_drawn_are_the_stacked_counts(shapes, hist):
    fig = draw_shape_histograms(hist)
    axes = np.array(fig.axes[:3 * (1 + len(FEATURES))]).reshape(3, 1 + len(FEATURES))
    for r, dataset in enumerate(["all", "alpha", "beta"]):
        mix = modality_counts(hist, dataset)
        assert [p.get_height() for p in axes[r, 0].patches] == mix.tolist()
        for c, feature in enumerate(FEATURES, start=1):
            h = feature_histogram(hist, dataset, feature)
            patches = axes[r, c].patches
            heights = np.array([p.get_height() for p in patches]).reshape(h.counts.shape)
            bottoms = np.array([p.get_y() for p in patches]).reshape(h.counts.shape)
            np.testing.assert_array_equal(heights, h.counts)
            np.testing.assert_array_equal(bottoms, np.vstack([np.zeros(h.counts.shape[1]), h.counts.cumsum(0)[:-1]]))
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_png_is_written(hist, tmp_path):
    hist.to_parquet(tmp_path / "histograms.parquet")
    out = plot_shape_histograms(histograms=tmp_path / "histograms.parquet", out_png=tmp_path / "out/shapes.png")
    assert out == tmp_path / "out/shapes.png"
    with Image.open(out) as img:
        assert img.format == "PNG" and img.width > 1000 and img.height > 600  # three rows of panels


def test_bad_input_is_one_line_naming_the_file(hist, tmp_path):
    with pytest.raises(UserError, match=r"nope\.parquet: no such file"):
        plot_shape_histograms(histograms=tmp_path / "nope.parquet", out_png=tmp_path / "x.png")
    hist.drop(columns=["modality"]).to_parquet(tmp_path / "old.parquet")
    with pytest.raises(UserError, match=r"old\.parquet: missing column\(s\) modality"):
        plot_shape_histograms(histograms=tmp_path / "old.parquet", out_png=tmp_path / "x.png")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(UserError, match=r"junk\.parquet: not a readable Parquet file"):
        plot_shape_histograms(histograms=tmp_path / "junk.parquet", out_png=tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
