"""One training step through the heterogeneous pipeline: vision stages, then LLM stages, 1F1B.

Every rank runs the textbook schedule for its position in the chain (`Topology.pipeline_stage`):
warm-up forwards, steady one-forward-one-backward, cool-down backwards (GPipe: all forwards, then
all backwards), over the microbatches in the order the scheduler chose. Under a plan whose LLM runs
interleaved 1F1B (``llm.schedule: interleaved``, ``llm.chunks`` = v) each LLM rank holds v model
chunks and runs Megatron-LM's interleaved order, the simulator's (`dflop.sim.llm_rank_op_order`),
each op naming its chunk; vision stages in front of it stay 1F1B with the simulator's warm-up
(`dflop.sim.vision_op_order`), so the executor runs exactly the order the step was priced with.
Under ZB-H1 (``llm.schedule: zb-h1``) each LLM rank runs the simulator's ZB-H1 order, whose
backward is split (`dflop.runtime.split_backward`): B computes the gradient of the stage's input
and sends it upstream at once, W (deferred as the order says) the weight gradients; vision stages
keep a whole backward in 1F1B order, as the simulator times them.
Microbatch p of the step is `StepPlan.bins[p]` (one packed row per LLM replica) and
`StepPlan.vision_shares[p]` (one share of its images per vision replica).

Under interleaving, forward and backward busy seconds per position sum the rank's chunks, and the
gradient sync is still armed before the rank's last backward (its first chunk's): the buckets of
its later chunks, launched first, then start after the pipeline, so no bucket overlaps the backward.
Under ZB-H1 it is armed before the rank's last W, the last op that adds to a weight gradient; the
sharded stages' reduce-scatter (FSDP2) runs after the pipeline, after every W, as before.

Messages (`P2P`): between stages of one module, activations forward and gradients back between
the same replica and TP rank. The last vision stage sends each LLM replica the features of the
samples of its share that belong to that replica's bin (in bin order); the first LLM stage
assembles its bin's features from every vision replica and sends their gradients back the same
way. Both sides derive which messages exist, and each one's shape, from the StepPlan alone
(`_incoming` on the receiver, the op itself on the sender, both through the `_*_shape` methods),
so a replica with nothing for another sends nothing and no message needs a shape header. Each
op is split at its messages: what it receives is received before it runs, what it sends is sent
after it, and a rank sends the op's messages and receives the next op's in one batch
(`P2P.exchange`), which NCCL needs where neighbouring stages both send and receive. In colocated
placement the vision tower runs inside LLM stage 0's forward, with no messages.

The last LLM stage's loss is the SUM of its bin's answer-token losses; the trainer divides the
summed gradients by the global answer-token count (see `dflop.runtime.optim`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from dflop.data.training import LoadedSample
from dflop.errors import UserError
from dflop.models.packing import IGNORE_INDEX, PackedSequence
from dflop.models.precision import Precision
from dflop.scheduler.online import StepPlan
from dflop.models.handle import ModelHandle
from dflop.runtime.model import RankModules
from dflop.runtime.p2p import BACKWARD, FORWARD, P2P, Message
from dflop.runtime.spans import W_SPAN, SpanRecorder
from dflop.runtime.split_backward import backward_input
from dflop.runtime.topology import VISION, Topology
from dflop.runtime.vision import VisionRunner
from dflop.sim.schedules import SPLIT_BACKWARD, first_chunk_peak, llm_rank_op_order, vision_op_order

SCHEDULES = ("1f1b", "gpipe")
PAD_TOKEN_ID = 0


def op_order(schedule: str, stage: int, n_stages: int, m: int) -> list[tuple[str, int]]:
    """The ops of one stage as ("F" | "B", position), in the order the stage runs them."""
    if schedule == "gpipe":
        return [("F", p) for p in range(m)] + [("B", p) for p in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    warmup = min(n_stages - stage - 1, m)
    ops = [("F", p) for p in range(warmup)]              # warm-up
    for i in range(m - warmup):                           # steady state: one forward, one backward
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", p) for p in range(m - warmup, m)]       # cool-down
    return ops


def rank_op_order(topo: Topology, schedule: str, m: int) -> list[tuple[str, int, int]]:
    """This rank's ops as ("F" | "B" | "W", local chunk, position), in the order it runs them:
    `op_order` of its stage (chunk 0) under a plain 1F1B plan; under interleaved 1F1B or ZB-H1 the
    simulator's orders (ZB-H1's LLM ranks: B the input gradient, W the weight gradients)."""
    lay = topo.plan.layout
    if lay.schedule == "1f1b":
        return [(kind, 0, p) for kind, p in op_order(schedule, topo.pipeline_stage, topo.n_pipeline_stages, m)]
    if lay.schedule not in ("interleaved", "zb-h1"):
        raise UserError(f"{topo.plan.source}: llm.schedule {lay.schedule}: the trainer has no executor for it "
                        f"(it runs 1f1b, interleaved and zb-h1)")
    if schedule != "1f1b":
        raise UserError(f"train.schedule {schedule} cannot run {topo.plan.source}, whose llm.schedule is "
                        f"{lay.schedule} (set train.schedule: 1f1b)")
    kinds = "FBW"
    if topo.llm_role is not None:
        return [(kinds[kind], k, p) for kind, k, p in
                llm_rank_op_order(lay.schedule, topo.llm_role.stage, lay.pp_l, m, lay.chunks)]
    lead = first_chunk_peak(llm_rank_op_order(lay.schedule, 0, lay.pp_l, m, lay.chunks))
    return [(kinds[kind], 0, p) for kind, p in
            vision_op_order(lay.schedule, topo.vision_role.stage, lay.n_vision_stages, lead, m)]


def host_cat(tensors: list[torch.Tensor], *, pin: bool) -> torch.Tensor:
    """`torch.cat` of host tensors; with `pin`, into page-locked memory (`pinned_empty`). cat's own
    output is pageable whatever its inputs (it drops the loader's pinning), and a ``non_blocking``
    copy from pageable memory to a GPU is a synchronous one."""
    if not pin:
        return torch.cat(tensors)
    first = tensors[0]
    out = pinned_empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.dtype)
    return torch.cat(tensors, out=out)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised page-locked host tensor (from torch's caching host allocator, which keeps a
    block from reuse until the copies queued from it have run)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


#: TEST HOOK (tests/runtime/test_drift.py): "<pipeline stage>:<k>" makes that stage's every
#: forward and backward take k times its compute (a sleep inside the timed window; CPU only): a
#: known drift for the adaptive correction to learn. Read once per executor; unset, it costs nothing.
DRIFT_ENV = "DFLOP_TEST_STAGE_DRIFT"


def injected_slowdown(stage: int) -> float:
    """The `DRIFT_ENV` slowdown of pipeline stage `stage` (1.0: none)."""
    import os

    spec = os.environ.get(DRIFT_ENV)
    if not spec:
        return 1.0
    target, _, k = spec.partition(":")
    return float(k) if int(target) == stage else 1.0


class StageTimer:
    """Busy seconds of this rank's forward and backward per microbatch position (compute only,
    not waiting for messages). On CUDA, events are read once at the end of the step. Each
    measurement is also a forward / backward span of `spans` (when it records: `dflop.runtime.spans`).
    slowdown: > 1 only under the `DRIFT_ENV` test hook."""

    def __init__(self, m: int, device: torch.device, spans: SpanRecorder | None = None, slowdown: float = 1.0):
        self.cuda = device.type == "cuda"
        self.slowdown = slowdown
        self.fwd = np.zeros(m)
        self.bwd = np.zeros(m)
        self.spans = spans if spans is not None else SpanRecorder()
        self._events: list[tuple[str, int, object, object]] = []

    @contextlib.contextmanager
    def measure(self, kind: str, position: int, name: str | None = None):
        category = "forward" if kind == "F" else "backward"
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((kind, position, start, end))
            self.spans.add(category, name or category, start, end, position=position)
            return
        t0 = time.perf_counter_ns()
        yield
        if self.slowdown != 1.0:
            time.sleep((self.slowdown - 1) * (time.perf_counter_ns() - t0) / 1e9)
        t1 = time.perf_counter_ns()
        (self.fwd if kind == "F" else self.bwd)[position] += (t1 - t0) / 1e9
        self.spans.add(category, name or category, t0, t1, position=position)

    def finish(self) -> None:
        if self._events:
            torch.cuda.synchronize()
            for kind, position, start, end in self._events:
                (self.fwd if kind == "F" else self.bwd)[position] += start.elapsed_time(end) / 1e3
            self._events.clear()


@dataclass
class StepResult:
    """What this rank measured in one step: loss sum and answer tokens (last LLM stage only, else 0),
    busy seconds per microbatch position, bytes sent."""

    loss_sum: float
    n_answer: int
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    bytes_sent: int = 0
    tokens: int = 0


@dataclass
class _Saved:
    inputs: torch.Tensor | None
    output: torch.Tensor
    features: torch.Tensor | None = None


class PipelineExecutor:
    """Runs one step's forwards and backwards on this rank (module docstring).

    arch, tokens: the model's architecture name and its image / video placeholder ids.
    pad_to_longest: baseline variant padding every sample of a bin to the bin's longest sample
        (as batch padding would): pad tokens follow each sample, get no loss, and change no result.
    precision: the mixed-precision contract (`dflop.models.precision`): forwards under its autocast,
        received stage inputs cast back to its residual-stream dtype.
    spans: where forward / backward spans go when tracing (`dflop.runtime.spans`; None: nowhere).
    """

    def __init__(self, topo: Topology, modules: RankModules, model: ModelHandle, p2p: P2P, *, image_token_id: int,
                 video_token_id: int, schedule: str = "1f1b", pad_to_longest: bool = False,
                 precision: Precision = Precision(torch.float32), device: torch.device = torch.device("cpu"),
                 spans: SpanRecorder | None = None):
        self.topo, self.modules, self.model, self.p2p = topo, modules, model, p2p
        self.spans = spans if spans is not None else SpanRecorder()
        self.image_token_id, self.video_token_id = image_token_id, video_token_id
        self.schedule, self.pad_to_longest = schedule, pad_to_longest
        self.precision, self.device = precision, device
        self.vision_runner = VisionRunner(modules.vision, modules.full) if modules.vision is not None else None
        role = topo.vision_role
        self.vision_backward = role is not None and model.vision_stage_backward(role.stage, role.n_stages)
        self.slowdown = injected_slowdown(topo.pipeline_stage)
        info = model.info
        self._vision_row = (info.vision_tokens_per_tile, info.vision_hidden)  # per tile, between vision stages
        self._d_model = info.llm_hidden
        sharding = modules.llm.sequence_sharding if modules.llm is not None else None
        self._sequence_shards = sharding.tp.size if sharding is not None else 1
        # virtual stage of each local LLM chunk; messages name chunk boundaries only when v > 1
        self._virtual = topo.rank_chunks(topo.llm_role) if topo.llm_role is not None else []
        self._chunk_tags = topo.llm_chunks > 1
        # ZB-H1: the LLM stages' backward is B then W (`split_backward`); vision stages never split
        self._split = topo.llm_role is not None and topo.plan.layout.schedule in SPLIT_BACKWARD
        rank_op_order(topo, schedule, topo.plan.microbatches)  # refuses a schedule it cannot run, now

    # -- the schedule ------------------------------------------------------------------------

    def run(self, plan: StepPlan, inputs: Mapping[int, LoadedSample],
            before_last_backward: Callable[[], None] | None = None) -> StepResult:
        """Forward and backward of every microbatch of `plan` (gradients accumulate in .grad).

        before_last_backward: called right before this rank's last op of the step that accumulates
        weight gradients (its last backward; under ZB-H1 its last W): the gradient sync starts
        all-reduces from there on, as gradients become final."""
        m = plan.n_microbatches
        self._plan, self._inputs, self._saved, self._deferred = plan, inputs, {}, {}
        self._timer = StageTimer(m, self.device, self.spans, self.slowdown)
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._n_answer = 0
        self._tokens = 0
        sent_before = self.p2p.bytes_sent
        ops = rank_op_order(self.topo, self.schedule, m)
        weights = "W" if self._split else "B"  # the ops that accumulate weight gradients
        last_backward = max((i for i, (kind, _, _) in enumerate(ops) if kind == weights), default=None)
        received = self.p2p.exchange([], self._incoming(*ops[0])) if ops else []
        for i, (kind, chunk, position) in enumerate(ops):
            if i == last_backward and before_last_backward is not None:
                before_last_backward()
            if kind == "F":
                sends = self._forward(chunk, position, received)
            elif kind == "B":
                sends = self._backward(chunk, position, received)
            else:
                sends = self._weight_backward(chunk, position)
            received = self.p2p.exchange(sends, self._incoming(*ops[i + 1]) if i + 1 < len(ops) else [])
        self.p2p.wait_sends()
        self._timer.finish()
        self.spans.label_microbatches(plan.microbatch_ids)
        if self._saved or self._deferred:
            raise RuntimeError(f"(chunk, microbatch) {sorted(self._saved)} ran forward but not backward, "
                               f"{sorted(self._deferred)} B but not W")
        return StepResult(float(self._loss_sum), self._n_answer, self._timer.fwd, self._timer.bwd,
                          self.p2p.bytes_sent - sent_before, self._tokens)

    def discard(self) -> None:
        """Drop what a step left behind when it was abandoned midway (its saved activations and
        inputs), before the step runs again."""
        self._saved, self._inputs, self._deferred = {}, {}, {}

    def _incoming(self, kind: str, k: int, p: int) -> list[Message]:
        """The messages op (kind, local chunk k, position p) receives, in the order it reads them."""
        if kind == "W":  # ZB-H1's weight gradients: local work, nothing received
            return []
        role = self.topo.vision_role if self.topo.llm_role is None else self.topo.llm_role
        if role.module == VISION:
            share = self._plan.vision_shares[p][role.replica]
            if not share:
                return []
            if kind == "F":
                return [] if role.is_first else [Message(self.topo.prev_rank(role), p, FORWARD, self._vision_shape(share))]
            if not self.vision_backward:
                return []
            if not role.is_last:
                return [Message(self.topo.next_rank(role), p, BACKWARD, self._vision_shape(share))]
            return [Message(self.topo.feature_grad_source(r), p, BACKWARD, self._feature_shape(selected))
                    for r, selected in self._share_by_llm_replica(p, share)]
        bin_ = self._plan.bins[p][role.replica]
        if not bin_:
            return []
        stage = self.modules.llm_chunks[k]
        if kind == "B":
            return [] if stage.is_last else [self._llm_message(k, p, bin_, BACKWARD, to_next=True)]
        if not stage.is_first:
            return [self._llm_message(k, p, bin_, FORWARD, to_next=False)]
        if self.topo.plan.colocated:
            return []
        return [Message(self.topo.feature_source(v), p, FORWARD, self._feature_shape(selected))
                for v, selected in self._bin_by_vision_replica(p, bin_)]

    def _forward(self, k: int, p: int, received: list[torch.Tensor]) -> list[tuple[Message, torch.Tensor]]:
        if self.topo.llm_role is None:
            return self._vision_forward(p, received)
        return self._llm_forward(k, p, received)

    def _backward(self, k: int, p: int, received: list[torch.Tensor]) -> list[tuple[Message, torch.Tensor]]:
        if self.topo.llm_role is None:
            return self._vision_backward(p, received)
        return self._llm_backward(k, p, received)

    def _llm_message(self, k: int, p: int, bin_, direction: int, *, to_next: bool) -> Message:
        """The message between local LLM chunk k and the chunk after it (`to_next`) or before it,
        for position p: peer from the chunk map (`Topology.chunk_rank`), shape from the bin."""
        c = self._virtual[k]
        other = c + 1 if to_next else c - 1
        return Message(self.topo.chunk_rank(self.topo.llm_role, other), p, direction, self._llm_shape(bin_),
                       max(c, other) if self._chunk_tags else 0)

    def _autocast(self):
        return self.precision.autocast(self.device)

    # -- helpers -----------------------------------------------------------------------------

    def _upload(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Host tensors, concatenated, on the device (on CUDA through page-locked memory: `host_cat`)."""
        return host_cat(tensors, pin=self.device.type == "cuda").to(self.device, non_blocking=True)

    def _pixels(self, share) -> torch.Tensor:
        return self._upload([self._inputs[i].pixels for i in share])

    def _layouts(self, share) -> list:
        return [self._inputs[i].layout for i in share]

    def _split_rows(self, features: torch.Tensor, samples) -> dict[int, torch.Tensor]:
        """Feature rows of each sample, from a tensor holding `samples`' rows in order."""
        sizes = [self._plan.feature_rows[i] for i in samples]
        return dict(zip(samples, torch.split(features, sizes)))

    def _share_by_llm_replica(self, p: int, share) -> list[tuple[int, list[int]]]:
        """Last vision stage: (LLM replica, the samples of `share` in its bin, in bin order) for
        every replica with any: one feature message each."""
        mine = set(share)
        pairs = [(r, [i for i in self._plan.bins[p][r] if i in mine]) for r in range(self.topo.plan.llm.dp)]
        return [(r, selected) for r, selected in pairs if selected]

    def _bin_by_vision_replica(self, p: int, bin_) -> list[tuple[int, list[int]]]:
        """First LLM stage: (vision replica, the samples of `bin_` in its share, in bin order) for
        every replica with any: one feature message each."""
        shares = [set(share) for share in self._plan.vision_shares[p]]
        pairs = [(v, [i for i in bin_ if i in shares[v]]) for v in range(self.topo.plan.vision.dp)]
        return [(v, selected) for v, selected in pairs if selected]

    # -- message shapes (the same on both ends: the plan's numbers and the model's widths) -----

    def _vision_shape(self, share) -> tuple[int, ...]:
        """Hidden states between vision stages: [tiles of the share, tokens per tile, d_vision]."""
        return (sum(self._plan.n_tiles[i] for i in share), *self._vision_row)

    def _feature_shape(self, samples) -> tuple[int, ...]:
        """Image features of `samples` (or their gradient): [their feature rows, d_model]."""
        return (sum(self._plan.feature_rows[i] for i in samples), self._d_model)

    def _llm_shape(self, bin_) -> tuple[int, ...]:
        """Hidden states between LLM stages: [1, T, d_model] of the packed row, or under sequence
        parallelism this rank's shard of the row padded to a multiple of tp (`SequenceSharding`)."""
        tokens = sum(self._lengths(bin_))
        return (1, -(-tokens // self._sequence_shards), self._d_model)

    def _lengths(self, bin_) -> list[int]:
        lengths = [self._plan.seq_len[i] for i in bin_]
        return [max(lengths)] * len(lengths) if self.pad_to_longest else lengths

    def _padded(self, tensors: list[torch.Tensor], lengths: list[int], fill: int) -> list[torch.Tensor]:
        """The pieces of a packed row: each sample's tensor, then `fill` up to its length."""
        out = []
        for t, n in zip(tensors, lengths):
            out.append(t)
            if n > t.numel():
                out.append(torch.full((n - t.numel(),), fill, dtype=t.dtype))
        return out

    # -- vision stages (disjoint placement) --------------------------------------------------

    def _vision_forward(self, p: int, received: list[torch.Tensor]) -> list[tuple[Message, torch.Tensor]]:
        role, stage = self.topo.vision_role, self.modules.vision
        share = self._plan.vision_shares[p][role.replica]
        if not share:
            return []
        if stage.is_first:
            x = self._pixels(share)
        else:
            x = received[0].to(self.precision.stream_dtype)
            x.requires_grad_(self.vision_backward and self.model.vision_sends_input_grad())
        layouts = self._layouts(share) if stage.is_last else None
        with self._timer.measure("F", p), torch.set_grad_enabled(self.vision_backward), self._autocast():
            out = self.vision_runner(x, layouts)
        if self.vision_backward:
            self._saved[0, p] = _Saved(x, out)
        if not stage.is_last:
            return [(Message(self.topo.next_rank(role), p, FORWARD, self._vision_shape(share)), out)]
        rows = self._split_rows(out, share)
        sends = []
        destinations = self.topo.feature_destinations()
        for r, selected in self._share_by_llm_replica(p, share):
            message = torch.cat([rows[i] for i in selected])
            sends += [(Message(dst, p, FORWARD, self._feature_shape(selected)), message) for dst in destinations[r]]
        return sends

    def _vision_backward(self, p: int, received: list[torch.Tensor]) -> list[tuple[Message, torch.Tensor]]:
        role, stage = self.topo.vision_role, self.modules.vision
        share = self._plan.vision_shares[p][role.replica]
        if not share or not self.vision_backward:
            return []
        saved = self._saved.pop((0, p))
        if stage.is_last:
            grads = {}
            for (_, selected), message in zip(self._share_by_llm_replica(p, share), received, strict=True):
                grads.update(self._split_rows(message, selected))
            grad = torch.cat([grads[i] for i in share])
        else:
            (grad,) = received
        with self._timer.measure("B", p):
            saved.output.backward(grad.to(saved.output.dtype))
        if stage.is_first or not self.model.vision_sends_input_grad():
            return []
        return [(Message(self.topo.prev_rank(role), p, BACKWARD, self._vision_shape(share)), saved.inputs.grad)]

    # -- LLM stages --------------------------------------------------------------------------

    def _features(self, p: int, bin_, received: list[torch.Tensor]) -> torch.Tensor | None:
        """Image features of a bin, in bin order (received, or encoded here when colocated)."""
        role = self.topo.llm_role
        if self.topo.plan.colocated:
            share = self._plan.vision_shares[p][role.replica]
            if not share:
                return None
            pixels = self._pixels(share)
            with self._timer.measure("F", p, "vision forward"), \
                    torch.set_grad_enabled(self.model.vision_side_trainable), \
                    self._autocast():
                return self.vision_runner(pixels, self._layouts(share))
        rows: dict[int, torch.Tensor] = {}
        for (_, selected), message in zip(self._bin_by_vision_replica(p, bin_), received, strict=True):
            rows.update(self._split_rows(message, selected))
        if not rows:
            return None
        features = torch.cat([rows[i] for i in self._with_tiles(bin_)])
        return features.requires_grad_(self.model.vision_side_trainable)

    def _with_tiles(self, bin_) -> list[int]:
        """The bin's samples that have images, in bin order (the order of its feature rows)."""
        return [i for i in bin_ if self._plan.n_tiles[i] > 0]

    def _llm_forward(self, k: int, p: int, received: list[torch.Tensor]) -> list[tuple[Message, torch.Tensor]]:
        role, stage = self.topo.llm_role, self.modules.llm_chunks[k]
        bin_ = self._plan.bins[p][role.replica]
        if not bin_:
            return []
        lengths = self._lengths(bin_)
        packed = PackedSequence.from_lengths(lengths, device=self.device)
        features = None
        if stage.is_first:
            # Features arrive in sequence order, so video placeholders splice like image ones.
            ids = [t.masked_fill(t == self.video_token_id, self.image_token_id)
                   for t in (self._inputs[i].input_ids for i in bin_)]
            x = self._upload(self._padded(ids, lengths, PAD_TOKEN_ID))
            features = self._features(p, bin_, received)
            self._tokens += sum(self._plan.seq_len[i] for i in bin_)
        else:
            x = received[0].to(self.precision.stream_dtype)
            x.requires_grad_(True)
        kwargs = {"image_features": features} if stage.is_first else {}
        if stage.is_last:
            # targets shifted and counted on the host: no device read-back per microbatch
            labels = torch.cat(self._padded([self._inputs[i].labels for i in bin_], lengths, IGNORE_INDEX))
            shift = PackedSequence.from_lengths(lengths).shift_labels(labels)
            self._n_answer += int((shift != IGNORE_INDEX).sum())
            kwargs.update(shift_labels=self._upload([shift]), num_items_in_batch=1)  # loss = sum over answer tokens
        with self._timer.measure("F", p), self._autocast():
            out = stage(x, packed, **kwargs)
        self._saved[k, p] = _Saved(None if stage.is_first else x, out, features)
        if stage.is_last:
            self._loss_sum += out.detach().double()  # on the device; read once, at the step's end
            return []
        return [(self._llm_message(k, p, bin_, FORWARD, to_next=True), out)]

    def _llm_backward(self, k: int, p: int, received: list[torch.Tensor]) -> list[tuple[Message, torch.Tensor]]:
        role, stage = self.topo.llm_role, self.modules.llm_chunks[k]
        bin_ = self._plan.bins[p][role.replica]
        if not bin_:
            return []
        saved = self._saved.pop((k, p))
        grad = None if stage.is_last else received[0]
        with self._timer.measure("B", p):
            if saved.output.requires_grad:
                grad = None if grad is None else grad.to(saved.output.dtype)
                if self._split:
                    self._backward_input(k, p, saved, grad)
                else:
                    saved.output.backward(grad)
        if not stage.is_first:
            return [(self._llm_message(k, p, bin_, BACKWARD, to_next=False), saved.inputs.grad)]
        if self.topo.plan.colocated or saved.features is None or not self.model.vision_side_trainable:
            return []
        rows = self._split_rows(saved.features.grad, self._with_tiles(bin_))
        sends = []
        destinations = self.topo.feature_grad_destinations()
        for v, selected in self._bin_by_vision_replica(p, bin_):
            message = torch.cat([rows[i] for i in selected])
            sends += [(Message(dst, p, BACKWARD, self._feature_shape(selected)), message) for dst in destinations[v]]
        return sends

    # -- ZB-H1's split backward (LLM stages) -----------------------------------------------------

    def _backward_input(self, k: int, p: int, saved: _Saved, grad: torch.Tensor | None) -> None:
        """B: the gradient of the stage's inputs (left in their ``.grad``, as a whole backward
        leaves it, for the messages upstream); the weight gradients are kept for W. A first stage's
        inputs are the received image features (disjoint placement); colocated, it has none, and W
        is the whole backward."""
        inputs = [saved.inputs] if saved.inputs is not None else []
        if saved.features is not None and not self.topo.plan.colocated and saved.features.is_leaf:
            inputs.append(saved.features)
        full = self.modules.llm_chunks[k].recompute == "full"  # one W pass: one recomputation per layer
        dinputs, self._deferred[k, p] = backward_input([saved.output], [grad], inputs, one_pass=full)
        for t, d in zip(inputs, dinputs):
            t.grad = d

    def _weight_backward(self, k: int, p: int) -> list[tuple[Message, torch.Tensor]]:
        """W: the weight gradients B of (k, p) left (none where its bin was empty or nothing trains)."""
        weight = self._deferred.pop((k, p), None)
        if weight is not None:
            with self._timer.measure("W", p, W_SPAN):
                weight.run()
        return []
