"""Packed sequences: several samples in one row, attention kept inside each sample.

An LLM stage gets one packed row of T = sum(lengths) tokens. Position ids restart at 0 for every
sample, labels are shifted inside each sample (a sample's last token predicts nothing), and the
attention kernel sees the sample boundaries as cumulative lengths (``cu_seqlens``):

- flash-attn ``flash_attn_varlen_func`` when it is importable and the tensors are half precision
  on CUDA;
- otherwise SDPA with a causal mask per sample: one batched call when all samples have the same
  length, one call per sample if not. The cost is sum(L_i^2), as with varlen, not T^2.

The function is registered with transformers' `AttentionInterface` as ``"dflop_packed"``; without
``cu_seq_lens_*`` arguments it is plain transformers SDPA, so a model built with it behaves exactly
like ``attn_implementation="sdpa"`` when called the usual way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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


@dataclass(frozen=True)
class PackedSequence:
    """Boundaries of the samples packed into one row of T tokens.

    position_ids: [T] int64, restarting at 0 for each sample.
    cu_seqlens: [n + 1] int32 cumulative lengths (0, L_0, L_0 + L_1, ..., T).
    """

    lengths: tuple[int, ...]
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str = "cpu") -> "PackedSequence":
        lengths = tuple(int(n) for n in lengths)
        if not lengths or min(lengths) < 1:
            raise UserError(f"packed sequence: every sample needs at least one token, got lengths {lengths}")
        position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(torch.tensor(lengths, device=device), 0)
        return cls(lengths=lengths, position_ids=position_ids, cu_seqlens=cu)

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)

    def attention_kwargs(self) -> dict:
        """Keyword arguments transformers' attention layers forward to the attention function."""
        return dict(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
                    max_length_q=self.max_seqlen, max_length_k=self.max_seqlen)

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """[T] next-token targets: labels moved left by one inside each sample, -100 at its end."""
        if labels.shape != (self.total_tokens,):
            raise UserError(f"packed sequence: labels have shape {tuple(labels.shape)}, "
                            f"expected ({self.total_tokens},)")
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:-1] = labels[1:]
        shifted[self.cu_seqlens[1:].long() - 1] = IGNORE_INDEX
        return shifted


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
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of query [1, H, T, d] over key/value [1, H_kv, T, d] -> [1, T, H, d].

    With ``cu_seq_lens_q`` each sample attends only to itself (causally for causal modules);
    without it, this is transformers' SDPA attention with the given mask.
    """
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch {query.shape[0]}")
    same_keys = cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q or torch.equal(cu_seq_lens_k, cu_seq_lens_q)
    if not same_keys:
        raise ValueError("packed attention needs the same sample boundaries for queries and keys")
    causal = module.is_causal if is_causal is None else is_causal
    dropout = dropout if module.training else 0.0
    if _can_use_flash(query):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, d]
        max_len = int(max_length_q) if max_length_q is not None else int(cu_seq_lens_q.diff().max())
        cu = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
        out = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, dropout_p=dropout,
                                     softmax_scale=scaling, causal=causal)
        return out.unsqueeze(0), None
    return _sdpa_per_sample(query, key, value, cu_seq_lens_q, causal, scaling, dropout), None


def _can_use_flash(query: torch.Tensor) -> bool:
    return flash_attn_varlen_func is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


def _sdpa_per_sample(query, key, value, cu_seqlens, causal, scaling, dropout) -> torch.Tensor:
    """SDPA restricted to each sample; [1, H, T, d] inputs -> [1, T, H, d]."""
    lengths = cu_seqlens.diff().tolist()
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


AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
