"""Discrete-event simulation of one training step through a pipeline.

Each row (a pipeline stage, or one data-parallel replica of a stage) has forward (F) and backward
(B) ops per microbatch, and under a split-backward schedule also a weight-gradient op (W). Each
device executes its rows' ops in the fixed order the schedule prescribes (`dflop.sim.schedules`:
1F1B, GPipe, interleaved 1F1B, ZB-H1); an op starts when the previous op on its device has ended
and its inputs have arrived. Because the order per device is static, the step is the longest path
through that dependency graph, evaluated once in topological order — an exact simulation in
O(#ops), with no event queue.

A device is one row, except under interleaved 1F1B (``chunks = v``): the LLM's ``p * v`` stages
are model chunks, and chunk ``c`` runs on LLM rank ``c mod p``, so ``v`` rows share one device.
Vision stages (the first ``n_vision_stages``) always run an unsplit backward in 1F1B order (GPipe
under ``gpipe``), timed to the LLM's first stage (`_device_orders`).

Data parallelism: stage ``s`` may have ``R_s`` replicas. Between two stages with the same replica
count, replica ``r`` feeds replica ``r``; otherwise every replica of one stage feeds every replica
of the next (this is how the shared vision stages feed the LLM replicas: microbatch ``j``'s vision
output is scattered to all LLM replicas, and its vision backward waits for the gradients of all of
them). All replicas of a stage share one microbatch order.

Split backward (``zb-h1``): the caller gives the whole backward (``bwd``, what the cost model's
``bwd_ms`` prices) and ``wgrad_frac``, the share of it that computes weight gradients (W: each
linear layer's ``dW = X^T dY``); B is the rest (``dX = dY W^T`` and every op without weights, such
as the attention core), and only B is on the path to the previous stage. The default 0.5 is a
stage of linear layers only, whose two backward GEMMs cost the same FLOPs; attention and norms
move real stages below it, so the planner should pass the cost model's own share.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dflop.sim.schedules import (B, F, SCHEDULES, SPLIT_BACKWARD, W, first_chunk_peak, llm_rank_op_order,
                                  stage_op_order, vision_op_order)


@dataclass(frozen=True)
class SimResult:
    """Exact timeline of one step. Times in seconds from the step's start.

    Attributes:
        fwd_start, fwd_end, bwd_start, bwd_end: [rows, M] op times; column ``j`` is microbatch id
            ``j`` (the id in the caller's input, whatever position ``order`` ran it at). Under a
            split-backward schedule ``bwd_*`` are the B (input-gradient) ops.
        w_start, w_end: [rows, M] times of the W (weight-gradient) ops under a split-backward
            schedule, NaN on rows whose backward is not split (vision stages); None otherwise.
        row_stage, row_replica: [rows] which stage (model chunk under interleaving: the virtual
            stage) and which replica each row is.
        row_device: [rows] the device each row runs on (one row per device unless ``chunks > 1``).
        n_vision_stages: how many leading stages are vision stages (0 for a plain pipeline).
        chunks: model chunks per LLM device (``v`` of interleaved 1F1B, else 1).
        order: [M] microbatch ids in execution order.
        schedule: one of `SCHEDULES`.
        makespan_s: end of the last backward op.
        allreduce_s: [stages] seconds added after each stage's last backward (gradient all-reduce,
            and the optimizer step where the pricing measured one: `dflop.pricing.tail.stage_tail_s`).
        step_s: makespan including all-reduce: max over stages of (last backward end + all-reduce).
        busy_s: [rows] seconds each row's ops compute; idle_s: [rows] seconds the row's device is
            idle during the makespan (``makespan_s - busy_s`` when a device has one row).
        in_flight: [rows] the most microbatches whose forward on the row has run and whose
            backward (B) has not: the activations the row holds at its peak, in microbatches.
        device_in_flight: [devices] the same counted over all rows of a device (under interleaving
            the peak of the sum over the rank's chunks, not the sum of their peaks).
        wgrad_pending: [rows] the most microbatches whose B has run and whose W has not (what a
            split backward keeps for W: the weights' inputs and output gradients); 0 without split.
    """

    fwd_start: np.ndarray
    fwd_end: np.ndarray
    bwd_start: np.ndarray
    bwd_end: np.ndarray
    w_start: np.ndarray | None
    w_end: np.ndarray | None
    row_stage: np.ndarray
    row_replica: np.ndarray
    row_device: np.ndarray
    n_vision_stages: int
    chunks: int
    order: np.ndarray
    schedule: str
    makespan_s: float
    allreduce_s: np.ndarray
    step_s: float
    busy_s: np.ndarray
    idle_s: np.ndarray
    in_flight: np.ndarray
    device_in_flight: np.ndarray
    wgrad_pending: np.ndarray

    @property
    def n_stages(self) -> int:
        return int(self.row_stage.max()) + 1

    @property
    def n_microbatches(self) -> int:
        return int(self.fwd_start.shape[1])

    @property
    def n_devices(self) -> int:
        return int(self.row_device.max()) + 1

    def idle_fraction(self) -> float:
        """Share of device-seconds spent idle during the makespan (pipeline bubble + imbalance)."""
        _, first_row = np.unique(self.row_device, return_index=True)
        return float(self.idle_s[first_row].sum() / (self.makespan_s * len(first_row)))


@dataclass(frozen=True)
class _Plan:
    """The dependency graph of one (replicas per stage, m, schedule, chunks), in topological order.

    Op id = row * K m + kind * m + position, K = 3 kinds (F, B, W) under a split-backward schedule,
    else 2. For every op in ``topo``: ``device_prev`` (op id or -1), ``inputs`` (op ids on other
    devices, gated by their end plus the p2p latency) and ``local_inputs`` (op ids on the same
    device, gated by their end: the last stage's own forward before its backward, B before W, a
    chunk's input from a chunk of the same rank). W ops of rows whose backward is not split are
    not in ``topo``.
    """

    topo: tuple[int, ...]
    device_prev: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    local_inputs: tuple[tuple[int, ...], ...]
    row_stage: np.ndarray
    row_replica: np.ndarray
    row_device: np.ndarray
    n_kinds: int
    split_rows: np.ndarray
    in_flight: np.ndarray
    device_in_flight: np.ndarray
    wgrad_pending: np.ndarray


def _feeders(stage_replicas: tuple[int, ...], row_of: list[list[int]], src: int, dst_r: int,
             dst: int) -> tuple[int, ...]:
    """Rows of stage ``src`` that send to replica ``dst_r`` of stage ``dst``."""
    if stage_replicas[src] == stage_replicas[dst]:
        return (row_of[src][dst_r],)
    return tuple(row_of[src])


def _llm_ranks(stage_replicas: tuple[int, ...], schedule: str, n_vision_stages: int, chunks: int) -> int:
    """Pipeline ranks of the LLM part (stages after the vision stages), after checking the layout."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    n_llm = len(stage_replicas) - n_vision_stages
    if not 0 <= n_vision_stages < len(stage_replicas):
        raise ValueError(f"n_vision_stages {n_vision_stages} must leave at least one of the "
                         f"{len(stage_replicas)} stages to the LLM")
    if schedule != "interleaved":
        if chunks != 1:
            raise ValueError(f"schedule {schedule!r} runs one model chunk per device, got chunks={chunks}")
        return n_llm
    if n_llm % chunks:
        raise ValueError(f"interleaved: {n_llm} LLM stages are not {chunks} chunks per rank")
    if len(set(stage_replicas[n_vision_stages:])) != 1:
        raise ValueError("interleaved: every LLM chunk needs the same replica count (a rank holds all its chunks)")
    return n_llm // chunks


def _device_orders(stage_replicas: tuple[int, ...], row_of: list[list[int]], m: int, schedule: str,
                   n_vision_stages: int, chunks: int) -> tuple[list[int], list[list[tuple[int, int, int]]]]:
    """Each row's device and each device's ops as (row, kind, position), in execution order.

    The LLM stages run ``schedule``. Vision stages keep an unsplit backward and run 1F1B (GPipe
    under ``gpipe``) timed to the LLM: vision stage ``g`` of ``Sv`` warms up with ``D + Sv - g - 1``
    forwards, ``D`` = the peak microbatches in flight on the LLM's first stage (its first chunk on
    rank 0). That is 1F1B's own rule between consecutive stages (a stage warms up with as many
    forwards as the next stage holds in flight at its peak), so under plain 1F1B it is 1F1B over
    the whole pipeline. It cannot deadlock: before its backward of microbatch ``i`` a vision stage
    has run ``D + i + 1`` forwards, at least as many as the LLM's first stage runs before its own
    backward of ``i`` (``D - 1`` would be the fewest that never deadlock).
    """
    n_vis = n_vision_stages
    p = _llm_ranks(stage_replicas, schedule, n_vis, chunks)
    # Device of each row: vision rows and non-interleaved rows are one device each; under
    # interleaving the rows of chunks r, r + p, ... of replica q share rank r's device.
    key_of_row = []
    for g, reps in enumerate(stage_replicas):
        for q in range(reps):
            key_of_row.append((g, q) if g < n_vis else (n_vis + (g - n_vis) % p, q))
    device_of_key: dict[tuple[int, int], int] = {}
    row_device = [device_of_key.setdefault(k, len(device_of_key)) for k in key_of_row]
    orders: list[list[tuple[int, int, int]]] = [[] for _ in device_of_key]

    for r in range(p):
        g0 = n_vis + r
        chunk_ops = llm_rank_op_order(schedule, r, p, m, chunks)
        if r == 0:
            lead = first_chunk_peak(chunk_ops)
        for q in range(stage_replicas[g0]):
            device = row_device[row_of[g0][q]]
            orders[device] = [(row_of[g0 + k * p][q], kind, j) for kind, k, j in chunk_ops]

    for g in range(n_vis):
        ops = vision_op_order(schedule, g, n_vis, lead, m)
        for row in row_of[g]:
            orders[row_device[row]] = [(row, kind, j) for kind, j in ops]
    return row_device, orders


@lru_cache(maxsize=256)
def _compile(stage_replicas: tuple[int, ...], m: int, schedule: str, n_vision_stages: int = 0,
             chunks: int = 1) -> _Plan:
    n_stages = len(stage_replicas)
    row_of: list[list[int]] = []
    row_stage, row_replica = [], []
    for s, reps in enumerate(stage_replicas):
        row_of.append(list(range(len(row_stage), len(row_stage) + reps)))
        row_stage.extend([s] * reps)
        row_replica.extend(range(reps))
    row_device, orders = _device_orders(stage_replicas, row_of, m, schedule, n_vision_stages, chunks)
    n_rows = len(row_stage)
    split = schedule in SPLIT_BACKWARD
    split_rows = [split and row_stage[row] >= n_vision_stages for row in range(n_rows)]
    n_kinds = 3 if split else 2
    n_ops = n_rows * n_kinds * m
    device_prev = [-1] * n_ops
    inputs: list[tuple[int, ...]] = [()] * n_ops
    local_inputs: list[tuple[int, ...]] = [()] * n_ops

    def op_id(row: int, kind: int, j: int) -> int:
        return row * n_kinds * m + kind * m + j

    def gate(op: int, kind: int, j: int, rows: tuple[int, ...], device: int) -> None:
        """``op`` waits for ``kind`` of position ``j`` on ``rows``: local if on its own device."""
        inputs[op] = tuple(op_id(x, kind, j) for x in rows if row_device[x] != device)
        local_inputs[op] = tuple(op_id(x, kind, j) for x in rows if row_device[x] == device)

    in_flight = [0] * n_rows
    wgrad_pending = [0] * n_rows
    device_in_flight = [0] * len(orders)
    for device, ops in enumerate(orders):
        prev = -1
        live = [0] * n_rows
        pending = [0] * n_rows
        total = 0
        for row, kind, j in ops:
            s, r = row_stage[row], row_replica[row]
            op = op_id(row, kind, j)
            device_prev[op] = prev
            prev = op
            if kind == F and s > 0:
                gate(op, F, j, _feeders(stage_replicas, row_of, s - 1, r, s), device)
            elif kind == B and s < n_stages - 1:
                gate(op, B, j, _feeders(stage_replicas, row_of, s + 1, r, s), device)
            elif kind == B:
                local_inputs[op] = (op_id(row, F, j),)
            elif kind == W:
                local_inputs[op] = (op_id(row, B, j),)
            # Activations held: forward done, backward (B) not yet; W's inputs: B done, W not yet.
            step = (kind == F) - (kind == B)
            live[row] += step
            total += step
            pending[row] += (kind == B and split_rows[row]) - (kind == W)
            in_flight[row] = max(in_flight[row], live[row])
            wgrad_pending[row] = max(wgrad_pending[row], pending[row])
            device_in_flight[device] = max(device_in_flight[device], total)

    # Kahn's algorithm; ties broken by op id so the order is reproducible.
    scheduled = [op_id(row, kind, j) for ops in orders for row, kind, j in ops]
    succ: dict[int, list[int]] = {op: [] for op in scheduled}
    indeg = dict.fromkeys(scheduled, 0)
    for op in scheduled:
        for d in (device_prev[op], *local_inputs[op], *inputs[op]):
            if d >= 0:
                succ[d].append(op)
                indeg[op] += 1
    ready = [op for op in scheduled if indeg[op] == 0]
    topo: list[int] = []
    while ready:
        op = ready.pop()
        topo.append(op)
        for nxt in succ[op]:
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                ready.append(nxt)
    if len(topo) != len(scheduled):  # a schedule whose orders wait on each other in a cycle
        raise RuntimeError(f"schedule {schedule} deadlocks for stages {stage_replicas}, m={m}")
    return _Plan(tuple(topo), tuple(device_prev), tuple(inputs), tuple(local_inputs),
                 np.asarray(row_stage), np.asarray(row_replica), np.asarray(row_device), n_kinds,
                 np.asarray(split_rows), np.asarray(in_flight), np.asarray(device_in_flight),
                 np.asarray(wgrad_pending))


_LEVELS: dict[int, tuple[_Plan, list]] = {}


def _levels(plan: _Plan, n_ops: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]]:
    """`plan`'s ops grouped by depth in its dependency graph (an op's level is one more than its
    deepest predecessor's), so `simulate_dp_steps` times a whole level with a few numpy calls
    instead of a few per op. Per level: (ops, device predecessor, [ops, k] inputs on other devices,
    [ops, k] local inputs); row ``n_ops`` stands for "no device predecessor" (end 0) and
    ``n_ops + 1`` pads the input lists (end -inf), None where no op of the level has such inputs.
    The same maxima and sums as the op-by-op walk (max is exact, and ``max(e) + lat`` equals
    ``max(e + lat)`` because rounding is monotone), so the same bits. Cached beside `_compile`'s
    plans (keyed by the plan's identity, which the entry keeps alive)."""
    hit = _LEVELS.get(id(plan))
    if hit is not None and hit[0] is plan:
        return hit[1]
    level = [0] * n_ops
    by_level: list[list[int]] = []
    dev, inp, loc = plan.device_prev, plan.inputs, plan.local_inputs
    for op in plan.topo:
        lv = 0
        for d in (dev[op], *inp[op], *loc[op]):
            if d >= 0 and level[d] + 1 > lv:
                lv = level[d] + 1
        level[op] = lv
        if lv == len(by_level):
            by_level.append([])
        by_level[lv].append(op)

    def padded(ops, lists):
        k = max(len(lists[op]) for op in ops)
        if k == 0:
            return None
        out = np.full((len(ops), k), n_ops + 1, dtype=np.int64)
        for i, op in enumerate(ops):
            out[i, :len(lists[op])] = lists[op]
        return out

    levels = [(np.array(ops, dtype=np.int64), np.array([dev[op] if dev[op] >= 0 else n_ops for op in ops], dtype=np.int64),
               padded(ops, inp), padded(ops, loc)) for ops in by_level]
    if len(_LEVELS) >= 256:
        _LEVELS.clear()
    _LEVELS[id(plan)] = (plan, levels)
    return levels


def _check_order(order, m: int) -> np.ndarray:
    if order is None:
        return np.arange(m)
    order = np.asarray(order, dtype=np.int64)
    if order.shape != (m,) or not np.array_equal(np.sort(order), np.arange(m)):
        raise ValueError(f"order must be a permutation of range({m}), got {order.tolist()}")
    return order


def _check_times(fwd: np.ndarray, bwd: np.ndarray, wgrad_frac, schedule: str) -> np.ndarray:
    """Validate op seconds and the schedule name; return ``wgrad_frac`` broadcast to ``fwd``'s shape."""
    if not (np.isfinite(fwd).all() and np.isfinite(bwd).all()) or (fwd < 0).any() or (bwd < 0).any():
        raise ValueError("op times must be finite and non-negative seconds")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    frac = np.asarray(wgrad_frac, dtype=np.float64)
    if not (np.isfinite(frac).all() and (frac >= 0).all() and (frac <= 1).all()):
        raise ValueError("wgrad_frac must be a share of the backward, between 0 and 1")
    try:
        return np.broadcast_to(frac, fwd.shape)
    except ValueError:
        raise ValueError(f"wgrad_frac of shape {frac.shape} does not broadcast to the op times' "
                         f"{fwd.shape}") from None


def _op_durations(fwd: np.ndarray, bwd: np.ndarray, frac: np.ndarray, plan: _Plan,
                  orders: np.ndarray) -> np.ndarray:
    """[C, rows, K, M] seconds of each op kind, columns in execution position.

    ``fwd``, ``bwd``, ``frac``: [C, rows, M] by microbatch id; ``orders``: [C, M]. On a row whose
    backward is split, B takes ``(1 - frac)`` of the backward and W the rest.
    """
    idx = np.broadcast_to(orders[:, None, :], fwd.shape)
    f = np.take_along_axis(fwd, idx, axis=2)
    b = np.take_along_axis(bwd, idx, axis=2)
    if plan.n_kinds == 2:
        return np.stack([f, b], axis=2)
    w = b * np.take_along_axis(frac, idx, axis=2) * plan.split_rows[:, None]
    return np.stack([f, b - w, w], axis=2)


def simulate_rows(fwd: np.ndarray, bwd: np.ndarray, stage_replicas: tuple[int, ...], *,
                  schedule: str = "1f1b", p2p_s: float = 0.0, order=None, allreduce_s=0.0,
                  n_vision_stages: int = 0, chunks: int = 1, wgrad_frac=0.5) -> SimResult:
    """Simulate a pipeline whose stage ``s`` has ``stage_replicas[s]`` replica rows.

    Args:
        fwd, bwd: [rows, M] seconds of each microbatch's forward / whole backward on each row,
            rows listed stage by stage (all replicas of stage 0, then stage 1, ...). Under
            interleaving the LLM's stages are its ``p * chunks`` model chunks in model order.
        stage_replicas: replicas per stage; sum must equal rows.
        schedule: one of `SCHEDULES` (`dflop.sim.schedules` describes each).
        p2p_s: seconds between a device finishing an op and another device receiving its tensor
            (a chunk feeding a chunk on the same device pays none).
        order: [M] microbatch ids in execution order (default 0..M-1).
        allreduce_s: gradient all-reduce seconds, a scalar or one per stage.
        n_vision_stages: leading stages that are the vision encoder: never interleaved or split,
            run in 1F1B order (GPipe under ``gpipe``).
        chunks: model chunks per LLM rank (``v``); only ``interleaved`` takes more than 1.
        wgrad_frac: scalar or broadcastable to [rows, M]: the share of ``bwd`` that is the
            weight-gradient op W under ``zb-h1`` (see the module docstring); ignored otherwise.
    """
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    stage_replicas = tuple(int(r) for r in stage_replicas)
    if fwd.ndim != 2 or fwd.shape != bwd.shape:
        raise ValueError(f"fwd and bwd must both be [rows, M], got {fwd.shape} and {bwd.shape}")
    if sum(stage_replicas) != fwd.shape[0] or min(stage_replicas, default=0) < 1:
        raise ValueError(f"stage_replicas {stage_replicas} do not add up to {fwd.shape[0]} rows")
    frac = _check_times(fwd, bwd, wgrad_frac, schedule)
    m = fwd.shape[1]
    n_rows = fwd.shape[0]
    order = _check_order(order, m)
    allreduce = np.broadcast_to(np.asarray(allreduce_s, dtype=np.float64), (len(stage_replicas),))
    plan = _compile(stage_replicas, m, schedule, int(n_vision_stages), int(chunks))
    n_kinds = plan.n_kinds

    # Durations by op id, with positions mapped through the execution order.
    dur = _op_durations(fwd[None], bwd[None], frac[None], plan, order[None])[0]
    dur_l = dur.ravel().tolist()
    end = [0.0] * len(dur_l)
    start = [0.0] * len(dur_l)
    dev, inp, loc = plan.device_prev, plan.inputs, plan.local_inputs
    lat = float(p2p_s)
    for op in plan.topo:
        t = end[dev[op]] if dev[op] >= 0 else 0.0
        for d in inp[op]:
            e = end[d] + lat
            if e > t:
                t = e
        for d in loc[op]:
            if end[d] > t:
                t = end[d]
        start[op] = t
        end[op] = t + dur_l[op]

    start_a = np.asarray(start).reshape(n_rows, n_kinds, m)
    end_a = np.asarray(end).reshape(n_rows, n_kinds, m)
    inv = np.empty(m, dtype=np.int64)
    inv[order] = np.arange(m)  # column of microbatch id j in the position-indexed arrays
    makespan = float(end_a.max()) if end_a.size else 0.0
    row_last = end_a.max(axis=(1, 2))
    step = float(np.max(row_last + allreduce[plan.row_stage])) if n_rows else 0.0
    busy = dur.sum(axis=(1, 2))
    device_busy = np.bincount(plan.row_device, weights=busy)
    w_start = w_end = None
    if n_kinds == 3:
        no_w = ~plan.split_rows[:, None]
        w_start = np.where(no_w, np.nan, start_a[:, W, inv])
        w_end = np.where(no_w, np.nan, end_a[:, W, inv])
    return SimResult(
        fwd_start=start_a[:, F, inv], fwd_end=end_a[:, F, inv],
        bwd_start=start_a[:, B, inv], bwd_end=end_a[:, B, inv], w_start=w_start, w_end=w_end,
        row_stage=plan.row_stage, row_replica=plan.row_replica, row_device=plan.row_device,
        n_vision_stages=int(n_vision_stages), chunks=int(chunks), order=order, schedule=schedule,
        makespan_s=makespan, allreduce_s=np.array(allreduce), step_s=step,
        busy_s=busy, idle_s=makespan - device_busy[plan.row_device],
        in_flight=plan.in_flight, device_in_flight=plan.device_in_flight,
        wgrad_pending=plan.wgrad_pending,
    )


def simulate(fwd, bwd, schedule: str = "1f1b", p2p_s: float = 0.0, order=None,
             allreduce_s=0.0, *, chunks: int = 1, wgrad_frac=0.5) -> SimResult:
    """Simulate one pipeline (one replica per stage).

    Args:
        fwd, bwd: [S, M] seconds of microbatch ``j``'s forward/backward on stage ``s`` (under
            interleaving ``S = p * chunks`` model chunks, chunk ``c`` on rank ``c mod p``).
        schedule: one of `SCHEDULES`; p2p_s: seconds per device-to-device transfer;
        order: [M] microbatch ids in execution order; allreduce_s: scalar or [S] seconds;
        chunks, wgrad_frac: as in `simulate_rows`.
    """
    fwd = np.asarray(fwd, dtype=np.float64)
    if fwd.ndim != 2:
        raise ValueError(f"fwd must be [S, M], got shape {fwd.shape}")
    return simulate_rows(fwd, bwd, (1,) * fwd.shape[0], schedule=schedule, p2p_s=p2p_s,
                         order=order, allreduce_s=allreduce_s, chunks=chunks, wgrad_frac=wgrad_frac)


def _dp_rows(vision: np.ndarray, llm: np.ndarray) -> np.ndarray:
    """Rows of a coupled vision + LLM-replica pipeline: vision stages, then LLM stage 0 replicas
    0..R-1, stage 1 replicas, ... ``vision`` is [..., Sv, M], ``llm`` [..., R, Sl, M]."""
    *lead, n_rep, n_llm, m = llm.shape
    llm_rows = np.swapaxes(llm, -3, -2).reshape(*lead, n_llm * n_rep, m)
    return np.concatenate([vision.reshape(*lead, -1, m), llm_rows], axis=-2)


def _dp_frac(wgrad_frac, vision: np.ndarray, llm: np.ndarray) -> np.ndarray:
    """``wgrad_frac`` (scalar or broadcastable to ``llm``'s [..., R, Sl, M]) as `_dp_rows` rows;
    vision rows get 0 (their backward is never split)."""
    frac = np.asarray(wgrad_frac, dtype=np.float64)
    try:
        frac = np.broadcast_to(frac, llm.shape)
    except ValueError:
        raise ValueError(f"wgrad_frac of shape {frac.shape} does not broadcast to the LLM times' "
                         f"{llm.shape}") from None
    return _dp_rows(np.zeros_like(vision), frac)


def simulate_dp(vision_fwd, vision_bwd, llm_fwd, llm_bwd, *, schedule: str = "1f1b",
                p2p_s: float = 0.0, order=None, allreduce_s=0.0, chunks: int = 1,
                wgrad_frac=0.5) -> SimResult:
    """Simulate vision stages shared by ``R`` LLM data-parallel replicas, coupled exactly.

    The vision stages' data-parallel replicas split each microbatch evenly, so each vision stage
    is one row whose times are already divided over its replicas. Microbatch ``j``'s first LLM
    stage waits for the last vision stage's forward; the last vision stage's backward of ``j``
    waits for the first LLM stage of every replica. This is never faster than simulating each
    replica alone and taking the max, and slower when replicas are out of step.

    Args:
        vision_fwd, vision_bwd: [Sv, M] seconds per vision stage and microbatch (Sv may be 0).
        llm_fwd, llm_bwd: [R, Sl, M] seconds per LLM replica, stage and microbatch (under
            interleaving the ``Sl = p * chunks`` model chunks in model order).
        allreduce_s: scalar or [Sv + Sl] seconds of gradient all-reduce per stage.
        schedule, chunks: as in `simulate_rows`; the vision stages stay on 1F1B (GPipe under
            ``gpipe``) whatever the LLM runs.
        wgrad_frac: scalar or broadcastable to [R, Sl, M]: W's share of each LLM backward under
            ``zb-h1``.
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
                         n_vision_stages=n_vis, chunks=chunks,
                         wgrad_frac=_dp_frac(wgrad_frac, vision_fwd, llm_fwd))


def simulate_dp_steps(vision_fwd, vision_bwd, llm_fwd, llm_bwd, orders, *, schedule: str = "1f1b",
                      p2p_s: float = 0.0, allreduce_s=0.0, chunks: int = 1,
                      wgrad_frac=0.5) -> np.ndarray:
    """Step seconds of C candidates at once: ``simulate_dp(...).step_s`` of each, bit for bit.

    Candidates (different assignments, different orders) share the layout, so they share the
    schedule's dependency graph; walking it once with a vector of C times per op costs about as
    much Python as one scalar simulation. This is what makes scoring every portfolio member in
    every candidate order cheap.

    Args:
        vision_fwd, vision_bwd: [C, Sv, M]; llm_fwd, llm_bwd: [C, R, Sl, M] seconds.
        orders: [C, M] microbatch ids in execution order, one order per candidate.
        allreduce_s: scalar or [Sv + Sl] seconds, as in `simulate_dp`.
        schedule, chunks: as in `simulate_dp`; wgrad_frac: scalar or broadcastable to [C, R, Sl, M].
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
    frac = _check_times(fwd, bwd, _dp_frac(wgrad_frac, vision_fwd, llm_fwd), schedule)
    orders = np.asarray(orders, dtype=np.int64)
    if orders.shape != (n_cand, m) or not (np.sort(orders, axis=1) == np.arange(m)).all():
        raise ValueError(f"orders must be {n_cand} permutations of range({m}), got shape {orders.shape}")
    stage_replicas = (1,) * n_vis + (n_rep,) * n_llm
    allreduce = np.broadcast_to(np.asarray(allreduce_s, dtype=np.float64), (len(stage_replicas),))
    plan = _compile(stage_replicas, m, schedule, n_vis, int(chunks))
    n_rows = fwd.shape[1]

    # dur[op, c]: op ids as in simulate_rows ((row, kind, position) raveled), candidates last.
    dur = _op_durations(fwd, bwd, frac, plan, orders)
    dur = np.ascontiguousarray(dur.reshape(n_cand, -1).T)
    n_ops = dur.shape[0]
    # end[op, c], then two rows the levels index for "none": 0 (no device predecessor) and -inf (padding)
    end = np.zeros((n_ops + 2, n_cand))
    end[n_ops + 1] = -np.inf
    lat = float(p2p_s)
    for ops, dev, inp, loc in _levels(plan, n_ops):
        t = end[dev]
        if inp is not None:
            np.maximum(t, end[inp].max(axis=1) + lat, out=t)
        if loc is not None:
            np.maximum(t, end[loc].max(axis=1), out=t)
        end[ops] = t + dur[ops]
    end = end[:n_ops]
    row_last = end.reshape(n_rows, plan.n_kinds * m, n_cand).max(axis=1)  # [rows, C]
    return (row_last + allreduce[plan.row_stage][:, None]).max(axis=0)
