"""The step loader's background thread works on the rank's own CUDA device: a new thread's current
device is 0, where the loader (or the DataLoader's pin-memory thread it starts) would pin, and so
create a CUDA context on GPU 0 for every rank. The CUDA API is faked (no GPU needed).

Before the first step a rank builds the processors its loads use (`processors_needed`), and only
those: the trainer's wiring is checked in a real run (tests/runtime/test_trace.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from dflop.plan import Layout, Plan
from dflop.runtime.loading import StepLoader, processors_needed, requests_for
from dflop.runtime.topology import Topology
from dflop.scheduler.online import StepPlan


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


def _step(n_tiles: tuple[int, ...], replicas_l: int, replicas_v: int) -> StepPlan:
    """Sample i in LLM bin i % replicas_l; the samples with tiles dealt to the vision replicas."""
    n = len(n_tiles)
    bins = tuple(tuple(i for i in range(n) if i % replicas_l == r) for r in range(replicas_l))
    imaged = [i for i in range(n) if n_tiles[i] > 0]
    shares = tuple(tuple(i for k, i in enumerate(imaged) if k % replicas_v == v) for v in range(replicas_v))
    return StepPlan(step=1, rows=tuple(range(n)), n_tiles=n_tiles, seq_len=(9,) * n, feature_rows=(0,) * n,
                    bins=(bins,), vision_shares=(shares,), microbatch_ids=(0,))


@pytest.mark.parametrize("layout", [
    Layout("colocated", 1, 1, 2, 1, 2, 2, 1),  # stage 0 (with the tower) x 2 replicas, stage 1 x 2
    Layout("disjoint", 1, 2, 1, 1, 3, 1, 1),   # vision stages 0-1, LLM stages 0-2 (a middle one)
    Layout("disjoint", 1, 1, 2, 1, 1, 2, 1),   # vision and LLM replicas
])
def test_a_rank_prepares_the_processors_its_loads_use(layout):
    """What `processors_needed` builds before the first step is what `requests_for` asks of the
    rank: a middle LLM stage or a later vision stage builds nothing (the tokenizer takes seconds)."""
    plan = Plan.uniform(layout, 4, 6)
    step = _step((0, 2, 5, 0, 1, 3), layout.dp_l, layout.dp_v)
    for rank in range(layout.world_size):
        topo = Topology(plan, rank, layout.world_size)
        requests = requests_for(step, topo)
        asked = (any(r.tokens for r in requests), any(r.pixels for r in requests))
        assert processors_needed(topo) == asked, (layout, rank)
