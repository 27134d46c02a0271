"""A batch priced for a scheduler policy: as it is, or padded as the HF/LLaVA trainer runs it.

Policy "padded" is the HF/LLaVA trainer: Megatron's fixed-count bins (`baselines.megatron`), every
sample of an LLM bin padded to the bin's longest sequence; the planner's evaluation and the
trainer's step planner price it the same way through `price`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dflop.pricing.pool import Pool
from dflop.pricing.pricing import PlanCosts, Pricing
from dflop.scheduler import baselines


def padded_pool(batch: Pool, m: int, dp_l: int) -> Pool:
    """`batch` as the HF/LLaVA trainer runs it: Megatron's fixed-count bins in batch order
    (`dflop.scheduler.baselines.megatron`), each sample's seq_len raised to its bin's longest (pad
    tokens cost time and activation memory like real ones, attention per sample, so a bin of k
    samples costs k samples of the longest). Tiles are not padded: the vision tower batches tiles."""
    bin_of = baselines.megatron(len(batch), m, dp_l)
    longest = np.zeros(m * dp_l, dtype=batch.seq_len.dtype)
    np.maximum.at(longest, bin_of, batch.seq_len)
    return replace(batch, seq_len=longest[bin_of])


def price(pricing: Pricing, batch: Pool, policy: str) -> PlanCosts:
    """`batch` priced for `policy`: padded to its bins for "padded" (utilisation still counts only
    the real tokens' compute: padding keeps the GPU busy but is waste), as it is otherwise."""
    if policy != "padded":
        return pricing.batch(batch)
    lay = pricing.plan.layout
    padded = pricing.batch(padded_pool(batch, lay.m, lay.dp_l))
    return replace(padded, busy_gpu_s=pricing.batch(batch).busy_gpu_s)
