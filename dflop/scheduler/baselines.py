"""Baseline partitioning policies, for comparison with the DFLOP portfolio.

Each returns ``bin_of`` [n], the bin ``b = j * dp_llm + r`` of every sample, and runs its
microbatches in id order (as those systems do).

- megatron: data-blind. DP replica ``r`` takes the ``r``-th contiguous slice of the global batch,
  cut into ``m`` contiguous microbatches of (nearly) equal sample count.
- llava_group: LLaVA's group-by-modality-length sampler. Multimodal and text-only samples are
  grouped apart; within each group samples are shuffled, cut into megabatches of one microbatch
  across all replicas, sorted by length, and split over the replicas into chunks of equal count
  and even total length (each sample to the currently shortest chunk). Megabatches are shuffled,
  the two groups' leftovers form a last mixed megabatch, and the result is cut into microbatches
  in that order. LLaVA's length is the text length; without one, the LLM cost is used.
- lpt1d: longest-processing-time on the LLM cost alone (forward + backward, all stages): samples
  by decreasing cost, each to the least-loaded of the ``m * dp_llm`` bins; vision ignored.
"""

from __future__ import annotations

import heapq

import numpy as np


def _cut(order: np.ndarray, m: int, dp_llm: int) -> np.ndarray:
    """Consecutive samples of `order` -> microbatch j's slice, itself cut into dp_llm replica chunks."""
    bin_of = np.empty(len(order), dtype=np.int64)
    for j, mb in enumerate(np.array_split(order, m)):
        for r, chunk in enumerate(np.array_split(mb, dp_llm)):
            bin_of[chunk] = j * dp_llm + r
    return bin_of


def megatron(n: int, m: int, dp_llm: int) -> np.ndarray:
    bin_of = np.empty(n, dtype=np.int64)
    for r, rank_slice in enumerate(np.array_split(np.arange(n), dp_llm)):
        for j, mb in enumerate(np.array_split(rank_slice, m)):
            bin_of[mb] = j * dp_llm + r
    return bin_of


def _even_chunks(indices: list[int], lengths: np.ndarray, n_chunks: int) -> list[list[int]]:
    if len(indices) % n_chunks:
        return [indices[c::n_chunks] for c in range(n_chunks)]
    per_chunk = len(indices) // n_chunks
    chunks: list[list[int]] = [[] for _ in range(n_chunks)]
    totals = [0.0] * n_chunks
    for i in indices:
        c = totals.index(min(totals))
        chunks[c].append(i)
        totals[c] += float(lengths[i])
        if len(chunks[c]) == per_chunk:
            totals[c] = float("inf")
    return chunks


def _length_grouped(indices: np.ndarray, lengths: np.ndarray, mega: int, dp_llm: int,
                    rng: np.random.Generator) -> list[list[int]]:
    shuffled = indices[rng.permutation(len(indices))]
    megabatches = []
    for start in range(0, len(shuffled), mega):
        chunk = sorted(shuffled[start:start + mega].tolist(), key=lambda i: -lengths[i])
        megabatches.append([i for part in _even_chunks(chunk, lengths, dp_llm) for i in part])
    return megabatches


def llava_group(lengths: np.ndarray, is_multimodal: np.ndarray, m: int, dp_llm: int, seed: int) -> np.ndarray:
    n = len(lengths)
    rng = np.random.default_rng(seed)
    mega = max(1, n // m)
    mm = _length_grouped(np.flatnonzero(is_multimodal), lengths, mega, dp_llm, rng)
    lang = _length_grouped(np.flatnonzero(~is_multimodal), lengths, mega, dp_llm, rng)
    leftover = (mm[-1] if mm else []) + (lang[-1] if lang else [])
    full = mm[:-1] + lang[:-1]
    full = [full[k] for k in rng.permutation(len(full))]
    if leftover:
        full.append(sorted(leftover))
    order = np.array([i for mb in full for i in mb], dtype=np.int64)
    return _cut(order, m, dp_llm)


def lpt1d(llm_cost: np.ndarray, m: int, dp_llm: int) -> np.ndarray:
    n_bins = m * dp_llm
    heap = [(0.0, b) for b in range(n_bins)]
    bin_of = np.empty(len(llm_cost), dtype=np.int64)
    for i in np.argsort(-llm_cost, kind="stable"):
        load, b = heapq.heappop(heap)
        bin_of[i] = b
        heapq.heappush(heap, (load + float(llm_cost[i]), b))
    return bin_of
