"""Point-to-point messages between pipeline stages, one batch per point of the schedule.

`P2P.exchange` issues what a rank sends and receives at one point of its schedule (the sends of
the op it just ran, the receives of the op it runs next) as one `dist.batch_isend_irecv`. On NCCL
a pair of ranks' operations share one stream and a large send completes only once its receive is
posted: issued one by one, two neighbouring stages that each send before they receive (1F1B's
steady state: an activation forward, a gradient back) would each wait for the other. In one batch
(one NCCL group) they progress together, as in Megatron's ``send_forward_recv_backward``.

Every microbatch has its own shapes (packed rows of different lengths, different tile counts),
but both ends derive each message's shape from the step's plan (`PipelineExecutor` in
`dflop.runtime.schedule`), so a message is only its tensor: no header, no host synchronisation to
read one. The sender checks its tensor against that shape (the receiver posted a buffer of exactly
it). A message whose shape the receiver cannot know (``shape=None``) travels as Megatron's
variable_seq_lengths do: a fixed-size shape header first, read on the host, then the tensor in a
second batch. An empty message is never sent.

Sends stay in flight until `P2P.wait_sends` (their buffers are kept alive until then); receives
are complete when `exchange` returns (on NCCL: ordered before the current stream's next work). On
NCCL a batch is one request, so the compute stream's next work also waits for that point's sends
(as in Megatron): sends overlap the next op's compute on gloo only.

Tags keep the channels of one pair of ranks apart on gloo: ``4 * position + 2 * direction + part``
(direction 0 = activations forward, 1 = gradients backward; part 0 = header, 1 = data), plus the
LLM chunk boundary in the high bits under interleaved 1F1B (`CHUNK_SHIFT`). NCCL ignores
tags and matches a pair's messages in issue order, which is the same order on both ends (under
interleaved 1F1B with pp = 2 both neighbours are one rank and that is not yet checked on NCCL).

When tracing (`spans`, `dflop.runtime.spans`), each message is a span: a send's is the issue of
its batch, a receive's the batch's issue and wait (header and data); `wait_sends` is one more.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dflop.runtime.spans import SpanRecorder

MAX_DIMS = 7
#: Elements of a shape header: the number of dims, then up to MAX_DIMS sizes (int64).
HEADER_ELEMENTS = MAX_DIMS + 1
FORWARD, BACKWARD = 0, 1
_WHAT = ("activation", "gradient")


#: A message's model-chunk boundary goes in the tag's high bits (0 for every message outside
#: interleaved 1F1B, whose tags are therefore the plain ``4 * position + 2 * direction + part``).
CHUNK_SHIFT = 20


def _tag(position: int, direction: int, part: int, chunk: int = 0) -> int:
    if not 0 <= position < 2 ** (CHUNK_SHIFT - 2) or not 0 <= chunk < 2 ** (31 - CHUNK_SHIFT):
        raise ValueError(f"p2p: position {position} / chunk boundary {chunk} does not fit in a message tag")
    return 4 * position + 2 * direction + part + (chunk << CHUNK_SHIFT)


@dataclass(frozen=True)
class Message:
    """One pipeline message as both ends name it.

    peer: the other end's global rank; position: the microbatch's execution position in the step;
    direction: FORWARD (activations) or BACKWARD (gradients); shape: the tensor's shape, known to
    both ends from the plan (None: unknown to the receiver, sent in a header); chunk: under
    interleaved 1F1B the LLM chunk boundary it crosses (virtual stage c for the activation from
    chunk c - 1 to chunk c and the gradient back), which keeps a pair's messages of one position
    apart (0 otherwise)."""

    peer: int
    position: int
    direction: int
    shape: tuple[int, ...] | None
    chunk: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class P2P:
    """Point-to-point transport of one rank.

    device: where message tensors live (the rank's CUDA device for NCCL, CPU for gloo).
    dtype: dtype of every activation / gradient on the wire (the compute dtype).
    """

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device = device
        self.dtype = dtype
        self._pending: list[tuple[object, torch.Tensor]] = []
        self.bytes_sent = 0
        self.spans = SpanRecorder()  # the trainer's recorder when it traces
        # Called (once, then cleared) before the next message: the trainer's wait for the step's
        # load agreement (`dflop.runtime.skipping.FailureCheck`), so no peer waits on a voided step.
        self.before_first_message: Callable[[], None] | None = None

    def exchange(self, sends: Sequence[tuple[Message, torch.Tensor]],
                 receives: Sequence[Message]) -> list[torch.Tensor]:
        """Send `sends` and receive `receives` (one point of the schedule) in one batch; returns
        the received tensors in the order of `receives` (empty ones for empty messages)."""
        out = [None if m.shape is None else torch.empty(m.shape, dtype=self.dtype, device=self.device)
               for m in receives]
        live = [k for k, buffer in enumerate(out) if buffer is None or buffer.numel()]
        sends = [(m, t) for m, t in sends if m.shape is None or m.numel]
        if not sends and not live:
            return out
        self._gate()
        with contextlib.ExitStack() as receiving:
            recv_spans = {k: receiving.enter_context(self.spans.span(
                "p2p_recv", f"recv {_WHAT[receives[k].direction]}", position=receives[k].position)) for k in live}
            ops, headers = [], {}
            with contextlib.ExitStack() as sending:
                for message, tensor in sends:
                    data = self._wire(message, tensor)
                    nbytes = data.numel() * data.element_size()
                    sending.enter_context(self.spans.span("p2p_send", f"send {_WHAT[message.direction]}",
                                                          position=message.position, nbytes=nbytes))
                    if message.shape is None:
                        ops.append(self._op(dist.isend, _header(data.shape).to(self.device), message, 0))
                    if data.numel():
                        ops.append(self._op(dist.isend, data, message, 1))
                    self.bytes_sent += nbytes
                for k in live:
                    if out[k] is None:
                        headers[k] = torch.empty(HEADER_ELEMENTS, dtype=torch.int64, device=self.device)
                        ops.append(self._op(dist.irecv, headers[k], receives[k], 0))
                    else:
                        ops.append(self._op(dist.irecv, out[k], receives[k], 1))
                self._issue(ops)
            if headers:  # the second half of header messages: their data, once the shapes are read
                for k, header in headers.items():
                    out[k] = torch.empty(_shape(header), dtype=self.dtype, device=self.device)
                self._issue([self._op(dist.irecv, out[k], receives[k], 1) for k in headers if out[k].numel()])
            for k, span in recv_spans.items():
                if span is not None:
                    span["nbytes"] = out[k].numel() * out[k].element_size()
        return out

    def _wire(self, message: Message, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as it travels (device, dtype, contiguous), checked against the shape the
        receiver posted a buffer for."""
        if message.shape is not None and tuple(tensor.shape) != message.shape:
            raise RuntimeError(f"p2p: {_WHAT[message.direction]} of position {message.position} to rank "
                               f"{message.peer} has shape {tuple(tensor.shape)}, but the plan says "
                               f"{message.shape} (what the receiver expects)")
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"p2p: tensors of up to {MAX_DIMS} dims, got {tensor.dim()}")
        return tensor.detach().to(self.device, self.dtype).contiguous()

    @staticmethod
    def _op(op, tensor: torch.Tensor, message: Message, part: int) -> dist.P2POp:
        return dist.P2POp(op, tensor, message.peer, tag=_tag(message.position, message.direction, part, message.chunk))

    def _issue(self, ops: list[dist.P2POp]) -> None:
        """One batch: wait for its receives; keep its sends (and their buffers) pending.

        gloo issues a batch's operations one by one (a request each): only the receives are waited
        for, so a send never holds its rank up. NCCL runs the batch as one group with one request,
        whose wait orders the current stream after the whole group (no host synchronisation)."""
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        one_by_one = len(works) == len(ops)
        for i, work in enumerate(works):
            if one_by_one and ops[i].op is dist.isend:
                self._pending.append((work, ops[i].tensor))
            else:
                work.wait()
        if not one_by_one:
            self._pending += [(None, op.tensor) for op in ops if op.op is dist.isend]

    def _gate(self) -> None:
        gate, self.before_first_message = self.before_first_message, None
        if gate is not None:
            gate()

    def wait_sends(self) -> None:
        """Complete every pending send (call once per step, before buffers may be reused)."""
        with self.spans.span("p2p_send", "wait sends"):
            for work, _ in self._pending:
                if work is not None:
                    work.wait()
        self._pending.clear()


def _header(shape: torch.Size) -> torch.Tensor:
    header = torch.full((HEADER_ELEMENTS,), -1, dtype=torch.int64)
    header[0] = len(shape)
    header[1:1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return header


def _shape(header: torch.Tensor) -> tuple[int, ...]:
    header = header.cpu()  # the host synchronisation known shapes avoid
    return tuple(int(x) for x in header[1:1 + int(header[0])])
