"""Synthetic model profiles from closed-form costs, for tests and for demos without a profiler run.

A synthetic profile has exactly the columns of `model_profile.parquet` (docs/design.md); its times
are ``coef @ features`` of the shape with multiplicative log-normal noise per repeat, and its
activation bytes are exact (the real profiler counts saved tensors exactly too). Tests fit it and
compare the recovered coefficients and predictions with the closed form. With ``recompute=True``
the layer modules also get the recompute columns ``bwd_ms:<mode>`` / ``act_bytes:<mode>`` /
``transient_bytes:<mode>``, as the profiler writes them (NaN for the other modules and, for the
times, for repeats past ``recompute_repeats``). Every module has its exact ``transient_bytes``
(one layer's for a stack of layers, as the profiler's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from dflop.costmodel.features import LAYER_MODULES, MODULE_FEATURES, ShapeKind, profile_features
from dflop.costmodel.model import OPTIONAL_TARGETS, TARGETS, TRANSIENT


def _default_coef() -> dict[str, dict[str, tuple[float, ...]]]:
    """Per-layer costs of a small model on one GPU, roughly (ms per feature unit, bytes per unit;
    transients: the LM head's loss gradients per token, a module's weight gradient per microbatch)."""
    return {
        # features: tiles, const
        "vision_embed": {"fwd_ms": (0.02, 0.05), "bwd_ms": (0.03, 0.05), "act_bytes": (1.8e6, 0.0),
                         TRANSIENT: (1.5e6, 1.2e6)},
        "vision_layer": {"fwd_ms": (0.30, 0.08), "bwd_ms": (0.62, 0.10), "act_bytes": (2.4e7, 0.0),
                         TRANSIENT: (8.0e6, 1.4e7)},
        "projector": {"fwd_ms": (0.05, 0.04), "bwd_ms": (0.10, 0.05), "act_bytes": (6.0e6, 0.0),
                      TRANSIENT: (3.0e6, 1.6e7)},
        # features: tokens, const
        "llm_embed": {"fwd_ms": (1e-5, 0.02), "bwd_ms": (2e-5, 0.03), "act_bytes": (8.0, 0.0),
                      TRANSIENT: (16.0, 1.4e8)},
        "llm_head": {"fwd_ms": (2e-3, 0.10), "bwd_ms": (4e-3, 0.12), "act_bytes": (6.1e5, 0.0),
                     TRANSIENT: (1.2e6, 1.4e8)},
        # features: tokens, tokens_pow1.5, sq_tokens, const
        "llm_layer": {"fwd_ms": (1.5e-3, 3e-6, 2e-7, 0.15), "bwd_ms": (3.1e-3, 0.0, 5e-7, 0.20),
                      "act_bytes": (3.4e4, 0.0, 0.0, 0.0), TRANSIENT: (1.6e4, 0.0, 0.0, 2.9e7)},
        "llm_attention": {"fwd_ms": (1e-4, 3e-6, 2e-7, 0.03), "bwd_ms": (2e-4, 0.0, 5e-7, 0.05),
                          "act_bytes": (4.0e3, 0.0, 0.0, 0.0), TRANSIENT: (3.0e3, 0.0, 0.0, 0.0)},
    }


def _default_recompute_coef() -> dict[str, dict[str, tuple[float, ...]]]:
    """Layer modules under recompute: backward plus (part of) the forward again, fewer bytes kept,
    and what the rerun forward holds during the backward."""
    return {
        "vision_layer": {"bwd_ms:selective": (0.70, 0.10), "act_bytes:selective": (2.39e7, 0.0),
                         "transient_bytes:selective": (8.1e6, 1.4e7),
                         "bwd_ms:full": (0.90, 0.18), "act_bytes:full": (1.1e6, 0.0),
                         "transient_bytes:full": (3.1e7, 1.4e7)},
        "llm_layer": {"bwd_ms:selective": (3.1e-3, 0.0, 7e-7, 0.22), "act_bytes:selective": (3.39e4, 0.0, 0.0, 0.0),
                      "transient_bytes:selective": (1.61e4, 0.0, 0.0, 2.9e7),
                      "bwd_ms:full": (4.4e-3, 3e-6, 7e-7, 0.35), "act_bytes:full": (1.8e3, 0.0, 0.0, 0.0),
                      "transient_bytes:full": (4.8e4, 0.0, 0.0, 2.9e7)},
    }


@dataclass(frozen=True)
class SyntheticCosts:
    """Closed-form costs per module: coef[module][target] aligned with MODULE_FEATURES[module];
    recompute_coef[module][target] likewise for the recompute targets of layer modules.

    At tensor-parallel degree tp every coefficient but ``const`` is divided by tp (ideal scaling);
    param_bytes (per layer for layer modules) is divided by tp as well.
    """

    coef: Mapping[str, Mapping[str, tuple[float, ...]]] = field(default_factory=_default_coef)
    recompute_coef: Mapping[str, Mapping[str, tuple[float, ...]]] = field(default_factory=_default_recompute_coef)
    param_bytes: Mapping[str, float] = field(default_factory=lambda: {
        "vision_embed": 1.2e6, "vision_layer": 2.8e7, "projector": 1.6e7,
        "llm_embed": 1.4e8, "llm_head": 1.4e8, "llm_layer": 5.8e7, "llm_attention": 1.2e7,
    })

    def coefficients(self, module: str, target: str, tp: int = 1) -> np.ndarray:
        """[n_features] the closed-form coefficients of `module` at `tp` (ms or bytes per unit)."""
        table = self.coef if target in self.coef.get(module, {}) else self.recompute_coef
        coef = np.asarray(table[module][target], dtype=np.float64)
        features = MODULE_FEATURES[module][1]
        scale = np.array([1.0 if f == "const" else 1.0 / tp for f in features])
        return coef * scale


def synthetic_profile(
    costs: SyntheticCosts | None = None,
    *,
    modules: Sequence[str] = tuple(MODULE_FEATURES),
    tp_degrees: Sequence[int] = (1,),
    tiles: Sequence[int] = (1, 2, 4, 8, 16, 32),
    patches_per_tile: int = 729,
    llm_batches: Sequence[int] = (1, 2, 4),
    llm_seq_lens: Sequence[int] = (128, 256, 512, 1024, 2048, 4096),
    n_layers: int = 1,
    repeats: int = 3,
    noise: float = 0.0,
    seed: int = 0,
    device: str = "synthetic",
    dtype: str = "float32",
    preset: str = "synthetic",
    recompute: bool = False,
    recompute_repeats: int | None = None,
) -> pd.DataFrame:
    """A model profile (one row per repeat) generated from `costs`.

    noise: standard deviation of the log-normal multiplicative noise on times (0.02 ≈ 2%).
    Layer modules are profiled as a stack of `n_layers` layers (times and bytes multiplied).
    recompute: add the recompute columns (module docstring); recompute_repeats: how many of a
    shape's repeats have a ``bwd_ms:<mode>`` (default all).
    """
    costs = costs or SyntheticCosts()
    rng = np.random.default_rng(seed)
    frames = []
    for module in modules:
        kind, features = MODULE_FEATURES[module]
        if kind is ShapeKind.TILES:
            batch = np.asarray(tiles, dtype=np.int64)
            seq = np.full_like(batch, patches_per_tile)
        else:
            grid = np.array([(b, s) for b in llm_batches for s in llm_seq_lens], dtype=np.int64)
            batch, seq = grid[:, 0], grid[:, 1]
        X = profile_features(features, batch, seq)
        stack = n_layers if module in LAYER_MODULES else 1
        optional = tuple(costs.recompute_coef.get(module, {})) if recompute else ()
        transient = (TRANSIENT,) if TRANSIENT in costs.coef.get(module, {}) else ()
        for tp in tp_degrees:
            exact = {t: X @ costs.coefficients(module, t, tp) * (1 if t.startswith(TRANSIENT) else stack)
                     for t in TARGETS + optional + transient}
            for r in range(repeats):
                jitter = {t: np.exp(rng.normal(0.0, noise, len(batch))) if noise else 1.0
                          for t in ("fwd_ms", "bwd_ms")}
                columns = {TRANSIENT: exact[TRANSIENT] if transient else np.nan}
                for t in (t for t in OPTIONAL_TARGETS if t != TRANSIENT and recompute):
                    timed = t.startswith("bwd_ms")
                    if t not in optional or (timed and recompute_repeats is not None and r >= recompute_repeats):
                        columns[t] = np.nan
                    else:
                        columns[t] = exact[t] * (np.exp(rng.normal(0.0, noise, len(batch))) if noise and timed else 1.0)
                frames.append(pd.DataFrame({
                    "module": module, "tp": tp, "batch": batch, "seq_len": seq, "n_layers": stack,
                    "fwd_ms": exact["fwd_ms"] * jitter["fwd_ms"],
                    "bwd_ms": exact["bwd_ms"] * jitter["bwd_ms"],
                    "act_bytes": exact["act_bytes"],
                    "param_bytes": costs.param_bytes[module] * stack / tp,
                    "peak_bytes": np.nan, "device": device, "dtype": dtype, "repeat": r,
                    "preset": preset, **columns,
                }))
    return pd.concat(frames, ignore_index=True)
