"""Decisions one rank makes for all: the result on every rank, or the same error on every rank.

Rank 0 alone decides some things (whether to resume a checkpoint, a re-planned step). If it
failed and the other ranks waited for its answer in a broadcast, they would wait until the
process group's timeout (torchrun ends them on one node, not across nodes). `rank0_result`
sends either the answer or the error, so every rank returns or raises together.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch.distributed as dist

from dflop.errors import UserError

T = TypeVar("T")


def rank0_result(fn: Callable[[], T]) -> T:
    """`fn()` run on rank 0 only, its result on every rank (collective).

    If `fn` raises, rank 0 re-raises it and every other rank raises a `UserError` with the same
    line (a `RuntimeError` naming the error when it was not a UserError). Results travel by
    `broadcast_object_list` (pickled between our own processes, never read from a file).
    """
    if not dist.is_initialized():
        return fn()
    error: BaseException | None = None
    payload: list = [None, None]
    if dist.get_rank() == 0:
        try:
            payload = ["ok", fn()]
        except UserError as exc:
            payload, error = ["user", str(exc)], exc
        except Exception as exc:  # noqa: BLE001 — re-raised below, after the others know
            payload, error = ["error", f"{type(exc).__name__}: {exc}"], exc
    dist.broadcast_object_list(payload, src=0)
    status, value = payload
    if status == "ok":
        return value
    if error is not None:
        raise error
    if status == "user":
        raise UserError(value)
    raise RuntimeError(f"rank 0 failed: {value}")
