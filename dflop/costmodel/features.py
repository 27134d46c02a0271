"""Features of a shape for each profiled module: sums over samples, so costs stay additive.

Every fitted cost is ``coef @ features``, and every feature except ``const`` is a sum over the
samples of a microbatch (tiles, tokens, squared sample lengths). A set of samples therefore costs
``coef[const] + sum_i coef @ f_i`` exactly, which is what `BatchCosts` relies on.

Two kinds of shape:
- tile modules (vision embeddings, vision layer, projector): a sample is a number of tiles of a
  fixed size (patches per tile are fixed by the vision tower, so every per-tile cost, attention
  included, is a constant times the tile count);
- token modules (LLM embeddings, layer, attention, head): a sample is a sequence of length L, packed
  with the others; attention stays inside each sample, so its cost grows with ``sum L**2``, not
  with the square of the packed length.

Attention kernels (flash-style, CPU or GPU) get more efficient per query-key pair as L grows
(tile quantisation and launch overhead at short L), so one sample's attention cost lies between
``a L + b L**2`` curves fitted at short and at long L. The ``tokens_pow1.5`` feature (``sum L**1.5``)
lets the fit follow that ramp while staying a sum over samples; on the CPU profiles of the small
preset it cut the held-out error of llm_attention from ~14 % to ~7 % (and of the tiny llm_layer
from ~6.5 % to ~3.5 %), and it is 0 when the data do not need it.

A profile row (``batch``, ``seq_len``) is ``batch`` samples of one tile (tile modules; ``seq_len``
is then the patches per tile) or ``batch`` samples of length ``seq_len`` (token modules).
"""

from __future__ import annotations

from enum import Enum
from typing import Sequence

import numpy as np

from dflop.errors import UserError


class ShapeKind(str, Enum):
    TILES = "tiles"
    TOKENS = "tokens"


#: Feature names understood by this module; the JSON format stores them by name.
FEATURE_NAMES = ("tiles", "tokens", "tokens_pow1.5", "sq_tokens", "const")

#: Shape kind and features of every module the profiler emits (DESIGN.md §4).
MODULE_FEATURES: dict[str, tuple[ShapeKind, tuple[str, ...]]] = {
    "vision_embed": (ShapeKind.TILES, ("tiles", "const")),
    "vision_layer": (ShapeKind.TILES, ("tiles", "const")),
    "projector": (ShapeKind.TILES, ("tiles", "const")),
    "llm_embed": (ShapeKind.TOKENS, ("tokens", "const")),
    "llm_layer": (ShapeKind.TOKENS, ("tokens", "tokens_pow1.5", "sq_tokens", "const")),
    "llm_attention": (ShapeKind.TOKENS, ("tokens", "tokens_pow1.5", "sq_tokens", "const")),
    "llm_head": (ShapeKind.TOKENS, ("tokens", "const")),
}

#: Modules whose profile rows cover ``n_layers`` identical layers; costs are stored per layer.
LAYER_MODULES = frozenset({"vision_layer", "llm_layer", "llm_attention"})


def shape_kind(module: str) -> ShapeKind:
    try:
        return MODULE_FEATURES[module][0]
    except KeyError:
        raise UserError(f"unknown module {module!r}; known: {', '.join(MODULE_FEATURES)}") from None


def _check_features(features: Sequence[str]) -> None:
    unknown = [f for f in features if f not in FEATURE_NAMES]
    if unknown:
        raise UserError(f"unknown cost-model feature(s) {', '.join(unknown)}; known: {', '.join(FEATURE_NAMES)}")


def profile_features(features: Sequence[str], batch: np.ndarray, seq_len: np.ndarray) -> np.ndarray:
    """[n_rows, n_features] features of profile rows: ``batch`` samples of size ``seq_len`` each.

    For tile modules a row is ``batch`` tiles (``seq_len`` = patches per tile, constant per model);
    for token modules it is ``batch`` packed samples of ``seq_len`` tokens each.
    """
    _check_features(features)
    b = np.asarray(batch, dtype=np.float64)
    s = np.asarray(seq_len, dtype=np.float64)
    columns = {
        "tiles": b,
        "tokens": b * s,
        "tokens_pow1.5": b * s**1.5,
        "sq_tokens": b * s * s,
        "const": np.ones_like(b),
    }
    return np.stack([columns[f] for f in features], axis=1)


def sample_features(features: Sequence[str], kind: ShapeKind, sizes: np.ndarray) -> np.ndarray:
    """[n_samples, n_features] per-sample features (``const`` column 0).

    ``sizes`` are tiles per sample for tile modules and sequence lengths (tokens) for token
    modules. The features of a set of samples are ``const_features + sample_features.sum(0)``.
    """
    _check_features(features)
    x = np.asarray(sizes, dtype=np.float64).reshape(-1)
    if kind is ShapeKind.TILES:
        columns = {"tiles": x}
    else:
        columns = {"tokens": x, "tokens_pow1.5": x**1.5, "sq_tokens": x * x}
    missing = [f for f in features if f != "const" and f not in columns]
    if missing:
        raise UserError(f"feature(s) {', '.join(missing)} are not defined for {kind.value} modules")
    zero = np.zeros_like(x)
    return np.stack([zero if f == "const" else columns[f] for f in features], axis=1)


def const_features(features: Sequence[str]) -> np.ndarray:
    """[n_features] the per-microbatch part: 1 for ``const``, 0 elsewhere."""
    _check_features(features)
    return np.array([1.0 if f == "const" else 0.0 for f in features])
