"""Wall time of a piece of work in milliseconds: CUDA events on GPU, perf_counter on CPU."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class Timer:
    """``result, ms = timer(fn)``. On CUDA the time is the GPU stream time between two events."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], T]) -> tuple[T, float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return result, start.elapsed_time(end)
        begin = time.perf_counter()
        result = fn()
        return result, (time.perf_counter() - begin) * 1e3

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
