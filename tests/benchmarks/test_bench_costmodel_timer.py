"""`bench_costmodel.py --timer thread-cpu`: its timer stands in for the profiler's everywhere the
profiler reads one (before, it lacked `device` and the first profiled forward raised)."""

from __future__ import annotations

import time

import torch

from bench_costmodel import ThreadCPUTimer, profiler_timer
from dflop.profiling import model_profiler
from dflop.profiling._timing import Timer


def test_thread_cpu_timer_has_what_the_profilers_timer_has_and_counts_only_cpu():
    cpu = torch.device("cpu")
    timer, reference = ThreadCPUTimer(cpu), Timer(cpu)
    assert vars(timer) == vars(reference)  # device, cuda: what model_profiler reads
    _, slept_ms = timer(lambda: time.sleep(0.2))
    _, busy_ms = timer(lambda: sum(i * i for i in range(300_000)))
    assert slept_ms < 20 and busy_ms > 0  # sleeping is not the thread's CPU time (a wall timer: ~200 ms)
    with profiler_timer("thread-cpu"):
        assert model_profiler.Timer is ThreadCPUTimer
    assert model_profiler.Timer is Timer
