"""Discrete-event simulation of one training step through a pipeline (1F1B or GPipe).

Each device row (a pipeline stage, or one data-parallel replica of a stage) executes its forward
(F) and backward (B) ops in the fixed order the schedule prescribes; an op starts when the previous
op on its row has ended and its inputs have arrived. Because the order per row is static, the
step is the longest path through that dependency graph, evaluated once in topological order — an
exact simulation in O(#ops), with no event queue.

Data parallelism: stage ``s`` may have ``R_s`` replicas. Between two stages with the same replica
count, replica ``r`` feeds replica ``r``; otherwise every replica of one stage feeds every replica
of the next (this is how the shared vision stages feed the LLM replicas: microbatch ``j``'s vision
output is scattered to all LLM replicas, and its vision backward waits for the gradients of all of
them). All replicas of a stage share one microbatch order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class SimResult:
    """Exact timeline of one step. Times in seconds from the step's start.

    Attributes:
        fwd_start, fwd_end, bwd_start, bwd_end: [rows, M] op times; column ``j`` is microbatch id
            ``j`` (the id in the caller's input, whatever position ``order`` ran it at).
        row_stage, row_replica: [rows] which stage and which replica each row is.
        n_vision_stages: how many leading stages are vision stages (0 for a plain pipeline); only
            used for labels.
        order: [M] microbatch ids in execution order.
        schedule: "1f1b" or "gpipe".
        makespan_s: end of the last backward op.
        allreduce_s: [stages] seconds added after each stage's last backward (gradient all-reduce,
            and the optimizer step where the pricing measured one: `dflop.pricing.tail.stage_tail_s`).
        step_s: makespan including all-reduce: max over stages of (last backward end + all-reduce).
        busy_s: [rows] seconds each row computes; idle_s: [rows] = makespan_s - busy_s.
    """

    fwd_start: np.ndarray
    fwd_end: np.ndarray
    bwd_start: np.ndarray
    bwd_end: np.ndarray
    row_stage: np.ndarray
    row_replica: np.ndarray
    n_vision_stages: int
    order: np.ndarray
    schedule: str
    makespan_s: float
    allreduce_s: np.ndarray
    step_s: float
    busy_s: np.ndarray
    idle_s: np.ndarray

    @property
    def n_stages(self) -> int:
        return int(self.row_stage.max()) + 1

    @property
    def n_microbatches(self) -> int:
        return int(self.fwd_start.shape[1])

    def idle_fraction(self) -> float:
        """Share of device-seconds spent idle during the makespan (pipeline bubble + imbalance)."""
        return float(self.idle_s.sum() / (self.makespan_s * len(self.idle_s)))


def stage_op_order(schedule: str, stage: int, n_stages: int, m: int) -> list[tuple[int, int]]:
    """Static op order of one stage as (kind, position) pairs; kind 0 = forward, 1 = backward.

    1F1B: ``min(p - s - 1, m)`` warm-up forwards, then alternate one forward / one backward,
    then the remaining backwards. GPipe: all forwards, then all backwards.
    """
    if schedule == "gpipe":
        return [(0, j) for j in range(m)] + [(1, j) for j in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    warmup = min(n_stages - stage - 1, m)
    ops = [(0, j) for j in range(warmup)]
    for i in range(m - warmup):
        ops.append((0, warmup + i))
        ops.append((1, i))
    ops.extend((1, j) for j in range(m - warmup, m))
    return ops


@dataclass(frozen=True)
class _Plan:
    """The dependency graph of one (replicas per stage, m, schedule), in topological order.

    Op id = row * 2m + kind * m + position. For every op in ``topo``: ``device_prev`` (op id or -1)
    and ``inputs`` (op ids whose end plus p2p latency gate it; ``local_input`` is gated without
    latency: the last stage's own forward before its backward).
    """

    topo: tuple[int, ...]
    device_prev: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    local_input: tuple[int, ...]
    row_stage: np.ndarray
    row_replica: np.ndarray


def _feeders(stage_replicas: tuple[int, ...], row_of: list[list[int]], src: int, dst_r: int,
             dst: int) -> tuple[int, ...]:
    """Rows of stage ``src`` that send to replica ``dst_r`` of stage ``dst``."""
    if stage_replicas[src] == stage_replicas[dst]:
        return (row_of[src][dst_r],)
    return tuple(row_of[src])


@lru_cache(maxsize=256)
def _compile(stage_replicas: tuple[int, ...], m: int, schedule: str) -> _Plan:
    p = len(stage_replicas)
    row_of: list[list[int]] = []
    row_stage, row_replica = [], []
    for s, reps in enumerate(stage_replicas):
        row_of.append(list(range(len(row_stage), len(row_stage) + reps)))
        row_stage.extend([s] * reps)
        row_replica.extend(range(reps))
    n_rows = len(row_stage)
    n_ops = n_rows * 2 * m
    device_prev = [-1] * n_ops
    inputs: list[tuple[int, ...]] = [()] * n_ops
    local_input = [-1] * n_ops

    def op_id(row: int, kind: int, j: int) -> int:
        return row * 2 * m + kind * m + j

    for row in range(n_rows):
        s, r = row_stage[row], row_replica[row]
        prev = -1
        for kind, j in stage_op_order(schedule, s, p, m):
            op = op_id(row, kind, j)
            device_prev[op] = prev
            prev = op
            if kind == 0 and s > 0:
                inputs[op] = tuple(op_id(x, 0, j) for x in _feeders(stage_replicas, row_of, s - 1, r, s))
            elif kind == 1 and s < p - 1:
                inputs[op] = tuple(op_id(x, 1, j) for x in _feeders(stage_replicas, row_of, s + 1, r, s))
            elif kind == 1:
                local_input[op] = op_id(row, 0, j)

    # Kahn's algorithm; ties broken by op id so the order is reproducible.
    succ: list[list[int]] = [[] for _ in range(n_ops)]
    indeg = [0] * n_ops
    for op in range(n_ops):
        for d in (device_prev[op], local_input[op], *inputs[op]):
            if d >= 0:
                succ[d].append(op)
                indeg[op] += 1
    ready = [op for op in range(n_ops) if indeg[op] == 0]
    topo: list[int] = []
    while ready:
        op = ready.pop()
        topo.append(op)
        for nxt in succ[op]:
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                ready.append(nxt)
    if len(topo) != n_ops:  # cannot happen for 1F1B/GPipe; guards future schedules
        raise RuntimeError(f"schedule {schedule} deadlocks for stages {stage_replicas}, m={m}")
    return _Plan(tuple(topo), tuple(device_prev), tuple(inputs), tuple(local_input),
                 np.asarray(row_stage), np.asarray(row_replica))


def _check_order(order, m: int) -> np.ndarray:
    if order is None:
        return np.arange(m)
    order = np.asarray(order, dtype=np.int64)
    if order.shape != (m,) or not np.array_equal(np.sort(order), np.arange(m)):
        raise ValueError(f"order must be a permutation of range({m}), got {order.tolist()}")
    return order


def simulate_rows(fwd: np.ndarray, bwd: np.ndarray, stage_replicas: tuple[int, ...], *,
                  schedule: str = "1f1b", p2p_s: float = 0.0, order=None, allreduce_s=0.0,
                  n_vision_stages: int = 0) -> SimResult:
    """Simulate a pipeline whose stage ``s`` has ``stage_replicas[s]`` replica rows.

    Args:
        fwd, bwd: [rows, M] seconds of each microbatch's forward/backward on each row, rows listed
            stage by stage (all replicas of stage 0, then stage 1, ...).
        stage_replicas: replicas per stage; sum must equal rows.
        schedule: "1f1b" or "gpipe".
        p2p_s: seconds between a stage finishing an op and the next stage receiving its tensor.
        order: [M] microbatch ids in execution order (default 0..M-1).
        allreduce_s: gradient all-reduce seconds, a scalar or one per stage.
    """
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    stage_replicas = tuple(int(r) for r in stage_replicas)
    if fwd.ndim != 2 or fwd.shape != bwd.shape:
        raise ValueError(f"fwd and bwd must both be [rows, M], got {fwd.shape} and {bwd.shape}")
    if sum(stage_replicas) != fwd.shape[0] or min(stage_replicas, default=0) < 1:
        raise ValueError(f"stage_replicas {stage_replicas} do not add up to {fwd.shape[0]} rows")
    if not (np.isfinite(fwd).all() and np.isfinite(bwd).all()) or (fwd < 0).any() or (bwd < 0).any():
        raise ValueError("op times must be finite and non-negative seconds")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    m = fwd.shape[1]
    n_rows = fwd.shape[0]
    order = _check_order(order, m)
    allreduce = np.broadcast_to(np.asarray(allreduce_s, dtype=np.float64), (len(stage_replicas),))
    plan = _compile(stage_replicas, m, schedule)

    # Durations by op id, with positions mapped through the execution order.
    dur = np.empty((n_rows, 2, m))
    dur[:, 0, :] = fwd[:, order]
    dur[:, 1, :] = bwd[:, order]
    dur_l = dur.ravel().tolist()
    end = [0.0] * len(dur_l)
    start = [0.0] * len(dur_l)
    dev, inp, loc = plan.device_prev, plan.inputs, plan.local_input
    lat = float(p2p_s)
    for op in plan.topo:
        t = end[dev[op]] if dev[op] >= 0 else 0.0
        for d in inp[op]:
            e = end[d] + lat
            if e > t:
                t = e
        d = loc[op]
        if d >= 0 and end[d] > t:
            t = end[d]
        start[op] = t
        end[op] = t + dur_l[op]

    start_a = np.asarray(start).reshape(n_rows, 2, m)
    end_a = np.asarray(end).reshape(n_rows, 2, m)
    inv = np.empty(m, dtype=np.int64)
    inv[order] = np.arange(m)  # column of microbatch id j in the position-indexed arrays
    makespan = float(end_a.max()) if end_a.size else 0.0
    row_last = end_a.max(axis=(1, 2))
    step = float(np.max(row_last + allreduce[plan.row_stage])) if n_rows else 0.0
    busy = dur.sum(axis=(1, 2))
    return SimResult(
        fwd_start=start_a[:, 0, inv], fwd_end=end_a[:, 0, inv],
        bwd_start=start_a[:, 1, inv], bwd_end=end_a[:, 1, inv],
        row_stage=plan.row_stage, row_replica=plan.row_replica,
        n_vision_stages=int(n_vision_stages), order=order, schedule=schedule,
        makespan_s=makespan, allreduce_s=np.array(allreduce), step_s=step,
        busy_s=busy, idle_s=makespan - busy,
    )


def simulate(fwd, bwd, schedule: str = "1f1b", p2p_s: float = 0.0, order=None,
             allreduce_s=0.0) -> SimResult:
    """Simulate one pipeline (one replica per stage).

    Args:
        fwd, bwd: [S, M] seconds of microbatch ``j``'s forward/backward on stage ``s``.
        schedule: "1f1b" or "gpipe"; p2p_s: seconds per stage-to-stage transfer;
        order: [M] microbatch ids in execution order; allreduce_s: scalar or [S] seconds.
    """
    fwd = np.asarray(fwd, dtype=np.float64)
    if fwd.ndim != 2:
        raise ValueError(f"fwd must be [S, M], got shape {fwd.shape}")
    return simulate_rows(fwd, bwd, (1,) * fwd.shape[0], schedule=schedule, p2p_s=p2p_s,
                         order=order, allreduce_s=allreduce_s)


def _dp_rows(vision: np.ndarray, llm: np.ndarray) -> np.ndarray:
    """Rows of a coupled vision + LLM-replica pipeline: vision stages, then LLM stage 0 replicas
    0..R-1, stage 1 replicas, ... ``vision`` is [..., Sv, M], ``llm`` [..., R, Sl, M]."""
    *lead, n_rep, n_llm, m = llm.shape
    llm_rows = np.swapaxes(llm, -3, -2).reshape(*lead, n_llm * n_rep, m)
    return np.concatenate([vision.reshape(*lead, -1, m), llm_rows], axis=-2)


def simulate_dp(vision_fwd, vision_bwd, llm_fwd, llm_bwd, *, schedule: str = "1f1b",
                p2p_s: float = 0.0, order=None, allreduce_s=0.0) -> SimResult:
    """Simulate vision stages shared by ``R`` LLM data-parallel replicas, coupled exactly.

    The vision stages' data-parallel replicas split each microbatch evenly, so each vision stage
    is one row whose times are already divided over its replicas. Microbatch ``j``'s first LLM
    stage waits for the last vision stage's forward; the last vision stage's backward of ``j``
    waits for the first LLM stage of every replica. This is never faster than simulating each
    replica alone and taking the max, and slower when replicas are out of step.

    Args:
        vision_fwd, vision_bwd: [Sv, M] seconds per vision stage and microbatch (Sv may be 0).
        llm_fwd, llm_bwd: [R, Sl, M] seconds per LLM replica, stage and microbatch.
        allreduce_s: scalar or [Sv + Sl] seconds of gradient all-reduce per stage.
    """
    llm_fwd = np.asarray(llm_fwd, dtype=np.float64)
    llm_bwd = np.asarray(llm_bwd, dtype=np.float64)
    if llm_fwd.ndim != 3 or llm_fwd.shape != llm_bwd.shape:
        raise ValueError(f"llm_fwd and llm_bwd must be [R, Sl, M], got {llm_fwd.shape} and {llm_bwd.shape}")
    n_rep, n_llm, m = llm_fwd.shape
    vision_fwd = np.asarray(vision_fwd, dtype=np.float64).reshape(-1, m)
    vision_bwd = np.asarray(vision_bwd, dtype=np.float64).reshape(-1, m)
    n_vis = vision_fwd.shape[0]
    return simulate_rows(_dp_rows(vision_fwd, llm_fwd), _dp_rows(vision_bwd, llm_bwd),
                         (1,) * n_vis + (n_rep,) * n_llm, schedule=schedule,
                         p2p_s=p2p_s, order=order, allreduce_s=allreduce_s,
                         n_vision_stages=n_vis)


def simulate_dp_steps(vision_fwd, vision_bwd, llm_fwd, llm_bwd, orders, *, schedule: str = "1f1b",
                      p2p_s: float = 0.0, allreduce_s=0.0) -> np.ndarray:
    """Step seconds of C candidates at once: ``simulate_dp(...).step_s`` of each, bit for bit.

    Candidates (different assignments, different orders) share the layout, so they share the
    schedule's dependency graph; walking it once with a vector of C times per op costs about as
    much Python as one scalar simulation. This is what makes scoring every portfolio member in
    every candidate order cheap.

    Args:
        vision_fwd, vision_bwd: [C, Sv, M]; llm_fwd, llm_bwd: [C, R, Sl, M] seconds.
        orders: [C, M] microbatch ids in execution order, one order per candidate.
        allreduce_s: scalar or [Sv + Sl] seconds, as in `simulate_dp`.
    """
    llm_fwd = np.asarray(llm_fwd, dtype=np.float64)
    llm_bwd = np.asarray(llm_bwd, dtype=np.float64)
    if llm_fwd.ndim != 4 or llm_fwd.shape != llm_bwd.shape:
        raise ValueError(f"llm_fwd and llm_bwd must be [C, R, Sl, M], got {llm_fwd.shape} and {llm_bwd.shape}")
    n_cand, n_rep, n_llm, m = llm_fwd.shape
    vision_fwd = np.asarray(vision_fwd, dtype=np.float64).reshape(n_cand, -1, m)
    vision_bwd = np.asarray(vision_bwd, dtype=np.float64).reshape(n_cand, -1, m)
    n_vis = vision_fwd.shape[1]
    fwd, bwd = _dp_rows(vision_fwd, llm_fwd), _dp_rows(vision_bwd, llm_bwd)
    if not (np.isfinite(fwd).all() and np.isfinite(bwd).all()) or (fwd < 0).any() or (bwd < 0).any():
        raise ValueError("op times must be finite and non-negative seconds")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    orders = np.asarray(orders, dtype=np.int64)
    if orders.shape != (n_cand, m) or not (np.sort(orders, axis=1) == np.arange(m)).all():
        raise ValueError(f"orders must be {n_cand} permutations of range({m}), got shape {orders.shape}")
    stage_replicas = (1,) * n_vis + (n_rep,) * n_llm
    allreduce = np.broadcast_to(np.asarray(allreduce_s, dtype=np.float64), (len(stage_replicas),))
    plan = _compile(stage_replicas, m, schedule)
    n_rows = fwd.shape[1]

    # dur[op, c]: op ids as in simulate_rows ((row, F/B, position) raveled), candidates last.
    idx = np.broadcast_to(orders[:, None, :], fwd.shape)
    dur = np.stack([np.take_along_axis(fwd, idx, axis=2), np.take_along_axis(bwd, idx, axis=2)], axis=2)
    dur = np.ascontiguousarray(dur.reshape(n_cand, -1).T)
    end = np.zeros_like(dur)
    zero = np.zeros(n_cand)
    dev, inp, loc = plan.device_prev, plan.inputs, plan.local_input
    lat = float(p2p_s)
    for op in plan.topo:
        t = end[dev[op]] if dev[op] >= 0 else zero
        for d in inp[op]:
            t = np.maximum(t, end[d] + lat)
        d = loc[op]
        if d >= 0:
            t = np.maximum(t, end[d])
        np.add(t, dur[op], out=end[op])
    row_last = end.reshape(n_rows, 2 * m, n_cand).max(axis=1)          # [rows, C]
    return (row_last + allreduce[plan.row_stage][:, None]).max(axis=0)
