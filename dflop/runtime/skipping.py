"""Samples that cannot be loaded during training: skipped on every rank alike, replaced, counted.

The data profiler reads headers only, so a sample whose pixels cannot be decoded (a corrupt image,
a video cut short after its header) can reach the trainer. The rank that loads it gets a
`LoadedSample` with ``error`` set (`dflop.runtime.loading`: only `UnreadableMedia`, a fault of
that one sample; other load errors stop the run on every rank). Then, on every rank:

1. one all-reduce (MAX) of a flag per batch sample tells every rank which samples failed anywhere
   (a rank that only needed a sample's tokens would not know), and the reasons are gathered when
   one did, so all ranks drop the same samples and name the same reason. Where each step loads
   at its start (CPU), a rank whose own loads succeeded computes the step while the flags
   travel and waits for them only before it first communicates (`FailureCheck`): no rank waits
   for the slowest loader before computing, as the pricing assumes. If a sample failed, that
   work is dropped (`StepAborted`) and the step is computed again on the new plan;
2. each failed sample is replaced by another pool sample, the first of a permutation seeded with
   (seed, step) that is neither in the batch nor already skipped: the global batch keeps its size
   and the run stays reproducible (a resumed run replaces the same sample by the same one);
3. rank 0 re-partitions the batch (the scheduler's greedy portfolio, milliseconds) and sends the
   new step plan to every rank (`rank0_result`); each loads what it now needs, the check repeats
   and rank 0 logs the skipped samples, with the reasons, and their replacements by id.

Skipped pool rows are counted over the run (kept in the checkpoint) and in metrics.parquet
(``skipped_samples`` per step); past ``data.max_skip_frac`` of the pool the run stops with one
line naming the last sample and its reason.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dflop.data.training import LoadedSample
from dflop.errors import UserError
from dflop.runtime.agreement import rank0_result
from dflop.scheduler.online import StepPlan

log = logging.getLogger("dflop.train")

# Replacement permutations are seeded with (seed, step, this), apart from the batch permutations.
_REPLACEMENT_STREAM = 0x5EED


@dataclass
class SkippedSamples:
    """Pool rows skipped so far in this run and how many may be.

    allowed: ``floor(data.max_skip_frac * pool size)``; one more stops the run.
    """

    allowed: int
    rows: set[int] = field(default_factory=set)

    @classmethod
    def for_pool(cls, n_pool: int, max_skip_frac: float) -> "SkippedSamples":
        return cls(allowed=int(math.floor(max_skip_frac * n_pool + 1e-9)))

    def add(self, rows: Sequence[int], reason: str) -> None:
        """Record skipped pool `rows`; UserError once more than `allowed` distinct rows were skipped.
        reason: why the last of them failed (a SampleError message, which names the sample)."""
        self.rows.update(int(r) for r in rows)
        if len(self.rows) > self.allowed:
            raise UserError(f"{len(self.rows)} samples failed to load during training, more than data.max_skip_frac "
                            f"allows ({self.allowed}); the last: {reason}")

    def state_dict(self) -> dict:
        return {"rows": sorted(self.rows)}

    def load_state_dict(self, state: Mapping) -> None:
        self.rows = {int(r) for r in state.get("rows", [])}


class StepAborted(Exception):
    """Raised by `FailureCheck.confirm` when a sample of the step failed to load on some rank: the
    step's gradients computed so far are void (`dflop.runtime.trainer.Trainer.gradients`)."""


class FailureCheck:
    """The agreement of step 1 (module docstring), started as soon as this rank has loaded.

    The flags' all-reduce runs in the background; `result` waits for it. A rank whose own loads
    succeeded may compute meanwhile (the other ranks' loads still running) as long as it waits
    for the result before it communicates: then it learns whether the step stands (`confirm`).

    fatal: this rank's load raised something other than an unreadable sample (`StepLoader`
    returns those as errors). Then every rank raises in `result`: this one its own error, the
    others a UserError with its line (a RuntimeError when it was not a UserError), so no rank is
    left waiting in a collective for one that stopped.
    """

    def __init__(self, plan: StepPlan, loaded: Mapping[int, LoadedSample], device: torch.device,
                 fatal: BaseException | None = None):
        self.plan, self.fatal = plan, fatal
        self.mine = {k: loaded[row].error for k, row in enumerate(plan.rows)
                     if row in loaded and loaded[row].error is not None}
        self._result: dict[int, str] | None = None
        self._flags = self._work = None
        if dist.is_initialized():
            self._flags = torch.zeros(len(plan.rows) + 1, dtype=torch.int32, device=device)
            self._flags[list(self.mine)] = 1
            self._flags[-1] = fatal is not None
            self._work = dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, async_op=True)

    @property
    def failed_here(self) -> bool:
        """Whether this rank already knows the step cannot stand as planned."""
        return bool(self.mine) or self.fatal is not None

    @property
    def settled(self) -> bool:
        """Whether `result` has returned (so `confirm` no longer waits)."""
        return self._result is not None

    def result(self) -> dict[int, str]:
        """{batch position: why it failed} over every rank (collective, the same everywhere; waits
        for the flags; gathers the reasons only when something failed). Idempotent."""
        if self._result is None:
            self._result = self._agree()
        return self._result

    def confirm(self) -> None:
        """Wait for the agreement; `StepAborted` if any sample of the step failed anywhere."""
        if self.result():
            raise StepAborted(f"step {self.plan.step + 1}: samples failed to load")

    def confirm_traced(self, spans) -> None:
        """`confirm`, traced as a "load agreement" data span in `spans` when it still has to wait."""
        if not self.settled:
            with spans.span("data", "load agreement"):
                self.confirm()

    def _agree(self) -> dict[int, str]:
        fatal = self.fatal
        if self._work is None:
            if fatal is not None:
                raise fatal
            return self.mine
        self._work.wait()
        flags = self._flags
        if not bool(flags.any()):
            return {}
        report = (self.mine, None if fatal is None else (isinstance(fatal, UserError), str(fatal)))
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, report)
        if bool(flags[-1]):
            if fatal is not None:
                raise fatal
            rank, (is_user, message) = next((r, f) for r, (_, f) in enumerate(gathered) if f is not None)
            raise (UserError(message) if is_user else RuntimeError(f"rank {rank} failed to load step "
                                                                   f"{self.plan.step + 1}: {message}"))
        merged: dict[int, str] = {}
        for reasons, _ in gathered:
            for k, reason in reasons.items():
                merged.setdefault(int(k), reason)
        return dict(sorted(merged.items()))


def checked_load(plan: StepPlan, load: Callable[[], dict], device: torch.device) -> tuple[dict, FailureCheck]:
    """This rank's samples of `plan` (`load()`, which may raise) and the started agreement on them."""
    try:
        loaded, fatal = load(), None
    except Exception as exc:  # noqa: BLE001 — every rank raises in `FailureCheck.result`
        loaded, fatal = {}, exc
    return loaded, FailureCheck(plan, loaded, device, fatal)


def replacement_rows(n_pool: int, batch_rows: Sequence[int], positions: Sequence[int], excluded: set[int],
                     seed: int, step: int) -> np.ndarray:
    """`batch_rows` with the samples at `positions` replaced (module docstring, step 2)."""
    rows = np.asarray(batch_rows, dtype=np.int64).copy()
    taken = set(rows.tolist()) | set(excluded)
    order = np.random.default_rng([seed, step, _REPLACEMENT_STREAM]).permutation(n_pool)
    candidates = (int(r) for r in order if int(r) not in taken)
    for k in positions:
        substitute = next(candidates, None)
        if substitute is None:
            raise UserError(f"step {step + 1}: no loadable sample is left to replace the ones that failed "
                            f"({len(excluded)} skipped of {n_pool})")
        rows[k] = substitute
    return rows


def load_without_failures(plan: StepPlan, load: Callable[[], dict] | None, *, skipped: SkippedSamples,
                          describe: Callable[[int], str], replan: Callable[[StepPlan, np.ndarray], StepPlan],
                          reload: Callable[[StepPlan], dict], device: torch.device, n_pool: int,
                          seed: int, started: tuple[dict, FailureCheck] | None = None) -> tuple[StepPlan, dict, int]:
    """The step's plan and loaded samples with every unloadable sample replaced (collective).

    load(): this rank's samples of `plan` ({pool row: LoadedSample}; may raise);
    replan(plan, rows): the new StepPlan for the batch `rows` (called on rank 0 only, its result
    goes to every rank); reload(plan): this rank's samples of `plan`; started: `plan`'s load and
    agreement when already under way (`checked_load`; `load` is then not called).
    Returns (plan, loaded, samples skipped in this step).
    """
    n_skipped = 0
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    while True:
        loaded, check = started if started is not None else checked_load(plan, load, device)
        started = None
        failed = check.result()
        if not failed:
            return plan, loaded, n_skipped
        positions = list(failed)
        rows = [plan.rows[k] for k in positions]
        if rank0:
            for reason in failed.values():
                log.warning("step %d: skipping %s", plan.step + 1, reason)
        skipped.add(rows, failed[positions[-1]])
        n_skipped += len(rows)
        new_rows = replacement_rows(n_pool, plan.rows, positions, skipped.rows, seed, plan.step)
        if rank0:
            log.info("step %d: replaced %s by %s (%d of %d allowed skips used)", plan.step + 1,
                     ", ".join(describe(r) for r in rows), ", ".join(describe(int(new_rows[k])) for k in positions),
                     len(skipped.rows), skipped.allowed)
        failed_plan = plan
        plan = rank0_result(lambda: replan(failed_plan, new_rows))
        load = functools.partial(reload, plan)
