"""The one mixed-precision contract of training and profiling (``model.dtype``).

``float32``: everything in float32.

``bfloat16``: automatic mixed precision over float32 master weights (PyTorch AMP; what the
Hugging Face Trainer's ``bf16=True`` and torchtitan's non-FSDP path run):

- parameters, their gradients and AdamW's two moments are float32 (16 bytes per parameter);
  gradients accumulate over a step's microbatches and are all-reduced / reduce-scattered in float32;
- every forward of a stage (vision tower, projector, LLM) runs under ``torch.autocast(bfloat16)`` on
  its device, CPU included: matmuls, convolutions and attention compute in bf16, while norms,
  softmax, the loss and the residual adds stay float32 (autocast's op lists), so the residual
  stream between layers is float32; attention gets query, key and value in bf16
  (`dflop.models.packing` casts them: rotary leaves query and key in float32);
- backward runs outside autocast (torch's rule), in the dtypes its forward chose;
- pipeline messages travel in bf16 (`compute_dtype`; half the bytes) and a stage's received input is
  cast back to float32, the residual stream's dtype (`stream_dtype`).

Why AMP rather than a bf16 module copy (Megatron) or FSDP2's ``MixedPrecisionPolicy``: it is one
code path with and without tensor parallelism, FSDP2 sharding and checkpoints (state dicts, DTensor
TP, FSDP2 and the optimizer all see one set of float32 parameters), and accumulated gradients keep
float32 precision. Its cost: autocast casts each weight to bf16 once per microbatch forward and
matmuls keep that copy for their backward, so each microbatch in flight holds ~2 bytes per
parameter of its stage (not under full recomputation, which drops it with the layer's other
tensors). The model profiler runs its modules under this same contract (`autocast`, float32
parameters), so a layer's measured activation bytes include that copy and its timings the casts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dflop.errors import UserError

#: Parameters, gradients and optimizer state: float32 under every setting.
PARAM_DTYPE = torch.float32
_COMPUTE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """``model.dtype``'s contract (module docstring). compute_dtype: what matmuls and pipeline
    messages use; float32 means no autocast."""

    compute_dtype: torch.dtype

    @classmethod
    def of(cls, dtype: str) -> "Precision":
        try:
            return cls(_COMPUTE[dtype])
        except KeyError:
            raise UserError(f"model.dtype: {dtype!r} is not one of {', '.join(_COMPUTE)}") from None

    @property
    def param_dtype(self) -> torch.dtype:
        return PARAM_DTYPE

    @property
    def stream_dtype(self) -> torch.dtype:
        """The residual stream's dtype between layers (and a received stage input's)."""
        return PARAM_DTYPE

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != PARAM_DTYPE

    def autocast(self, device: torch.device | str):
        """The context every stage forward runs in on `device` (nothing for float32)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.compute_dtype)
