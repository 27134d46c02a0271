"""Loader profiler: which samples it times, what it records of them, and that it times the full load."""

import pandas as pd

from dflop.config import Config
from dflop.costmodel.fit import fit_load_line
from dflop.profiling.data_profiler import profile_data
from dflop.profiling.load_profiler import LOAD_PROFILE_COLUMNS, pick_samples, profile_loading
from dflop.shapes import read_shapes


def test_loads_of_each_modality_are_timed_and_described_by_their_shapes(tmp_path, demo_manifest):
    cfg = Config.from_dict({"data": {"datasets": [{"name": "demo", "path": str(demo_manifest)}],
                                     "load_profile_samples": 3, "load_profile_seconds": 0}})
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


class _PhasedLoads:
    """A stand-in for `TrainingData` on a machine with slow phases: loading sample i advances a
    fake clock by base[i] times the phase's slowdown at that moment, and every load is logged."""

    def __init__(self, base_s, slow_from, slow_to, slowdown):
        self.base_s, self.slow_from, self.slow_to, self.slowdown = base_s, slow_from, slow_to, slowdown
        self.now, self.order = 0.0, []

    def __len__(self):
        return len(self.base_s)

    def __getitem__(self, request):
        i = request.index
        phase = self.slowdown if self.slow_from <= self.now < self.slow_to else 1.0
        self.order.append(i)
        self.now += self.base_s[i] * phase
        return None

    def clock(self):
        return self.now


def test_loads_are_timed_in_interleaved_passes_that_fill_the_time_budget_and_averaged():
    import numpy as np

    from dflop.profiling.load_profiler import MAX_PASSES, time_loads

    base = [0.125, 0.25, 0.375]  # one pass: 0.75 s (exact in binary)
    data = _PhasedLoads(base, slow_from=1.5, slow_to=2.5, slowdown=2.0)  # the 2nd timed pass runs slow
    seconds = time_loads(data, seconds=3.0, show_progress=False, clock=data.clock)
    # an untimed pass, then whole passes over all samples (never one sample's loads back to back),
    # as many as fill 3 s at the first timed pass's pace: 4
    assert data.order == [0, 1, 2] * 5
    # each sample's mean over the 4 passes, one of which ran 2x slow: 1.25x its base time (the
    # median of those loads would be the fast phase's 1.0x)
    np.testing.assert_allclose(seconds, np.array(base) * (3 + 2) / 4)
    # at least two timed passes with no budget, at most MAX_PASSES with a huge one
    data = _PhasedLoads(base, 0, 0, 1.0)
    time_loads(data, seconds=0, show_progress=False, clock=data.clock)
    assert len(data.order) == 3 * (1 + 2)
    data = _PhasedLoads(base, 0, 0, 1.0)
    time_loads(data, seconds=1e6, show_progress=False, clock=data.clock)
    assert len(data.order) == 3 * (1 + MAX_PASSES)


def test_co_running_loaders_follow_the_leaders_pass_count():
    """Two loaders in lockstep (threads here, processes in the profiler) with one barrier: the
    follower runs the passes the leader decided from its own first pass, not a count of its own
    (it has no time budget: alone it would stop after the minimum), so the barriers stay paired
    and neither waits out its timeout."""
    import threading
    from types import SimpleNamespace

    from dflop.profiling.load_profiler import time_loads

    base = [0.125, 0.25, 0.375]
    leader, follower = _PhasedLoads(base, 0, 0, 1.0), _PhasedLoads(base, 0, 0, 1.0)
    barrier, shared = threading.Barrier(2, timeout=10), SimpleNamespace(value=0)
    thread = threading.Thread(target=time_loads, args=(follower,), daemon=True,
                              kwargs=dict(seconds=0.0, show_progress=False, barrier=barrier, shared_passes=shared,
                                          leads=False, clock=follower.clock))
    thread.start()
    time_loads(leader, seconds=3.0, show_progress=False, barrier=barrier, shared_passes=shared, clock=leader.clock)
    thread.join(timeout=10)
    assert not thread.is_alive() and shared.value == 4
    assert leader.order == follower.order == [0, 1, 2] * 5
