"""Measured timelines: what each rank did when, per step, as spans; results/train/trace.json.

`SpanRecorder` records, for the steps of the ``train.trace_steps`` window, one span per forward and
backward (the `StageTimer`'s own measurement, so trace and metrics agree), per P2P send and
receive, for the gradient sync (``allreduce``), the optimizer step and the data wait. Outside the
window `span` hands back one shared no-op context: tracing off costs an attribute test per call.

Clock: ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux), one clock for every process of a host, so
ranks on rank 0's host need no correction. Other hosts' monotonic clocks have unrelated origins:
their spans are shifted by the difference of the clocks read right after a barrier at the
window's start (error: the barrier's exit skew, microseconds on one switch). Wall-clock time
(``time.time_ns``) would need no barrier but jumps under NTP adjustment and is only as aligned
as NTP makes it (milliseconds). On CUDA a span is a pair of events on the current stream, placed
on the host clock by one anchor event per step (no synchronisation per span; one at the step's end).

`write_trace` gathers every rank's spans to rank 0 and writes the Chrome trace-event format (JSON
object, complete "X" events, microseconds; one process per rank named "rank N (stage)", one
thread track per category), which ui.perfetto.dev and chrome://tracing open. `trace_ops` reads one
step of such a file back as the per-op table of `simulated_ops` (the simulator's Gantt rows), so
measured and simulated timelines line up op for op.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from dflop.errors import UserError
from dflop.io import atomic_path

# Track (thread id) of each category in a rank's process, in display order.
CATEGORIES = ("step", "data", "p2p_recv", "forward", "backward", "p2p_send", "allreduce", "optimizer")
OP_KIND = {"forward": "F", "backward": "B"}
# A split-backward schedule's (ZB-H1's) W span: category backward, this name; op "W" in the per-op
# tables (its B spans stay "B"), so 1F1B and interleaved traces and tables are unchanged.
W_SPAN = "weight backward"
OPS_COLUMNS = ("rank", "stage", "stage_name", "replica", "tp_rank", "op", "microbatch", "start_s", "end_s", "busy_s")


@dataclass
class Span:
    """One interval of one rank. start/end: host nanoseconds (int) or, on CUDA, events until the
    step ends. position: the microbatch's execution position in the step (None: not per microbatch)."""

    category: str
    name: str
    step: int
    start: Any
    end: Any
    position: int | None = None
    microbatch: int | None = None
    nbytes: int | None = None


def trace_window(trace_steps, total_steps: int) -> range:
    """The steps (1-based, as metrics.parquet counts them) `train.trace_steps` = [first, last]
    traces, clipped to a run of `total_steps` (a short run traces its last step)."""
    first, last = (int(s) for s in trace_steps)
    if first > last:
        raise UserError(f"train.trace_steps: the first step ({first}) is after the last ({last})")
    last = min(last, total_steps)
    return range(min(first, last), last + 1)


class SpanRecorder:
    """One rank's spans of the steps in `window` (1-based steps; empty: off)."""

    def __init__(self, window: range = range(0), device: torch.device = torch.device("cpu")):
        self.window = window
        self.cuda = device.type == "cuda"
        self.active = False
        self.spans: list[Span] = []
        self._step = 0
        self._anchor: tuple[object, int] | None = None
        self._clock_shift = 0
        self._aligned = False
        self._step_start = None

    # -- the step --------------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Start step `step` (1-based); the first step of the window aligns the clocks (collective:
        every rank calls it with the same steps)."""
        self._step = step
        self.active = step in self.window
        if not self.active:
            return
        if not self._aligned:
            self._align_clocks()
        if self.cuda:
            anchor = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            anchor.record()
            self._anchor = (anchor, time.perf_counter_ns())
        self._step_start = self._now()

    def _now(self):
        if not self.cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def end_step(self) -> None:
        """Close the step's own span; resolve its CUDA events to host nanoseconds (one synchronisation)."""
        if not self.active:
            return
        self.add("step", f"step {self._step}", self._step_start, self._now())
        if self.cuda:
            torch.cuda.synchronize()
            anchor, host = self._anchor
            for span in self.spans:
                if isinstance(span.start, torch.cuda.Event):
                    span.start = host + round(anchor.elapsed_time(span.start) * 1e6)
                    span.end = host + round(anchor.elapsed_time(span.end) * 1e6)
        self.active = False

    def _align_clocks(self) -> None:
        """Shift to rank 0's clock: 0 on rank 0's host, else the clock difference after a barrier."""
        self._aligned = True
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        dist.barrier()
        mine = (socket.gethostname(), time.perf_counter_ns())
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        host0, clock0 = every[0]
        self._clock_shift = 0 if mine[0] == host0 else clock0 - mine[1]

    # -- recording -------------------------------------------------------------------------------

    def span(self, category: str, name: str | None = None, *, position: int | None = None,
             microbatch: int | None = None, nbytes: int | None = None):
        """Context manager recording the enclosed block (a shared no-op one, entered as None,
        outside the window)."""
        if not self.active:
            return _OFF
        return self._record(category, name or category, position, microbatch, nbytes)

    @contextlib.contextmanager
    def _record(self, category, name, position, microbatch, nbytes):
        """Yields a dict whose "nbytes" the block may set (bytes known only at its end)."""
        extra = {"nbytes": nbytes}
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield extra
            end.record()
        else:
            start = time.perf_counter_ns()
            yield extra
            end = time.perf_counter_ns()
        self.add(category, name, start, end, position=position, microbatch=microbatch, nbytes=extra["nbytes"])

    def add(self, category: str, name: str, start, end, *, position: int | None = None,
            microbatch: int | None = None, nbytes: int | None = None) -> None:
        """Record a span measured elsewhere (host ns, or CUDA events resolved at `end_step`)."""
        if self.active:
            self.spans.append(Span(category, name, self._step, start, end, position, microbatch, nbytes))

    def add_back_to_back(self, category: str, name: str, seconds_per_position) -> None:
        """Per position p, a span of seconds_per_position[p] (zero ones skipped), laid back to back
        so that the last ends now: durations measured elsewhere (the loader's per-sample timings),
        placed where they happened, just before this call. Host clock (CPU runs only)."""
        if not self.active:
            return
        durations = [round(float(s) * 1e9) for s in seconds_per_position]
        start = time.perf_counter_ns() - sum(durations)
        for position, ns in enumerate(durations):
            if ns > 0:
                self.add(category, name, start, start + ns, position=position)
                start += ns

    def void_since(self, count: int, why: str) -> None:
        """Re-file the forward and backward spans recorded after the first `count` as "data" spans
        named `why` (work thrown away, e.g. a step computed before a load failed elsewhere): they
        stay visible in the trace but are no ops of the step (`trace_ops`)."""
        for span in self.spans[count:]:
            if span.category in OP_KIND:
                span.category, span.name = "data", f"{why}: {span.name}"

    def label_microbatches(self, microbatch_ids) -> None:
        """Give this step's per-position spans the scheduler's microbatch id of their position."""
        for span in self.spans:
            if span.step == self._step and span.position is not None and span.microbatch is None:
                span.microbatch = int(microbatch_ids[span.position])

    # -- the file --------------------------------------------------------------------------------

    def events(self, rank: int) -> list[dict]:
        """This rank's spans as trace events (ts/dur in microseconds on rank 0's clock)."""
        out = []
        for s in self.spans:
            args: dict[str, Any] = {"step": s.step}
            if s.position is not None:
                args["position"] = s.position
            if s.microbatch is not None:
                args["microbatch"] = s.microbatch
            if s.nbytes is not None:
                args["bytes"] = s.nbytes
            start = s.start + self._clock_shift
            out.append({"name": s.name, "cat": s.category, "ph": "X", "pid": rank, "tid": CATEGORIES.index(s.category),
                        "ts": start / 1e3, "dur": max(s.end - s.start, 0) / 1e3, "args": args})
        return out


def rank_labels(topo) -> tuple[list[str], list[dict]]:
    """Every rank's process name ("rank r (llm0 r1 tp0)": stage, replica and TP rank where there
    are several) and the stage identity its forward / backward events carry (`trace_ops` reads it)."""
    from dflop.runtime.metrics import stage_labels

    labels = stage_labels(topo)
    names, args = [], []
    for rank, peer in enumerate(topo.peers):
        role = peer.llm_role if peer.llm_role is not None else peer.vision_role
        stage = peer.pipeline_stage
        where = labels[stage] + (f" r{role.replica}" if role.n_replicas > 1 else "") \
            + (f" tp{role.tp_rank}" if role.tp > 1 else "")
        names.append(f"rank {rank} ({where})")
        args.append({"stage": stage, "stage_name": labels[stage], "replica": role.replica, "tp_rank": role.tp_rank})
    return names, args


def publish_trace(working: str | Path, path: str | Path) -> Path:
    """Copy the run's trace (written next to the checkpoints, so a resumed run keeps it) to `path`;
    without one (the window's steps ran in an earlier process that kept none) a trace with no
    spans, so the declared output exists."""
    working, path = Path(working), Path(path)
    with atomic_path(path) as tmp:
        if working.exists():
            Path(tmp).write_bytes(working.read_bytes())
        else:
            Path(tmp).write_text(json.dumps({"traceEvents": [], "displayTimeUnit": "ms"}))
    return path


class _Off:
    """The context `SpanRecorder.span` returns when not recording."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_OFF = _Off()


def write_trace(recorder: SpanRecorder, path: str | Path, *, rank: int, world: int, process_names: list[str],
                process_args: list[dict] | None = None) -> Path | None:
    """Gather every rank's events to rank 0 (collective) and write `path` there, atomically.

    process_names[r]: rank r's process label ("rank r (stage)"); process_args[r]: what every
    forward / backward event of rank r carries besides step and microbatch (stage, replica)."""
    events = recorder.events(rank)
    if process_args is not None:
        for e in events:
            if e["cat"] in OP_KIND:
                e["args"].update(process_args[rank])
    gathered = [events]
    if world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(events, gathered, dst=0)
    if rank != 0:
        return None
    return write_trace_file(path, [e for per_rank in gathered for e in per_rank], process_names)


def write_trace_file(path: str | Path, events: list[dict], process_names: list[str]) -> Path:
    """The trace-event JSON object: metadata naming processes and tracks, then `events` with
    timestamps from the earliest one (Perfetto and chrome://tracing read absolute ones too; small
    numbers read better)."""
    origin = min((e["ts"] for e in events), default=0.0)
    meta = []
    for rank, name in enumerate(process_names):
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": name}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, category in enumerate(CATEGORIES):
            meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": category}})
    shifted = [{**e, "ts": round(e["ts"] - origin, 3), "dur": round(e["dur"], 3)} for e in events]
    shifted.sort(key=lambda e: (e["pid"], e["ts"]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps({"traceEvents": meta + shifted, "displayTimeUnit": "ms"}))
    return path


# -- per-op tables: measured (from trace.json) and simulated (from a SimResult) ---------------------------


def trace_ops(trace: str | Path | Mapping, step: int) -> pd.DataFrame:
    """One step of a trace.json as the per-op table (`OPS_COLUMNS`): one row per rank, op ("F" / "B",
    and "W" for ZB-H1's weight-gradient spans, `W_SPAN`) and microbatch id; start_s / end_s from the step's first forward (the simulator's time 0);
    busy_s the op's summed span time (a colocated stage's forward is two spans: vision tower, LLM).
    A stage is its index in the chain (vision stages first), as the simulator's rows count them."""
    doc = json.loads(Path(trace).read_text()) if isinstance(trace, (str, Path)) else trace
    rows = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in OP_KIND
            and e["args"].get("step") == step]
    if not rows:
        raise UserError(f"trace: no forward or backward spans of step {step} (traced steps: "
                        f"{sorted({e['args']['step'] for e in doc['traceEvents'] if e.get('ph') == 'X'})})")
    frame = pd.DataFrame({
        "rank": [e["pid"] for e in rows], "stage": [e["args"]["stage"] for e in rows],
        "stage_name": [e["args"]["stage_name"] for e in rows], "replica": [e["args"]["replica"] for e in rows],
        "tp_rank": [e["args"]["tp_rank"] for e in rows], "op": [_op_kind(e) for e in rows],
        "microbatch": [e["args"]["microbatch"] for e in rows],
        "start_s": [e["ts"] / 1e6 for e in rows], "end_s": [(e["ts"] + e["dur"]) / 1e6 for e in rows],
        "busy_s": [e["dur"] / 1e6 for e in rows]})
    keys = ["rank", "stage", "stage_name", "replica", "tp_rank", "op", "microbatch"]
    ops = frame.groupby(keys, as_index=False).agg(start_s=("start_s", "min"), end_s=("end_s", "max"),
                                                  busy_s=("busy_s", "sum"))
    zero = ops.loc[ops["op"] == "F", "start_s"].min()
    ops[["start_s", "end_s"]] -= zero
    return ops.sort_values(["stage", "replica", "tp_rank", "start_s"], ignore_index=True)[list(OPS_COLUMNS)]


def _op_kind(event: Mapping) -> str:
    """A forward/backward span's op: "F", "B", or "W" (a split backward's weight gradients)."""
    return "W" if event["cat"] == "backward" and event["name"] == W_SPAN else OP_KIND[event["cat"]]


def simulated_ops(result) -> pd.DataFrame:
    """A `dflop.sim.pipeline.SimResult` as the same per-op table (one row per device row, op and
    microbatch id; rank and tp_rank are -1: the simulator has no ranks; stage names as metrics.parquet's).
    Under a split-backward schedule "B" is the input gradient and "W" the weight gradient (rows
    whose backward is not split, the vision stages', have no W)."""
    n_v = result.n_vision_stages
    records = []
    kinds = [("F", result.fwd_start, result.fwd_end), ("B", result.bwd_start, result.bwd_end)]
    if result.w_start is not None:
        kinds.append(("W", result.w_start, result.w_end))
    for row, (stage, replica) in enumerate(zip(result.row_stage, result.row_replica)):
        stage = int(stage)
        name = f"vision{stage}" if stage < n_v else f"llm{stage - n_v}"
        for op, start, end in kinds:
            for j in range(start.shape[1]):
                if np.isnan(start[row, j]):
                    continue  # no W on this row
                records.append((-1, stage, name, int(replica), -1, op, j, float(start[row, j]), float(end[row, j]),
                                float(end[row, j] - start[row, j])))
    ops = pd.DataFrame.from_records(records, columns=list(OPS_COLUMNS))
    return ops.sort_values(["stage", "replica", "start_s"], ignore_index=True)


def op_differences(measured: pd.DataFrame, simulated: pd.DataFrame) -> pd.DataFrame:
    """Measured minus simulated per op (start, end, duration), matched on (stage, replica, op,
    microbatch); a stage with several TP ranks is taken at its slowest one (the op ends when the last does)."""
    keys = ["stage", "replica", "op", "microbatch"]
    slowest = measured.groupby(keys, as_index=False).agg(start_s=("start_s", "min"), end_s=("end_s", "max"))
    both = slowest.merge(simulated[keys + ["start_s", "end_s"]], on=keys, suffixes=("_measured", "_simulated"))
    both["start_diff_s"] = both["start_s_measured"] - both["start_s_simulated"]
    both["end_diff_s"] = both["end_s_measured"] - both["end_s_simulated"]
    both["dur_diff_s"] = ((both["end_s_measured"] - both["start_s_measured"])
                          - (both["end_s_simulated"] - both["start_s_simulated"]))
    return both


def makespan(ops: pd.DataFrame) -> float:
    """First forward's start to last backward's end of a per-op table (seconds)."""
    return float(ops["end_s"].max() - ops["start_s"].min()) if len(ops) else float("nan")


