"""Packed sequences: several samples in one row, attention kept inside each sample.

An LLM stage gets one packed row of T = sum(lengths) tokens. Position ids restart at 0 for every
sample, labels are shifted inside each sample (a sample's last token predicts nothing), and the
attention kernel sees the sample boundaries as cumulative lengths (``cu_seqlens``) and, on the
host, as the lengths themselves (known from the step's partition, so no kernel syncs the host to
read them back, once per layer, from the device).

The kernel (`PACKED_KERNELS`, setting ``model.packed_attention``; every one costs sum(L_i^2), not T^2):

- ``sdpa``: SDPA with a causal mask per sample: one batched call when all samples have the same
  length (the padded baseline's rows), one call per sample if not. Runs everywhere.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; CUDA, half precision).
- ``flex``: ``flex_attention`` with a document mask (block mask built once per row; compiled on
  CUDA; CPU has no backward for it).
- ``flash_attn``: flash-attn's ``flash_attn_varlen_func`` (the optional ``gpu`` extra).
- ``auto`` (the default): flash_attn, else varlen where they can run (CUDA, half precision), else
  sdpa. That order is what `benchmarks/gpu/bench_attention.py` measured on an H200
  (benchmarks/README.md).

The function is registered with transformers' `AttentionInterface` as ``"dflop_packed"``; without
``cu_seq_lens_*`` arguments it is plain transformers SDPA, so a model built with it behaves exactly
like ``attn_implementation="sdpa"`` when called the usual way. Under autocast it casts query, key
and value to the autocast dtype (rotary embeddings make query and key float32 while value comes
from a bf16 matmul): the kernels above need one dtype, and the half-precision ones need half.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dflop.errors import UserError

PACKED_ATTENTION = "dflop_packed"
IGNORE_INDEX = -100

try:  # optional GPU dependency (pyproject extra "gpu")
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch version
    varlen_attn = None

#: The packed-attention kernels (module docstring), and "auto".
PACKED_KERNELS = ("auto", "sdpa", "varlen", "flex", "flash_attn")


@dataclass(frozen=True)
class PackedSequence:
    """Boundaries of the samples packed into one row of T tokens.

    position_ids: [T] int64, restarting at 0 for each sample.
    cu_seqlens: [n + 1] int32 cumulative lengths (0, L_0, L_0 + L_1, ..., T).
    cache: what a kernel derives once per row and reuses in every layer (flex's block mask).
    """

    lengths: tuple[int, ...]
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str = "cpu") -> "PackedSequence":
        lengths = tuple(int(n) for n in lengths)
        if not lengths or min(lengths) < 1:
            raise UserError(f"packed sequence: every sample needs at least one token, got lengths {lengths}")
        position_ids = torch.cat([torch.arange(n) for n in lengths])
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
        return cls(lengths=lengths, position_ids=_to_device(position_ids, device), cu_seqlens=_to_device(cu, device))

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)

    def attention_kwargs(self) -> dict:
        """Keyword arguments transformers' attention layers forward to the attention function: the
        boundaries as transformers' flash kernels take them, and this row itself (host lengths)."""
        return dict(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
                    max_length_q=self.max_seqlen, max_length_k=self.max_seqlen, packed_sequence=self)

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """[T] next-token targets: labels moved left by one inside each sample, -100 at its end."""
        if labels.shape != (self.total_tokens,):
            raise UserError(f"packed sequence: labels have shape {tuple(labels.shape)}, "
                            f"expected ({self.total_tokens},)")
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:-1] = labels[1:]
        shifted[self.cu_seqlens[1:].long() - 1] = IGNORE_INDEX
        return shifted


def _to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through page-locked memory without blocking (a copy from
    pageable memory waits for the GPU: two host syncs per microbatch and stage)."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# -- kernel selection ------------------------------------------------------------------------------

_selected = "auto"


def select_packed_kernel(name: str, *, device_type: str | None = None, compute_dtype: torch.dtype | None = None) -> None:
    """Use kernel `name` (one of `PACKED_KERNELS`) for packed rows in this process, from here on.
    The trainer and the model profiler call it with ``model.packed_attention``, so the profile
    times the kernel training runs; with the run's device type and compute dtype, a half-precision
    CUDA kernel asked for where it cannot run is refused here, before any model is built."""
    global _selected
    if name not in PACKED_KERNELS:
        raise UserError(f"model.packed_attention: unknown kernel {name!r}; known: {', '.join(PACKED_KERNELS)}")
    half = compute_dtype in (torch.float16, torch.bfloat16)
    if name in ("varlen", "flash_attn") and device_type is not None and (device_type != "cuda" or not half):
        raise UserError(f"model.packed_attention: {name} runs on CUDA in half precision only, and this run computes "
                        f"in {compute_dtype} on {device_type} (model.dtype bfloat16 on cuda, or auto)")
    if name == "flash_attn" and flash_attn_varlen_func is None:
        raise UserError("model.packed_attention: flash_attn asked for but the flash-attn package is not installed "
                        "(pip install 'dflop[gpu]'), or use auto")
    if name == "varlen" and varlen_attn is None:
        raise UserError(f"model.packed_attention: varlen needs torch >= 2.10 (this is {torch.__version__}); use auto")
    _selected = name


def selected_packed_kernel() -> str:
    return _selected


def kernel_for(query: torch.Tensor, name: str | None = None) -> str:
    """The concrete kernel `name` (default: the selected one) runs as for `query`: auto resolved, and a
    half-precision CUDA kernel asked for where it cannot run is an error (not a silent fallback)."""
    name = _selected if name is None else name
    half_cuda = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        if half_cuda and flash_attn_varlen_func is not None:
            return "flash_attn"
        return "varlen" if half_cuda and varlen_attn is not None else "sdpa"
    if name in ("flash_attn", "varlen") and not half_cuda:
        raise UserError(f"model.packed_attention: {name} runs on CUDA in half precision only, got "
                        f"{query.dtype} on {query.device.type} (model.dtype bfloat16 on cuda, or auto)")
    return name


# -- the attention function ------------------------------------------------------------------------

def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    packed_sequence: PackedSequence | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of query [1, H, T, d] over key/value [1, H_kv, T, d] -> [1, T, H, d].

    With ``cu_seq_lens_q`` each sample attends only to itself (causally for causal modules);
    without it, this is transformers' SDPA attention with the given mask.
    """
    query, key, value = in_compute_dtype(query, key, value)
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch {query.shape[0]}")
    same_keys = cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q or (
        packed_sequence is None and torch.equal(cu_seq_lens_k, cu_seq_lens_q))
    if not same_keys:
        raise ValueError("packed attention needs the same sample boundaries for queries and keys")
    if packed_sequence is None:  # called with boundaries only (transformers' flash convention)
        packed_sequence = PackedSequence(tuple(cu_seq_lens_q.diff().tolist()), torch.empty(0), cu_seq_lens_q)
    causal = module.is_causal if is_causal is None else is_causal
    dropout = dropout if module.training else 0.0
    kernel = kernel_for(query)
    if dropout and kernel != "sdpa":
        raise UserError(f"packed attention: attention dropout needs model.packed_attention sdpa, not {kernel}")
    return _KERNELS[kernel](query, key, value, packed_sequence, causal, scaling, dropout), None


def in_compute_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the autocast dtype when autocast is on for their device (else as they are):
    what attention kernels take (rotary leaves query and key in float32 under autocast)."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)


def _sdpa(query, key, value, packed: PackedSequence, causal, scaling, dropout) -> torch.Tensor:
    """SDPA restricted to each sample; [1, H, T, d] inputs -> [1, T, H, d]."""
    lengths = packed.lengths
    gqa = query.shape[1] != key.shape[1]
    if len(set(lengths)) == 1:
        n, length = len(lengths), lengths[0]
        # [1, H, n*L, d] -> [n, H, L, d] without copying: samples become the batch dimension.
        q, k, v = (t[0].unflatten(1, (n, length)).transpose(0, 1) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal, scale=scaling,
                                             enable_gqa=gqa)
        heads, head_dim = out.shape[1], out.shape[3]
        return out.transpose(1, 2).reshape(1, n * length, heads, head_dim)
    outs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)))
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _flash_attn(query, key, value, packed: PackedSequence, causal, scaling, dropout) -> torch.Tensor:
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, d]
    cu = _device_cu_seqlens(packed, query.device)
    out = flash_attn_varlen_func(q, k, v, cu, cu, packed.max_seqlen, packed.max_seqlen, dropout_p=dropout,
                                 softmax_scale=scaling, causal=causal)
    return out.unsqueeze(0)


def _varlen(query, key, value, packed: PackedSequence, causal, scaling, dropout) -> torch.Tensor:
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, d]
    cu = _device_cu_seqlens(packed, query.device)
    options = dict(scale=scaling)
    params = _varlen_parameters()
    if "window_size" in params:  # torch >= 2.11: causal is the window (-1, 0)
        options["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        options["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q, k, v, cu, cu, packed.max_seqlen, packed.max_seqlen, **options)
    return out.unsqueeze(0)


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(varlen_attn).parameters)


def _flex(query, key, value, packed: PackedSequence, causal, scaling, dropout) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    key_ = ("flex_block_mask", causal, query.device)
    block_mask = packed.cache.get(key_)
    if block_mask is None:  # once per row, reused by every layer
        document = torch.repeat_interleave(torch.arange(len(packed.lengths)), torch.tensor(packed.lengths))
        document = document.to(query.device)

        def same_sample(b, h, q_idx, kv_idx):
            inside = document[q_idx] == document[kv_idx]
            return inside & (q_idx >= kv_idx) if causal else inside

        total = packed.total_tokens
        block_mask = create_block_mask(same_sample, None, None, total, total, device=query.device)
        packed.cache[key_] = block_mask
    out = _flex_attention(query.device.type)(query, key, value, block_mask=block_mask, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


@functools.cache
def _flex_attention(device_type: str) -> Callable:
    """flex_attention, compiled on CUDA (eager it runs an unfused reference)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


def _device_cu_seqlens(packed: PackedSequence, device: torch.device) -> torch.Tensor:
    return packed.cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)


_KERNELS = {"sdpa": _sdpa, "varlen": _varlen, "flex": _flex, "flash_attn": _flash_attn}

AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
