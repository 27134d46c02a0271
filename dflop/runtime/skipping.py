"""Samples that cannot be loaded during training: skipped on every rank alike, replaced, counted.

The data profiler reads headers only, so a sample whose pixels cannot be decoded (a corrupt image,
a video cut short after its header) can reach the trainer. The rank that loads it gets a
`LoadedSample` with ``error`` set (`dflop.runtime.loading`: only `UnreadableMedia`, a fault of
that one sample; other load errors stop the run on every rank). Then, on every rank:

1. one all-reduce (MAX) of a flag per batch sample tells every rank which samples failed anywhere
   (a rank that only needed a sample's tokens would not know), and the reasons are gathered when
   one did, so all ranks drop the same samples and name the same reason;
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


def failures(plan: StepPlan, loaded: Mapping[int, LoadedSample], device: torch.device,
             fatal: BaseException | None = None) -> dict[int, str]:
    """{batch position: why it failed} of the samples that failed to load on any rank (collective:
    every rank calls it with what it loaded; the result is the same everywhere). One all-reduce
    of a flag per sample each step; the reasons are gathered only when something failed.

    fatal: this rank's load raised something other than an unreadable sample (`StepLoader`
    returns those as errors). Then every rank raises: this one its own error, the others a
    UserError with its line (a RuntimeError when it was not a UserError), so no rank is left
    waiting in a collective for one that stopped.
    """
    mine = {k: loaded[row].error for k, row in enumerate(plan.rows)
            if row in loaded and loaded[row].error is not None}
    if not dist.is_initialized():
        if fatal is not None:
            raise fatal
        return mine
    flags = torch.zeros(len(plan.rows) + 1, dtype=torch.int32, device=device)
    flags[list(mine)] = 1
    flags[-1] = fatal is not None
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if not bool(flags.any()):
        return {}
    report = (mine, None if fatal is None else (isinstance(fatal, UserError), str(fatal)))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if bool(flags[-1]):
        if fatal is not None:
            raise fatal
        rank, (is_user, message) = next((r, f) for r, (_, f) in enumerate(gathered) if f is not None)
        raise (UserError(message) if is_user else RuntimeError(f"rank {rank} failed to load step {plan.step + 1}: "
                                                               f"{message}"))
    merged: dict[int, str] = {}
    for reasons, _ in gathered:
        for k, reason in reasons.items():
            merged.setdefault(int(k), reason)
    return dict(sorted(merged.items()))


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


def load_without_failures(plan: StepPlan, load: Callable[[], dict], *, skipped: SkippedSamples,
                          describe: Callable[[int], str], replan: Callable[[StepPlan, np.ndarray], StepPlan],
                          reload: Callable[[StepPlan], dict], device: torch.device, n_pool: int,
                          seed: int) -> tuple[StepPlan, dict, int]:
    """The step's plan and loaded samples with every unloadable sample replaced (collective).

    load(): this rank's samples of `plan` ({pool row: LoadedSample}; may raise);
    replan(plan, rows): the new StepPlan for the batch `rows` (called on rank 0 only, its result
    goes to every rank); reload(plan): this rank's samples of `plan`.
    Returns (plan, loaded, samples skipped in this step).
    """
    n_skipped = 0
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    while True:
        try:
            loaded, fatal = load(), None
        except Exception as exc:  # noqa: BLE001 — every rank raises in `failures`
            loaded, fatal = {}, exc
        failed = failures(plan, loaded, device, fatal)
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
