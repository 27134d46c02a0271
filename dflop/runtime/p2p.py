"""Variable-shape point-to-point messages between pipeline stages.

Every microbatch has its own shapes (packed rows of different lengths, different tile counts), so
each message is a small fixed-size shape header followed by the tensor (what Megatron calls
variable_seq_lengths). An empty tensor (a microbatch with no images on this replica) is only its
header. Sends are non-blocking and their buffers are kept alive until `P2P.wait_sends`; receives
block. With a static op order per stage whose dependencies form a DAG (1F1B, GPipe), non-blocking
sends cannot deadlock.

Tags keep the channels of one pair of ranks apart on gloo: ``4 * position + 2 * direction + part``
(direction 0 = activations forward, 1 = gradients backward; part 0 = header, 1 = data). NCCL ignores
tags and matches a pair's messages in issue order, which is the same order here.

When tracing (`spans`, `dflop.runtime.spans`), a send's span is its issue (non-blocking) and
`wait_sends` is one more; a receive's span is the whole wait for the header and the data.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from dflop.runtime.spans import SpanRecorder

MAX_DIMS = 7
FORWARD, BACKWARD = 0, 1
_WHAT = ("activation", "gradient")


def _tag(position: int, direction: int, part: int) -> int:
    return 4 * position + 2 * direction + part


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

    # -- raw messages ------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, position: int, direction: int) -> None:
        """Send the shape header, then (when not empty) the tensor, without blocking."""
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"p2p: tensors of up to {MAX_DIMS} dims, got {tensor.dim()}")
        self._gate()
        with self.spans.span("p2p_send", f"send {_WHAT[direction]}", position=position,
                             nbytes=tensor.numel() * self.dtype.itemsize):
            self._send(tensor, dst, position, direction)

    def _send(self, tensor: torch.Tensor, dst: int, position: int, direction: int) -> None:
        header = torch.full((MAX_DIMS + 1,), -1, dtype=torch.int64)
        header[0] = tensor.dim()
        header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        header = header.to(self.device)
        self._pending.append((dist.isend(header, dst, tag=_tag(position, direction, 0)), header))
        if tensor.numel():
            data = tensor.detach().to(self.device, self.dtype).contiguous()
            self._pending.append((dist.isend(data, dst, tag=_tag(position, direction, 1)), data))
            self.bytes_sent += data.numel() * data.element_size()

    def recv(self, src: int, position: int, direction: int) -> torch.Tensor:
        """Receive one message sent with `send` (blocks)."""
        self._gate()
        with self.spans.span("p2p_recv", f"recv {_WHAT[direction]}", position=position) as span:
            out = self._recv(src, position, direction)
            if span is not None:
                span["nbytes"] = out.numel() * out.element_size()
        return out

    def _recv(self, src: int, position: int, direction: int) -> torch.Tensor:
        header = torch.empty(MAX_DIMS + 1, dtype=torch.int64, device=self.device)
        dist.irecv(header, src, tag=_tag(position, direction, 0)).wait()
        header = header.cpu()
        shape = tuple(int(x) for x in header[1:1 + int(header[0])])
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        if out.numel():
            dist.irecv(out, src, tag=_tag(position, direction, 1)).wait()
        return out

    def _gate(self) -> None:
        gate, self.before_first_message = self.before_first_message, None
        if gate is not None:
            gate()

    def wait_sends(self) -> None:
        """Complete every pending send (call once per step, before buffers may be reused)."""
        with self.spans.span("p2p_send", "wait sends"):
            for work, _ in self._pending:
                work.wait()
        self._pending.clear()

    # -- the four pipeline messages ----------------------------------------------------------

    def send_forward(self, activation: torch.Tensor, dst: int, position: int) -> None:
        """Stage output of microbatch `position` to the next stage."""
        self.send(activation, dst, position, FORWARD)

    def recv_forward(self, src: int, position: int) -> torch.Tensor:
        """Stage input of microbatch `position` from the previous stage."""
        return self.recv(src, position, FORWARD)

    def send_backward(self, grad: torch.Tensor, dst: int, position: int) -> None:
        """Gradient of this stage's input for microbatch `position`, to the previous stage."""
        self.send(grad, dst, position, BACKWARD)

    def recv_backward(self, src: int, position: int) -> torch.Tensor:
        """Gradient of this stage's output for microbatch `position`, from the next stage."""
        return self.recv(src, position, BACKWARD)
