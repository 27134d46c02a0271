"""Bytes of training state per parameter, and how many microbatches 1F1B keeps in flight.

Training state per parameter with AdamW (no ZeRO/FSDP sharding; each DP replica holds it all),
under the one precision contract (`dflop.models.precision`: float32 master weights, bf16 autocast
for ``model.dtype`` bfloat16):

=============  =====  ====  =========================================  =====
model.dtype    param  grad  optimizer state                            total
=============  =====  ====  =========================================  =====
float32        4      4     8  (exp_avg + exp_avg_sq, fp32)              16
bfloat16       4      4     8  (the same: parameters stay float32)       16
=============  =====  ====  =========================================  =====

With bfloat16 each microbatch in flight also holds the bf16 copy of its stage's weights that
autocast made for its forward (2 bytes per parameter): an activation of the microbatch, not state.
Profiled cost models measure it with the layer's other saved tensors; the analytic one adds it
(`dflop.costmodel.analytic`).

Sharded over ``dp`` data-parallel replicas (``shard_optimizer``: FSDP2, ZeRO-2 as
`dflop.runtime.sharding` runs it), per parameter, at the peak of a step (end of its last backward,
before the reduce-scatter), with p, g, o the unsharded row's bytes:

=========  ===========================================================  ==================
part       held                                                          bytes
=========  ===========================================================  ==================
param      the gathered (unsharded) copy the step computes with, and     p + p / dp
           the 1/dp shard FSDP2 keeps (what the optimizer updates)
grad       the full gradient accumulated over the step's microbatches   g
           (the 1/dp reduce-scattered shard replaces it after the peak)
optimizer  the 1/dp shard's AdamW state                                 o / dp
=========  ===========================================================  ==================

float32, dp = 2: 4 + 2 + 4 + 4 = 14 bytes (16 unsharded); dp = 8: 4 + 0.5 + 4 + 1 = 9.5. Between
steps only the shards are held, (p + g + o) / dp. FSDP2 pads each tensor's first dimension to a
multiple of dp (a few rows; not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.errors import UserError

_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "torch.float32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16", "torch.float16": "float16",
}


@dataclass(frozen=True)
class TrainingStateBytes:
    """Bytes per parameter of the weight, its gradient and its AdamW state."""

    param: float
    grad: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer


_STATE_BYTES = {
    "float32": TrainingStateBytes(param=4, grad=4, optimizer=8),
    "bfloat16": TrainingStateBytes(param=4, grad=4, optimizer=8),
    "float16": TrainingStateBytes(param=4, grad=4, optimizer=8),
}


def canonical_dtype(dtype: str) -> str:
    """'torch.bfloat16', 'bf16', ... -> 'bfloat16'."""
    try:
        return _DTYPE_ALIASES[str(dtype).strip().lower()]
    except KeyError:
        raise UserError(f"unsupported training dtype {dtype!r}; use float32, bfloat16 or float16") from None


def training_state_bytes(dtype: str, shard_over: int = 1) -> TrainingStateBytes:
    """AdamW training-state bytes per parameter for weights stored in `dtype`, held at the peak of a
    step with the state sharded over `shard_over` data-parallel replicas (1: not sharded; tables above)."""
    full = _STATE_BYTES[canonical_dtype(dtype)]
    if shard_over < 1:
        raise UserError(f"shard_over must be at least 1, got {shard_over}")
    if shard_over == 1:
        return full
    return TrainingStateBytes(param=full.param * (1 + 1 / shard_over), grad=full.grad,
                              optimizer=full.optimizer / shard_over)


def sharded_state_scale(dtype: str, shard_over):
    """Training state held at a step's peak with sharding over `shard_over` replicas, as a fraction of
    the unsharded state (the same for every parameter; broadcasts over arrays of `shard_over`):
    ``(p (1 + 1/dp) + g + o / dp) / (p + g + o)``; 1 at dp = 1 (`training_state_bytes`)."""
    full = _STATE_BYTES[canonical_dtype(dtype)]
    dp = np.asarray(shard_over, dtype=np.float64)
    if np.any(dp < 1):
        raise UserError(f"shard_over must be at least 1, got {shard_over}")
    return np.where(dp > 1, (full.param * (1 + 1 / dp) + full.grad + full.optimizer / dp) / full.total, 1.0)
