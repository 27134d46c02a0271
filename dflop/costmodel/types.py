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
        )
