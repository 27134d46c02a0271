"""results/train/trace.json: the Chrome trace-event format, and spans that agree with what else
measured the same step (metrics.parquet's busy seconds, the 1F1B op order, causality across ranks).

One real 2-rank gloo run of the tiny LLaVA-OV (vision tower on rank 0, LLM on rank 1, 2
microbatches: the data-blind policy keeps the plan's count), 2 steps, tracing step 2 only (so the window's clipping and step filter are in play).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dflop.errors import UserError
from dflop.profiling.model_profiler import CPU_THREADS_PER_RANK
from dflop.runtime.schedule import op_order
from dflop.runtime.spans import W_SPAN, simulated_ops, trace_ops, trace_window
from dflop.sim.pipeline import simulate
from trainer_reference import TWO_RANK_PLAN, config_dict, pick_pool

# The trace-event format (Google's "Trace Event Format" document): the keys and types of the
# event phases this trace uses; "M" metadata names the spec defines.
X_KEYS = {"name": str, "ph": str, "ts": (int, float), "dur": (int, float), "pid": int, "tid": int}
META_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}
STEPS = 2


def _train_worker(rank: int, spec: dict) -> None:
    import torch

    from dflop.config import Config
    from dflop.runtime.run import train

    torch.set_num_threads(2)  # what a job's OMP_NUM_THREADS=2 (Snakemake's rule threads) would give
    _record_processors_at_loads(Path(spec["out"]).parent / f"processors{rank}.json")
    train(Config.from_dict(spec["config"]), plan_path=spec["plan"], shapes_path=spec["shapes"], costmodel_path=None,
          out_dir=spec["out"], progress=False, export=False)
    Path(spec["out"], f"threads{rank}").write_text(str(torch.get_num_threads()))


def _record_processors_at_loads(path: Path) -> None:
    """Record, at each token / pixel load of this rank, whether its processor (the tokenizer, the
    image processor) was already built; and whether the rank built either at all."""
    from dflop.data.training import TrainingData

    seen = {"tokens": [], "pixels": [], "built": []}

    def save() -> None:
        path.write_text(json.dumps(seen))

    def watch(load, kind: str, attribute: str):
        def watched(self, *args, **kwargs):
            seen[kind].append(attribute in self.__dict__)
            save()
            return load(self, *args, **kwargs)
        return watched

    def watch_build(prop: str):
        build = getattr(TrainingData, prop).func

        def built(self):
            seen["built"].append(prop)
            save()
            return build(self)
        replacement = functools.cached_property(built)
        replacement.__set_name__(TrainingData, prop)
        setattr(TrainingData, prop, replacement)

    TrainingData.tokens = watch(TrainingData.tokens, "tokens", "_tokenizer")
    TrainingData.pixels = watch(TrainingData.pixels, "pixels", "_image_processor")
    for prop in ("_tokenizer", "_image_processor"):
        watch_build(prop)
    save()


@pytest.fixture(scope="module")
def traced_run(demo_shapes, runtime_demo, tmp_path_factory):
    """(trace dict, metrics frame, the run's folder) of the 2-step run; every sample has images, so
    every microbatch runs on both ranks."""
    from test_checkpoint_helpers import spawn

    tmp = tmp_path_factory.mktemp("traced")
    pool = pick_pool(demo_shapes["llava_ov"], tmp / "pool.parquet", {"image": 2, "multi_image": 1, "video": 1})
    (tmp / "plan.yaml").write_text(TWO_RANK_PLAN)
    config = config_dict("llava_ov", runtime_demo, train={"global_batch_size": 4, "steps": STEPS,
                                                          "checkpoint_every": STEPS, "trace_steps": [2, 9]},
                         scheduler={"policy": "baseline"})  # the plan's 2 microbatches, not the scheduler's choice
    spec = {"config": config, "plan": str(tmp / "plan.yaml"), "shapes": pool, "out": str(tmp / "out")}
    spawn(_train_worker, 2, tmp, spec)
    trace = json.loads((tmp / "out" / "trace.json").read_text())
    # a CPU rank computes on the torch threads the profile timed a rank with, whatever the job gave it
    assert [int((tmp / "out" / f"threads{r}").read_text()) for r in (0, 1)] == [CPU_THREADS_PER_RANK] * 2
    return trace, pd.read_parquet(tmp / "out" / "metrics.parquet"), tmp


def _spans(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


@pytest.mark.distributed
def test_trace_is_valid_trace_event_json(traced_run):
    trace, _, _ = traced_run
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    named = {}
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M"), e
        if e["ph"] == "M":
            assert e["name"] in META_NAMES and isinstance(e["args"], dict), e
            if e["name"] == "process_name":
                named[e["pid"]] = e["args"]["name"]
            continue
        for key, kind in X_KEYS.items():
            assert isinstance(e[key], kind) and not isinstance(e[key], bool), (key, e)
        assert e["dur"] >= 0 and e["ts"] >= 0, e
        assert isinstance(e.get("cat", ""), str) and isinstance(e.get("args", {}), dict), e
    assert named == {0: "rank 0 (vision0)", 1: "rank 1 (llm0)"}

    # Complete events on one track must nest or be disjoint (viewers drop partial overlaps). Compared
    # in whole nanoseconds, the recorder's unit: back-to-back spans (the sample loads) touch exactly
    # there, while ts + dur in float microseconds can land one ulp past the next span's ts.
    tracks: dict[tuple[int, int], list[tuple[int, int, dict]]] = {}
    for e in _spans(trace):
        start = round(e["ts"] * 1000)
        tracks.setdefault((e["pid"], e["tid"]), []).append((start, start + round(e["dur"] * 1000), e))
    for track in tracks.values():
        track.sort(key=lambda t: (t[0], t[0] - t[1]))
        open_ends: list[int] = []
        for start, end, e in track:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"partial overlap at {e}"
            open_ends.append(end)

    # Only the window's step; every rank has every kind of span; messages say their microbatch and size.
    spans = _spans(trace)
    assert {e["args"]["step"] for e in spans} == {2}
    for rank in (0, 1):
        cats = {e["cat"] for e in spans if e["pid"] == rank}
        assert cats == {"step", "data", "p2p_recv", "forward", "backward", "p2p_send", "allreduce", "optimizer"}
    messages = [e for e in spans if e["cat"].startswith("p2p") and e["name"] != "wait sends"]
    assert messages and all(e["args"]["bytes"] > 0 and "microbatch" in e["args"] for e in messages)


@pytest.mark.distributed
def test_spans_agree_with_metrics_schedule_and_causality(traced_run):
    trace, metrics, _ = traced_run
    spans = _spans(trace)
    row = metrics.set_index("step").loc[2]
    m = 2
    by_position: dict[tuple[int, str, int], dict] = {}
    for rank, stage_name in ((0, "vision0"), (1, "llm0")):
        ops = sorted((e for e in spans if e["pid"] == rank and e["cat"] in ("forward", "backward")),
                     key=lambda e: e["ts"])
        # metrics.parquet's busy seconds (the StageTimer's sums, gathered to rank 0) = the spans' durations,
        # plus, on CPU, the loads of the samples the pricing charges to this stage's forwards (traced as
        # per-position "data" spans inside the data wait; the vision stage decodes the batch's images)
        loads = [e for e in spans if e["pid"] == rank and e["cat"] == "data" and "position" in e["args"]]
        assert rank == 1 or loads
        assert (sum(e["dur"] for e in ops) + sum(e["dur"] for e in loads)) / 1e6 == pytest.approx(
            row[f"busy_s_{stage_name}"], rel=1e-6, abs=1e-6)
        # One span per op, in the order 1F1B prescribes for this stage.
        kinds = [("F" if e["cat"] == "forward" else "B", e["args"]["position"]) for e in ops]
        assert kinds == op_order("1f1b", rank, 2, m)
        for e in ops:
            by_position[(rank, e["cat"], e["args"]["position"])] = e
        # The same position always carries the same microbatch id; ids are a permutation of 0..m-1.
        ids = {e["args"]["position"]: e["args"]["microbatch"] for e in ops}
        assert sorted(ids.values()) == list(range(m))

    def end(e):
        return e["ts"] + e["dur"]

    # Causality on the aligned clock: the LLM cannot start a microbatch before the tower has encoded
    # it, nor the tower's backward before the LLM's backward has sent the feature gradients.
    for p in range(m):
        assert by_position[(1, "forward", p)]["ts"] >= end(by_position[(0, "forward", p)])
        assert by_position[(0, "backward", p)]["ts"] >= end(by_position[(1, "backward", p)])
    # What one rank sent is what the other received.
    for direction, sender in (("activation", 0), ("gradient", 1)):
        sent = {e["args"]["position"]: e["args"]["bytes"] for e in spans
                if e["pid"] == sender and e["name"] == f"send {direction}"}
        got = {e["args"]["position"]: e["args"]["bytes"] for e in spans
               if e["pid"] == 1 - sender and e["name"] == f"recv {direction}"}
        assert sent == got and len(sent) == m

    table = trace_ops(trace, step=2)
    assert len(table) == 2 * 2 * m
    assert table["start_s"].min() == 0.0 and (table["end_s"] >= table["start_s"]).all()
    assert set(zip(table["stage"], table["stage_name"])) == {(0, "vision0"), (1, "llm0")}
    with pytest.raises(UserError, match="no forward or backward spans of step 1"):
        trace_ops(trace, step=1)


def test_window_is_clipped_to_the_run():
    assert list(trace_window([3, 4], 6)) == [3, 4]
    assert list(trace_window([3, 4], 2)) == [2]
    assert list(trace_window([3, 9], 5)) == [3, 4, 5]
    with pytest.raises(UserError, match="train.trace_steps"):
        trace_window([4, 3], 6)


def test_measured_table_merges_an_ops_spans_and_starts_at_the_first_forward():
    """A colocated stage's forward is two spans (tower, LLM): one op, busy = their sum."""
    ident = {"stage": 0, "stage_name": "llm0", "replica": 0, "tp_rank": 0}

    def x(cat, ts, dur, mb, step=5):
        return {"ph": "X", "cat": cat, "name": cat, "pid": 0, "tid": 1, "ts": ts, "dur": dur,
                "args": {"step": step, "microbatch": mb, **ident}}

    trace = {"traceEvents": [x("data", 0, 50, None), x("forward", 100, 10, 1), x("forward", 115, 20, 1),
                             x("backward", 140, 30, 1), x("forward", 0, 5, 0, step=4)]}
    trace["traceEvents"][0]["args"] = {"step": 5}
    table = trace_ops(trace, step=5)
    assert table[["op", "microbatch"]].values.tolist() == [["F", 1], ["B", 1]]
    np.testing.assert_allclose(table["start_s"], [0, 40e-6])
    np.testing.assert_allclose(table["end_s"], [35e-6, 70e-6])
    np.testing.assert_allclose(table["busy_s"], [30e-6, 30e-6])


def test_measured_table_keeps_zb_h1s_weight_backward_apart():
    """ZB-H1's W spans (category backward, `W_SPAN`) are op "W", not merged into the microbatch's B.
    Bug caught: W read by its category alone: one "B" op spanning B and W, busy their sum."""
    ident = {"stage": 1, "stage_name": "llm0", "replica": 0, "tp_rank": 0}

    def x(cat, ts, dur, mb, name=None):
        return {"ph": "X", "cat": cat, "name": name or cat, "pid": 0, "tid": 1, "ts": ts, "dur": dur,
                "args": {"step": 5, "microbatch": mb, **ident}}

    trace = {"traceEvents": [x("forward", 0, 10, 0), x("backward", 20, 15, 0),
                             x("backward", 50, 5, 0, W_SPAN), x("forward", 60, 10, 1)]}
    table = trace_ops(trace, step=5)
    assert table[["op", "microbatch"]].values.tolist() == [["F", 0], ["B", 0], ["W", 0], ["F", 1]]
    np.testing.assert_allclose(table["busy_s"], [10e-6, 15e-6, 5e-6, 10e-6])
    np.testing.assert_allclose(table["end_s"], [10e-6, 35e-6, 55e-6, 70e-6])


def test_simulated_table_has_zb_h1s_w_ops():
    # Two stages, two microbatches, F 1 s, backward 2 s split B 1 s + W 1 s (wgrad_frac 0.5), no
    # latency (worked out by hand from ZB-H1's order: stage 0 runs each W after its B, stage 1
    # postpones its first W to the end): stage 0: F0 [0,1] F1 [1,2] B0 [3,4] W0 [4,5] B1 [5,6]
    # W1 [6,7]; stage 1: F0 [1,2] B0 [2,3] F1 [3,4] B1 [4,5] W0 [5,6] W1 [6,7].
    # Bug caught: the W ops left out (the table then has no "W" rows and ends at the last B).
    table = simulated_ops(simulate(np.ones((2, 2)), 2 * np.ones((2, 2)), schedule="zb-h1", wgrad_frac=0.5))
    got = {(r.stage, r.op, r.microbatch): (r.start_s, r.end_s) for r in table.itertuples()}
    assert got == {(0, "F", 0): (0, 1), (0, "F", 1): (1, 2), (0, "B", 0): (3, 4), (0, "W", 0): (4, 5),
                   (0, "B", 1): (5, 6), (0, "W", 1): (6, 7),
                   (1, "F", 0): (1, 2), (1, "B", 0): (2, 3), (1, "F", 1): (3, 4), (1, "B", 1): (4, 5),
                   (1, "W", 0): (5, 6), (1, "W", 1): (6, 7)}
    # vision stages' backward is not split: no W rows there (the simulator's NaN skipped)
    from dflop.sim import simulate_dp
    with_vision = simulated_ops(simulate_dp(np.ones((1, 2)), 2 * np.ones((1, 2)), np.ones((1, 2, 2)),
                                            2 * np.ones((1, 2, 2)), schedule="zb-h1"))
    assert set(with_vision.query("stage == 0")["op"]) == {"F", "B"}
    assert set(with_vision.query("stage > 0")["op"]) == {"F", "B", "W"}
    assert not with_vision[["start_s", "end_s"]].isna().any().any()


def test_simulated_table_is_the_hand_computed_1f1b_timeline():
    # Two stages, two microbatches, forward 1 s, backward 2 s, no latency (worked out by hand):
    # stage 0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]; stage 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7].
    table = simulated_ops(simulate(np.ones((2, 2)), 2 * np.ones((2, 2))))
    got = {(r.stage, r.op, r.microbatch): (r.start_s, r.end_s) for r in table.itertuples()}
    assert got == {(0, "F", 0): (0, 1), (0, "F", 1): (1, 2), (0, "B", 0): (4, 6), (0, "B", 1): (7, 9),
                   (1, "F", 0): (1, 2), (1, "B", 0): (2, 4), (1, "F", 1): (4, 5), (1, "B", 1): (5, 7)}
    assert set(table["stage_name"]) == {"llm0", "llm1"}


def test_differences_match_ops_and_take_a_stage_at_its_slowest_tp_rank():
    from dflop.runtime.spans import op_differences

    simulated = simulated_ops(simulate(np.ones((2, 2)), 2 * np.ones((2, 2))))
    measured = simulated.copy()
    measured["rank"] = [0, 0, 0, 0, 1, 1, 1, 1][:len(measured)]
    late = (measured["stage"] == 1) & (measured["op"] == "B") & (measured["microbatch"] == 0)
    measured.loc[late, "end_s"] += 0.5  # stage 1's B0 took 2.5 s instead of 2
    other_tp = measured[late].assign(tp_rank=1, end_s=measured.loc[late, "end_s"] + 0.25)  # its slower TP rank
    diffs = op_differences(pd.concat([measured, other_tp]), simulated).set_index(["stage", "op", "microbatch"])
    assert len(diffs) == 8
    assert diffs.loc[(1, "B", 0), ["start_diff_s", "end_diff_s", "dur_diff_s"]].tolist() == [0.0, 0.75, 0.75]
    others = diffs.drop(index=(1, "B", 0))
    assert (others[["start_diff_s", "end_diff_s", "dur_diff_s"]] == 0).all().all()


@pytest.mark.distributed
def test_processors_are_built_before_the_first_step(traced_run):
    """The tokenizer's build (seconds of BPE conversion) made step 1 10-20x step 2, counted in its
    wait for samples and its first forward: the trainer builds each rank's processors before the
    first step, and only those the rank's loads use."""
    *_, out = traced_run
    seen = [json.loads((out / f"processors{rank}.json").read_text()) for rank in (0, 1)]
    vision, llm = seen  # rank 0 holds the vision tower (pixels), rank 1 the LLM (tokens)
    assert vision["pixels"] and all(vision["pixels"]) and not vision["tokens"]
    assert llm["tokens"] and all(llm["tokens"]) and not llm["pixels"]
    assert vision["built"] == ["_image_processor"] and llm["built"] == ["_tokenizer"]
