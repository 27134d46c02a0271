"""Synthetic per-sample stage costs (`BatchCosts`) for the scheduler's benchmarks and tests.

Not a pricing path of the product (that is `dflop.pricing.pricing`): a documented closed-form
stand-in (`AnalyticCostModel`) that gives partitioning experiments a skewed vision/LLM cost mix
without a cost model or a plan. `batch_costs_from_shapes` checks what a ``costs_fn(shapes,
layout)`` returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from dflop.costmodel.types import BatchCosts
from dflop.shapes import check_shapes


@dataclass(frozen=True)
class StageLayout:
    """How each module's layers are split over its pipeline stages, and memory left per stage.

    Attributes:
        vision_layer_share: [pp_v] fraction of the vision encoder's per-sample work on each stage
            (sums to 1).
        llm_layer_share: [pp_l] the same for the LLM.
        vision_mem_limit_bytes, llm_mem_limit_bytes: activation bytes one microbatch (vision, per
            vision replica) or one bin (LLM) may keep alive on any stage; ``inf`` = unconstrained.
    """

    vision_layer_share: tuple[float, ...] = (1.0,)
    llm_layer_share: tuple[float, ...] = (1 / 3, 1 / 3, 1 / 3)
    vision_mem_limit_bytes: float = math.inf
    llm_mem_limit_bytes: float = math.inf

    def __post_init__(self):
        for name in ("vision_layer_share", "llm_layer_share"):
            share = getattr(self, name)
            if len(share) == 0 or min(share) < 0 or abs(sum(share) - 1.0) > 1e-6:
                raise ValueError(f"StageLayout.{name} must be non-negative and sum to 1, got {share}")

    @property
    def pp_vision(self) -> int:
        return len(self.vision_layer_share)

    @property
    def pp_llm(self) -> int:
        return len(self.llm_layer_share)


@dataclass(frozen=True)
class AnalyticCostModel:
    """A simple, documented stage-time model standing in for the fitted cost models.

    Vision encoder: every tile (crop or video frame) costs the same (a ViT over a fixed number of
    patches), so a sample's vision forward is ``vision_fwd_s_per_tile * n_tiles`` seconds. LLM:
    a packed sample of ``s = seq_len`` tokens costs ``llm_fwd_s_per_token * s +
    llm_fwd_s_per_token_sq * s**2`` seconds forward (linear layers + causal attention that does not
    cross samples). Backward is ``bwd_over_fwd`` times forward. Each stage gets its layer share of
    every sample's cost, plus a fixed per-microbatch (vision) or per-bin (LLM) overhead per stage.
    Activation bytes are proportional to tiles (vision) and tokens (LLM) times the layer share.

    Defaults are of the order of a 7B LLM and a ~1-2B ViT on one H100 (bf16, ~40% MFU), chosen so
    that on a LLaVA-OneVision-like mix the vision stage and each of three LLM stages carry similar
    mean work — the balanced layout a planner would pick.
    """

    vision_fwd_s_per_tile: float = 6e-3
    llm_fwd_s_per_token: float = 35e-6
    llm_fwd_s_per_token_sq: float = 5e-10
    bwd_over_fwd: float = 2.0
    vision_fwd_const_s: float = 1e-3
    llm_fwd_const_s: float = 5e-4
    vision_act_bytes_per_tile: float = 60e6
    llm_act_bytes_per_token: float = 3e6

    def __call__(self, shapes: pd.DataFrame, layout: StageLayout) -> BatchCosts:
        tiles = shapes["n_tiles"].to_numpy(dtype=np.float64)
        seq = shapes["seq_len"].to_numpy(dtype=np.float64)
        v_share = np.asarray(layout.vision_layer_share, dtype=np.float64)[:, None]
        l_share = np.asarray(layout.llm_layer_share, dtype=np.float64)[:, None]
        v_fwd = v_share * (self.vision_fwd_s_per_tile * tiles)[None, :]
        l_fwd = l_share * (self.llm_fwd_s_per_token * seq + self.llm_fwd_s_per_token_sq * seq**2)[None, :]
        return BatchCosts(
            vision_fwd=v_fwd,
            vision_bwd=self.bwd_over_fwd * v_fwd,
            llm_fwd=l_fwd,
            llm_bwd=self.bwd_over_fwd * l_fwd,
            vision_fwd_const=np.full(layout.pp_vision, self.vision_fwd_const_s),
            vision_bwd_const=np.full(layout.pp_vision, self.bwd_over_fwd * self.vision_fwd_const_s),
            llm_fwd_const=np.full(layout.pp_llm, self.llm_fwd_const_s),
            llm_bwd_const=np.full(layout.pp_llm, self.bwd_over_fwd * self.llm_fwd_const_s),
            llm_act_bytes=l_share * (self.llm_act_bytes_per_token * seq)[None, :],
            vision_act_bytes=v_share * (self.vision_act_bytes_per_tile * tiles)[None, :],
            llm_mem_limit_bytes=np.full(layout.pp_llm, layout.llm_mem_limit_bytes),
            vision_mem_limit_bytes=np.full(layout.pp_vision, layout.vision_mem_limit_bytes),
        )


CostsFn = Callable[[pd.DataFrame, StageLayout], BatchCosts]


def batch_costs_from_shapes(shapes: pd.DataFrame, layout: StageLayout, costs_fn: CostsFn) -> BatchCosts:
    """Per-sample stage costs of the global batch `shapes` (one row per sample, in batch order).

    Args:
        shapes: rows of shapes.parquet (at least sample_id, n_tiles, seq_len) for this batch.
        layout: pipeline stages of each module and memory limits.
        costs_fn: ``(shapes, layout) -> BatchCosts``; e.g. an `AnalyticCostModel` or a wrapper
            around the fitted cost model.
    """
    check_shapes(shapes)
    costs = costs_fn(shapes, layout)
    n = len(shapes)
    expect = {"vision_fwd": (layout.pp_vision, n), "vision_bwd": (layout.pp_vision, n),
              "llm_fwd": (layout.pp_llm, n), "llm_bwd": (layout.pp_llm, n),
              "llm_act_bytes": (layout.pp_llm, n), "vision_act_bytes": (layout.pp_vision, n),
              "vision_fwd_const": (layout.pp_vision,), "vision_bwd_const": (layout.pp_vision,),
              "llm_fwd_const": (layout.pp_llm,), "llm_bwd_const": (layout.pp_llm,),
              "llm_mem_limit_bytes": (layout.pp_llm,), "vision_mem_limit_bytes": (layout.pp_vision,)}
    for name, shape in expect.items():
        arr = np.asarray(getattr(costs, name))
        if arr.shape != shape:
            raise ValueError(f"costs_fn returned BatchCosts.{name} of shape {arr.shape}, expected {shape}")
        if name.endswith("mem_limit_bytes"):
            continue
        if not np.isfinite(arr).all() or (arr < 0).any():
            col = np.argwhere(~np.isfinite(arr) | (arr < 0))[0][-1]
            sid = shapes["sample_id"].iloc[col] if arr.ndim == 2 else f"stage {col}"
            raise ValueError(f"costs_fn returned a negative or non-finite BatchCosts.{name} for {sid!r}")
    return costs
