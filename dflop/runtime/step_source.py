"""Each step's samples on this rank, loaded and agreed on: `batch = StepSource.next(step)`.

The source hides the two ways a step gets its samples (`StepSource.prefetch`):

- on GPUs the next step's plan is fetched and its load started right after this step's data wait,
  so it runs behind this step's compute (prefetch); `next` waits for it and for the ranks'
  agreement that every sample loaded, replacing the ones that failed (`dflop.runtime.skipping`);
- on CPU, where that load would share the ranks' cores, `next` loads the step's samples itself and
  only starts the agreement (`FailureCheck`): the trainer computes meanwhile and, when a sample
  failed somewhere, asks `replace_failed` for the batch again. The next plan is fetched after the
  step's update (`after_update`): fetching it is a collective, which would make every rank wait
  for the slowest loader before computing.

Either way the next step's plan is taken before rank 0's scheduler learns from this step (its
predictions depend on what it learned), and the "data" spans are traced as before.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dflop.costmodel.model import loads_share_compute_cores
from dflop.runtime.loading import decode_seconds
from dflop.runtime.skipping import FailureCheck, checked_load, load_without_failures
from dflop.scheduler.online import StepPlan

if TYPE_CHECKING:
    from dflop.runtime.trainer import Trainer


@dataclass(frozen=True)
class Batch:
    """One step's samples on this rank (`StepSource.next`).

    loaded: {pool row: LoadedSample} of what this rank needs of `plan`; decode_s: [m] seconds of
    loading charged to each position's forward where the step loads its own samples, else None;
    check: the ranks' agreement on `loaded`, still under way (CPU), or None when settled;
    skipped: samples replaced in this step so far; data_wait_s: the step's wait in `next` (seconds).
    """

    source: StepSource
    plan: StepPlan
    loaded: dict[int, Any]
    decode_s: np.ndarray | None
    check: FailureCheck | None
    skipped: int
    data_wait_s: float


class StepSource:
    """The batches of steps `start` .. `last` - 1, in order, on every rank (collective; module docstring)."""

    def __init__(self, trainer: Trainer, start: int, last: int):
        self.trainer, self.last = trainer, last
        # On CPU each step loads its own samples: a load behind the step would run on the cores the
        # ranks compute on (the pricing charges it then, `dflop.pricing.pricing.Pricing.load_s`).
        self.prefetch = not loads_share_compute_cores(trainer.device.type)
        self._plan = trainer.next_plan(start) if start < last else None
        self._pending = trainer.load(self._plan) if self.prefetch and start < last else None

    def next(self, step: int) -> Batch:
        """Step `step`'s batch; on GPUs also starts loading the step after it."""
        trainer, spans = self.trainer, self.trainer.spans
        if self._plan is None or self._plan.step != step:
            raise ValueError(f"StepSource: step {step} asked, but the next step is "
                             f"{None if self._plan is None else self._plan.step}")
        t0 = time.perf_counter()
        with spans.span("data", "data wait"):
            if self.prefetch:
                plan, loaded, skipped = self._without_failures(self._plan, self._pending)
                check = None
            else:  # the ranks agree on these loads while they compute (Trainer.gradients)
                plan, skipped = self._plan, 0
                loaded, check = checked_load(plan, lambda: trainer.load(plan).result(), trainer.device)
            decode_s = self.in_step_loads(plan, loaded)
        data_wait_s = time.perf_counter() - t0
        if self.prefetch and step + 1 < self.last:
            with spans.span("data", "next plan"):
                self._plan = trainer.next_plan(step + 1)
                self._pending = trainer.load(self._plan)
        return Batch(self, plan, loaded, decode_s, check, skipped, data_wait_s)

    def after_update(self, step: int) -> None:
        """Step `step`'s update is done on this rank: on CPU, fetch the next step's plan (a
        collective, so only after every rank has waited for the agreement)."""
        if not self.prefetch and step + 1 < self.last:
            with self.trainer.spans.span("data", "next plan"):
                self._plan = self.trainer.next_plan(step + 1)

    def replace_failed(self, batch: Batch) -> Batch:
        """`batch` (its agreement under way) with the samples that failed on any rank replaced, loaded
        and agreed on (collective; `dflop.runtime.skipping`)."""
        with self.trainer.spans.span("data", "replacing failed samples"):
            plan, loaded, skipped = self._without_failures(batch.plan, started=(batch.loaded, batch.check))
            decode_s = self.in_step_loads(plan, loaded)
        return dataclasses.replace(batch, plan=plan, loaded=loaded, decode_s=decode_s, check=None,
                                   skipped=batch.skipped + skipped)

    def in_step_loads(self, plan: StepPlan, loaded: dict[int, Any]) -> np.ndarray | None:
        """[m] seconds this rank spent loading, per position, the samples the pricing charges to
        its forwards (`decode_seconds`), where steps load in the step, else None. Traced as "data"
        spans ending now (called right after the load)."""
        if self.prefetch:
            return None
        seconds = decode_seconds(plan, self.trainer.topo, loaded)
        self.trainer.spans.add_back_to_back("data", "sample loads (counted in its forward)", seconds)
        return seconds

    def _without_failures(self, plan: StepPlan, pending=None,
                          started: tuple[dict, FailureCheck] | None = None) -> tuple[StepPlan, dict, int]:
        """`load_without_failures` of `plan` (`pending`: the load started for it, or `started`: that
        load done and its agreement under way)."""
        trainer = self.trainer
        pool = trainer.pool

        def describe(row: int) -> str:
            return f"{pool['dataset'].iat[row]}/{pool['sample_id'].iat[row]}"

        return load_without_failures(
            plan, pending.result if pending is not None else None, skipped=trainer.skipped, describe=describe,
            replan=lambda p, rows: trainer.planner.replan(p, rows), reload=lambda p: trainer.load(p).result(),
            device=trainer.device, n_pool=len(pool), seed=trainer.settings.seed, started=started)
