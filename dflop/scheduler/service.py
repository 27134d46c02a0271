"""Online scheduler: partitions upcoming global batches in a background thread, ahead of training.

The trainer submits each global batch's costs as soon as its sample ids are known (the data loader
runs ahead) and asks for step k's partition right before step k. The worker solves batches in
submission order, at most `prefetch` steps ahead of the last one taken, so the portfolio's solve
time overlaps training. If step k's solve is not done when asked for (or the solver raised), the
caller gets the greedy portfolio computed on the spot: training never waits longer than the greedy
takes. Results are a pure function of (costs, settings, seed + step), so a run is reproducible as
long as the worker keeps ahead.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import replace
from typing import Callable

import numpy as np

from dflop.costmodel.types import BatchCosts
from dflop.scheduler.correction import AdaptiveCorrection, MeasuredTimes
from dflop.scheduler.partition import Partition, greedy_partition, partition

# How many steps back the service remembers anything (inputs never reported, taken steps, waits,
# fallbacks): a run of any length holds the same amount.
KEPT_STEPS = 64

Solver = Callable[..., Partition]


class SchedulerService:
    """Background partitioner for one training run's layout.

    Args:
        m, dp_llm, dp_vision: microbatches and data-parallel replicas.
        budget_s: the ILP's time budget per batch (seconds); the default solver leaves the ILP off
            (it is opt-in, see `partition`), so this only matters with a solver that turns it on.
        seed: base seed; step k is solved with seed + k.
        prefetch: how many steps ahead of the last `get` the worker may solve (>= 1).
        policy: partition policy (see `partition`).
        correction: optional `AdaptiveCorrection`; when active it rescales submitted costs before
            solving, and `report` feeds it measured times.
        solver: ``solver(costs, m, dp_llm, dp_vision, *, budget_s, seed, policy, p2p_s, allreduce_s)``
            returning a Partition; default `partition` (swap in to test failure handling).
    """

    def __init__(self, *, m: int, dp_llm: int, dp_vision: int, budget_s: float = 0.5, seed: int = 0,
                 prefetch: int = 2, policy: str = "dflop", p2p_s: float = 0.0, allreduce_s=0.0,
                 correction: AdaptiveCorrection | None = None, solver: Solver = partition):
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.m, self.dp_llm, self.dp_vision = m, dp_llm, dp_vision
        self.budget_s, self.seed, self.prefetch, self.policy = budget_s, seed, prefetch, policy
        self.p2p_s, self.allreduce_s = p2p_s, allreduce_s
        self.correction = correction
        self._solver = solver
        self._cond = threading.Condition()
        self._queue: deque[int] = deque()
        self._inputs: dict[int, tuple[BatchCosts, np.ndarray | None]] = {}
        self._results: dict[int, tuple[Partition, bool]] = {}
        self._taken: set[int] = set()  # steps taken in the last KEPT_STEPS (older ones are forgotten)
        self._last_taken = -1
        self._closed = False
        # The last KEPT_STEPS of each: a long run must not grow them without end.
        self.wait_s: deque[float] = deque(maxlen=KEPT_STEPS)  # seconds each `get` blocked the caller
        self.fallbacks: deque[tuple[int, str]] = deque(maxlen=KEPT_STEPS)  # (step, reason) where greedy was used
        self.solved_corrected: dict[int, bool] = {}  # step taken -> partitioned with corrected costs
        self._worker = threading.Thread(target=self._run, name="dflop-scheduler", daemon=True)
        self._worker.start()

    # ---- trainer side ----
    def submit(self, step: int, costs: BatchCosts, buckets: np.ndarray | None = None) -> None:
        """Queue global batch `step` (its per-sample costs; `buckets` [n] shape buckets for the
        adaptive correction). Steps must be submitted in increasing order."""
        with self._cond:
            if self._closed:
                raise RuntimeError("SchedulerService is closed")
            if step in self._inputs or step in self._taken:
                raise ValueError(f"step {step} was already submitted")
            if self._queue and step < self._queue[-1]:
                raise ValueError(f"step {step} submitted after step {self._queue[-1]}; submit in order")
            self._inputs[step] = (costs, None if buckets is None else np.asarray(buckets))
            self._queue.append(step)
            self._cond.notify_all()

    def get(self, step: int, timeout_s: float = 0.0) -> Partition:
        """Partition for `step`: the worker's if ready (waiting at most `timeout_s`), else the
        greedy portfolio computed now (member prefixed "fallback:")."""
        t0 = time.perf_counter()
        with self._cond:
            if step not in self._inputs:
                raise KeyError(f"step {step} was never submitted (or was already taken)")
            deadline = t0 + timeout_s
            while step not in self._results and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
            result, corrected = self._results.pop(step, (None, False))
            costs, buckets = self._inputs.pop(step) if self.correction is None else self._inputs[step]
            for old in [s for s in self._inputs if s < step - KEPT_STEPS]:  # never reported: forget
                del self._inputs[old]
            self._taken = {s for s in self._taken if s >= step - KEPT_STEPS}
            self._taken.add(step)
            self._last_taken = max(self._last_taken, step)
            self._cond.notify_all()
        if result is None:
            self.fallbacks.append((step, "not ready"))
            result, corrected = self._fallback(costs, buckets)
        self.solved_corrected[step] = corrected  # popped by the trainer's planner; forget any it never asks for
        for old in [s for s in self.solved_corrected if s < step - KEPT_STEPS]:
            del self.solved_corrected[old]
        self.wait_s.append(time.perf_counter() - t0)
        return result

    def report(self, step: int, measured: MeasuredTimes | None, partition_used: Partition) -> None:
        """Measured stage times of `step` (run with `partition_used`) for the adaptive correction
        (None: forget the step without learning from it)."""
        if self.correction is None:
            return
        with self._cond:
            costs, buckets = self._inputs.pop(step)
        if buckets is not None and measured is not None:
            self.correction.observe(costs, partition_used, buckets, measured)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout=5)

    def __enter__(self) -> "SchedulerService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- worker side ----
    def _costs_for_solve(self, costs: BatchCosts, buckets) -> tuple[BatchCosts, bool]:
        """The costs to partition with, and whether they are corrected (the correction's gate is on)."""
        solve = costs
        if self.correction is not None and buckets is not None:
            solve = self.correction.apply(costs, buckets)
        return solve, solve is not costs

    def _fallback(self, costs: BatchCosts, buckets) -> tuple[Partition, bool]:
        solve, corrected = self._costs_for_solve(costs, buckets)
        part = greedy_partition(solve, self.m, self.dp_llm, self.dp_vision, p2p_s=self.p2p_s,
                                allreduce_s=self.allreduce_s)
        return replace(part, member=f"fallback:{part.member}"), corrected

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._queue and self._queue[0] <= self._last_taken + self.prefetch):
                    self._cond.wait()
                if self._closed:
                    return
                step = self._queue.popleft()
                if step in self._taken:
                    continue
                costs, buckets = self._inputs[step]
            try:
                solve, corrected = self._costs_for_solve(costs, buckets)
                result = self._solver(solve, self.m, self.dp_llm, self.dp_vision,
                                      budget_s=self.budget_s, seed=self.seed + step, policy=self.policy,
                                      p2p_s=self.p2p_s, allreduce_s=self.allreduce_s)
            except Exception as exc:  # noqa: BLE001 — a failed solve must never stall training
                self.fallbacks.append((step, f"solver failed: {type(exc).__name__}: {exc}"))
                result, corrected = self._fallback(costs, buckets)
            with self._cond:
                if step not in self._taken:
                    self._results[step] = (result, corrected)
                self._cond.notify_all()
