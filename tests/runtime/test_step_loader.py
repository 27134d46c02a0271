"""The step loader's background thread works on the rank's own CUDA device: a new thread's current
device is 0, where the loader (or the DataLoader's pin-memory thread it starts) would pin, and so
create a CUDA context on GPU 0 for every rank. The CUDA API is faked (no GPU needed)."""

from __future__ import annotations

import threading

import torch

from dflop.runtime.loading import StepLoader


def _loader_thread_devices(monkeypatch, device: torch.device) -> list:
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((threading.current_thread().name, d)))
    loader = StepLoader(object(), workers=0, device=device)  # no request is loaded: no data needed
    try:
        assert loader.start([]).result() == {}
    finally:
        loader.close()
    return seen


def test_the_loader_thread_makes_the_ranks_cuda_device_current(monkeypatch):
    seen = _loader_thread_devices(monkeypatch, torch.device("cuda", 3))
    assert [(name.startswith("dflop-loader"), d) for name, d in seen] == [(True, torch.device("cuda", 3))]


def test_a_cpu_loader_leaves_cuda_alone(monkeypatch):
    assert _loader_thread_devices(monkeypatch, torch.device("cpu")) == []
