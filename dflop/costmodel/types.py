"""Plain data passed from the cost models to the simulator, planner and scheduler.

The fitted time models are linear in features that are sums over samples (tokens, squared sample
lengths, tiles), so the time of a pipeline stage on a microbatch is a constant plus a sum of
per-sample terms. `BatchCosts` holds exactly that decomposition for one global batch, which lets
the scheduler balance bins with additive arithmetic and still reproduce the cost model's
prediction for any grouping of samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchCosts:
    """Per-sample, per-stage costs of one global batch of n samples.

    Stage time of a set S of samples on vision stage k (forward) is
    ``vision_fwd_const[k] + vision_fwd[k, S].sum()`` seconds, and likewise for backward and for
    the LLM stages. A sample with no images contributes 0 to every vision stage.

    Attributes (all seconds unless stated):
        vision_fwd, vision_bwd: [pp_v, n] per-sample forward/backward seconds on each vision stage.
        llm_fwd, llm_bwd: [pp_l, n] per-sample forward/backward seconds on each LLM stage.
        vision_fwd_const, vision_bwd_const: [pp_v] per-microbatch overhead of each vision stage.
        llm_fwd_const, llm_bwd_const: [pp_l] per-bin overhead of each LLM stage.
        llm_act_bytes: [pp_l, n] activation bytes each sample keeps alive on each LLM stage until
            its backward.
        vision_act_bytes: [pp_v, n] the same for vision stages.
        llm_mem_limit_bytes: [pp_l] bytes left on each LLM stage after parameters, gradients,
            optimizer state and the constant of its transient (`StageTerms`), divided by that stage's
            1F1B in-flight count, less its per-bin activation constant: one bin's `llm_mem_bytes`
            must fit under it (the memory guard). ``inf`` when unconstrained.
        vision_mem_limit_bytes: [pp_v] the same for vision stages.
        llm_mem_bytes: [pp_l, n] what each sample adds against that limit: its activations plus its
            transient term over the stage's in-flight count, so that a bin under the limit keeps
            ``state + in_flight x activations + transient`` within the memory. Default: the
            activations (no transient).
        vision_mem_bytes: [pp_v, n] the same for vision stages.
        llm_chunks: under interleaved 1F1B, the LLM's costs per model chunk (`LLMChunkCosts`),
            which the simulation times; the ``llm_*`` rows above are then each pipeline rank's
            sums over its chunks (what a rank computes and holds). None: one chunk per rank.
    """

    vision_fwd: np.ndarray
    vision_bwd: np.ndarray
    llm_fwd: np.ndarray
    llm_bwd: np.ndarray
    vision_fwd_const: np.ndarray
    vision_bwd_const: np.ndarray
    llm_fwd_const: np.ndarray
    llm_bwd_const: np.ndarray
    llm_act_bytes: np.ndarray
    vision_act_bytes: np.ndarray
    llm_mem_limit_bytes: np.ndarray
    vision_mem_limit_bytes: np.ndarray
    llm_mem_bytes: np.ndarray | None = None
    vision_mem_bytes: np.ndarray | None = None
    llm_chunks: "LLMChunkCosts | None" = None

    def __post_init__(self):
        for name, act in (("llm_mem_bytes", self.llm_act_bytes), ("vision_mem_bytes", self.vision_act_bytes)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, act)

    @property
    def n_samples(self) -> int:
        return int(self.llm_fwd.shape[1])

    @property
    def pp_vision(self) -> int:
        return int(self.vision_fwd.shape[0])

    @property
    def pp_llm(self) -> int:
        return int(self.llm_fwd.shape[0])

    def vision_total(self) -> np.ndarray:
        """[n] seconds each sample costs the whole vision module (forward + backward, all stages)."""
        return self.vision_fwd.sum(axis=0) + self.vision_bwd.sum(axis=0)

    def llm_total(self) -> np.ndarray:
        """[n] seconds each sample costs the whole LLM (forward + backward, all stages)."""
        return self.llm_fwd.sum(axis=0) + self.llm_bwd.sum(axis=0)

    def subset(self, index: np.ndarray) -> "BatchCosts":
        """The same costs restricted to the samples in `index` (constants and limits kept)."""
        idx = np.asarray(index, dtype=np.int64)
        return BatchCosts(
            vision_fwd=self.vision_fwd[:, idx],
            vision_bwd=self.vision_bwd[:, idx],
            llm_fwd=self.llm_fwd[:, idx],
            llm_bwd=self.llm_bwd[:, idx],
            vision_fwd_const=self.vision_fwd_const,
            vision_bwd_const=self.vision_bwd_const,
            llm_fwd_const=self.llm_fwd_const,
            llm_bwd_const=self.llm_bwd_const,
            llm_act_bytes=self.llm_act_bytes[:, idx],
            vision_act_bytes=self.vision_act_bytes[:, idx],
            llm_mem_limit_bytes=self.llm_mem_limit_bytes,
            vision_mem_limit_bytes=self.vision_mem_limit_bytes,
            llm_mem_bytes=self.llm_mem_bytes[:, idx],
            vision_mem_bytes=self.vision_mem_bytes[:, idx],
            llm_chunks=None if self.llm_chunks is None else self.llm_chunks.subset(idx),
        )


@dataclass(frozen=True)
class LLMChunkCosts:
    """The LLM's per-sample costs per model chunk under interleaved 1F1B: chunk c (of pp * chunks,
    in model order) runs on pipeline rank c mod pp. fwd, bwd: [pp * chunks, n] seconds per sample;
    fwd_const, bwd_const: [pp * chunks] per bin (`BatchCosts`' meaning, per chunk)."""

    fwd: np.ndarray
    bwd: np.ndarray
    fwd_const: np.ndarray
    bwd_const: np.ndarray
    chunks: int

    @property
    def pp(self) -> int:
        return int(self.fwd.shape[0]) // self.chunks

    def rank_of_chunk(self) -> np.ndarray:
        """[pp * chunks] the pipeline rank of every chunk."""
        return np.arange(self.fwd.shape[0]) % self.pp

    def rank_sum(self, x: np.ndarray) -> np.ndarray:
        """[pp, ...] the rows of `x` ([pp * chunks, ...], one per chunk) summed over each rank's chunks."""
        rank = self.rank_of_chunk()
        return np.stack([x[rank == r].sum(axis=0) for r in range(self.pp)])

    def subset(self, idx: np.ndarray) -> "LLMChunkCosts":
        return LLMChunkCosts(self.fwd[:, idx], self.bwd[:, idx], self.fwd_const, self.bwd_const, self.chunks)

    def scaled(self, per_sample: np.ndarray, const: np.ndarray) -> "LLMChunkCosts":
        """Each chunk scaled as its rank's row: `per_sample` [pp, n], `const` [pp] (the adaptive
        correction's factors of the rank rows)."""
        rank = self.rank_of_chunk()
        return LLMChunkCosts(self.fwd * per_sample[rank], self.bwd * per_sample[rank], self.fwd_const * const[rank],
                             self.bwd_const * const[rank], self.chunks)
