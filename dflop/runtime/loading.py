"""Each rank loads only what its stages consume, with loader worker processes, one step ahead.

What a rank needs from a step's samples (docs/design.md):
- first vision stage: pixels of its replica's share (colocated: of its bin's images);
- last vision stage: the layouts (image sizes, frames: headers only) of its share;
- first LLM stage: token ids of its bin; last LLM stage: labels of its bin (both come from one
  tokenisation); middle LLM stages: nothing (lengths travel in the StepPlan).

`StepLoader.start` begins loading a step's requests in a background thread that pulls them through
a persistent `torch.utils.data.DataLoader` (``workers`` processes; pinned memory on CUDA), so the
next step's decoding overlaps the current step's compute (on GPUs: on CPU, where that decoding
would share the ranks' cores, `dflop.runtime.run` loads each step's samples at its start). A sample whose media cannot be read
(`UnreadableMedia`: a corrupt image, a video cut short) comes back with its ``error`` set instead
of failing the whole step; the trainer then skips it on every rank (`dflop.runtime.skipping`).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import pandas as pd
import torch

from dflop.data.training import LoadedSample, Request, SampleRules, TrainingData, UnreadableMedia
from dflop.scheduler.online import StepPlan
from dflop.runtime.topology import Topology
from dflop.runtime.vision import feature_rows


def feature_rows_fn(rules: SampleRules) -> Callable[[pd.DataFrame], np.ndarray]:
    """shapes rows -> [n] rows of vision features each sample sends to the LLM (`feature_rows`)."""
    per_tile = int(rules.arch_params.get("tokens_per_tile", 0))

    def rows(shapes: pd.DataFrame) -> np.ndarray:
        return np.array([feature_rows(rules.arch, t, v, per_tile)
                         for t, v in zip(shapes["n_tiles"], shapes["vision_tokens"])], dtype=np.int64)

    return rows


def decode_seconds(plan: StepPlan, topo: Topology, loaded: dict[int, LoadedSample]) -> np.ndarray:
    """[m] seconds this rank spent loading the samples of each execution position that the pricing
    charges to its stage's forward (`dflop.pricing.pricing.Pricing.load_s`): pixels on the first
    vision stage; text-only samples, or every sample under a colocated tower, on the first LLM stage.
    What the trainer adds to its measured forwards where it loads each step in the step (CPU)."""
    seconds = np.zeros(plan.n_microbatches)
    vision, llm = topo.vision_role, topo.llm_role
    colocated = topo.plan.colocated

    def add(position: int, batch_index: int) -> None:
        sample = loaded.get(plan.rows[batch_index])
        if sample is not None:
            seconds[position] += sample.load_s

    for p in range(plan.n_microbatches):
        if vision is not None and vision.is_first and not colocated:
            for i in plan.vision_shares[p][vision.replica]:
                add(p, i)
        if llm is not None and llm.is_first:
            for i in plan.bins[p][llm.replica]:
                if colocated or plan.n_tiles[i] == 0:
                    add(p, i)
    return seconds


def requests_for(plan: StepPlan, topo: Topology) -> list[Request]:
    """The loads this rank needs for `plan`, keyed by training-pool index (one Request per sample)."""
    want: dict[int, dict[str, bool]] = {}

    def need(batch_index: int, **parts: bool) -> None:
        entry = want.setdefault(batch_index, {"layout": False, "tokens": False, "pixels": False})
        for key, value in parts.items():
            entry[key] = entry[key] or value

    vision, llm = topo.vision_role, topo.llm_role
    if vision is not None:
        for shares in plan.vision_shares:
            for i in shares[vision.replica]:
                need(i, pixels=vision.is_first, layout=vision.is_last)
    if llm is not None and (llm.is_first or llm.is_last):
        for bins in plan.bins:
            for i in bins[llm.replica]:
                need(i, tokens=True)
    return [Request(plan.rows[i], **parts) for i, parts in sorted(want.items())]


def processors_needed(topo: Topology) -> tuple[bool, bool]:
    """(tokens, pixels): whether this rank ever loads token ids / pixels (as `requests_for` asks)."""
    vision, llm = topo.vision_role, topo.llm_role
    return llm is not None and (llm.is_first or llm.is_last), vision is not None and vision.is_first


class _StepSampler(torch.utils.data.Sampler):
    """The current step's requests; set before each pass over the persistent loader."""

    def __init__(self):
        self.requests: list[Request] = []

    def __iter__(self):
        return iter(list(self.requests))

    def __len__(self) -> int:
        return len(self.requests)


def _keep(sample: LoadedSample) -> LoadedSample:
    return sample


class _Tolerant(torch.utils.data.Dataset):
    """`TrainingData` whose samples with unreadable media come back as a `LoadedSample` with
    ``error`` set; any other error fails the load."""

    def __init__(self, data: TrainingData):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, request: Request) -> LoadedSample:
        start = time.perf_counter()
        try:
            sample = self.data[request]
        except UnreadableMedia as exc:
            return LoadedSample(request.index, error=str(exc))
        return dataclasses.replace(sample, load_s=time.perf_counter() - start)


class StepLoader:
    """Loads one step's requests at a time, in the background (module docstring).

    device: the rank's device; on CUDA the loader pins its samples' memory, and its thread makes
    that device its current one (a new thread's is device 0, and the loader pins there, or in the
    pin-memory thread the DataLoader starts from it: every rank would create a CUDA context, and
    its memory, on GPU 0)."""

    def __init__(self, data: TrainingData, *, workers: int = 0, device: torch.device = torch.device("cpu")):
        self._sampler = _StepSampler()
        cuda = device.type == "cuda"
        self._loader = torch.utils.data.DataLoader(
            _Tolerant(data), sampler=self._sampler, batch_size=None, collate_fn=_keep, num_workers=workers,
            pin_memory=cuda, persistent_workers=workers > 0)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflop-loader",
                                          initializer=torch.cuda.set_device if cuda else None,
                                          initargs=(device,) if cuda else ())
        self._pending: Future | None = None
        self._data, self._workers = data, workers

    def prepare(self, *, tokens: bool, pixels: bool) -> None:
        """Build the processors the loads will need (`TrainingData.prepare`) now, before any step,
        where this process loads (no worker processes: those build their own)."""
        if self._workers == 0:
            self._data.prepare(tokens=tokens, pixels=pixels)

    def start(self, requests: list[Request]) -> Future:
        """Begin loading; the future gives {pool index: LoadedSample}. One step in flight at a time."""
        if self._pending is not None and not self._pending.done():
            self._pending.result()
        self._pending = self._thread.submit(self._load, list(requests))
        return self._pending

    def _load(self, requests: list[Request]) -> dict[int, LoadedSample]:
        self._sampler.requests = requests
        return {sample.index: sample for sample in self._loader} if requests else {}

    def close(self) -> None:
        self._thread.shutdown(wait=True)
