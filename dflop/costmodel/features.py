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
lets the fit follow that ramp while staying a sum over samples, and it is 0 when the data do not
need it. (CPU llm_layer fits still use it; CPU attention modules use the kernel features below.)

On the CPU the attention kernel's work is known exactly, and it is not smooth in L. PyTorch's CPU
flash attention (the kernel SDPA runs for our causal, mask-free packed calls) splits the queries
into blocks of 32, 64 or 256 rows (L < 192, < 768, >= 768) and the keys into blocks of 512
columns, and computes whole key blocks up to the diagonal: a sample of L <= 512 costs all L**2
pairs, not L**2 / 2, and the block size jumps at 192 and 768. Measured times per sample follow
the kernel's pair counts step for step, which no smooth ``L**a`` does. CPU profiles therefore fit the attention modules on ``cpu_attn_pairs`` (query-key
pairs the kernel computes) and ``cpu_attn_blocks`` (its block calls, each with a fixed overhead)
instead of the smooth terms (`module_features`); this lowered llm_attention's held-out error on
CPU profiles (`benchmarks/bench_costmodel.py` measures it). GPU profiles keep the smooth terms.

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
FEATURE_NAMES = ("tiles", "tokens", "tokens_pow1.5", "sq_tokens", "cpu_attn_pairs", "cpu_attn_blocks", "const")

#: Shape kind and features of every module the profiler emits (docs/design.md); the features are
#: those of GPU (and synthetic) profiles, CPU profiles swap some for `CPU_KERNEL_FEATURES`.
MODULE_FEATURES: dict[str, tuple[ShapeKind, tuple[str, ...]]] = {
    "vision_embed": (ShapeKind.TILES, ("tiles", "const")),
    "vision_layer": (ShapeKind.TILES, ("tiles", "const")),
    "projector": (ShapeKind.TILES, ("tiles", "const")),
    "llm_embed": (ShapeKind.TOKENS, ("tokens", "const")),
    "llm_layer": (ShapeKind.TOKENS, ("tokens", "tokens_pow1.5", "sq_tokens", "const")),
    "llm_attention": (ShapeKind.TOKENS, ("tokens", "tokens_pow1.5", "sq_tokens", "const")),
    "llm_head": (ShapeKind.TOKENS, ("tokens", "const")),
}

#: Features of the attention-bearing modules when the profile ran on the CPU (see the module
#: docstring): the CPU flash-attention kernel's exact work replaces the smooth attention terms.
CPU_KERNEL_FEATURES: dict[str, tuple[str, ...]] = {
    "llm_layer": ("tokens", "tokens_pow1.5", "cpu_attn_pairs", "cpu_attn_blocks", "const"),
    "llm_attention": ("tokens", "cpu_attn_pairs", "cpu_attn_blocks", "const"),
}

#: Modules whose profile rows cover ``n_layers`` identical layers; costs are stored per layer.
LAYER_MODULES = frozenset({"vision_layer", "llm_layer", "llm_attention"})


def shape_kind(module: str) -> ShapeKind:
    try:
        return MODULE_FEATURES[module][0]
    except KeyError:
        raise UserError(f"unknown module {module!r}; known: {', '.join(MODULE_FEATURES)}") from None


def module_features(module: str, device: str) -> tuple[str, ...]:
    """Features to fit `module` on for a profile made on `device` ("cpu" or a GPU's name)."""
    shape_kind(module)
    if device == "cpu" and module in CPU_KERNEL_FEATURES:
        return CPU_KERNEL_FEATURES[module]
    return MODULE_FEATURES[module][1]


def allowed_features(module: str) -> tuple[tuple[str, ...], ...]:
    """Every feature list a fitted `module` may have (one per kind of device)."""
    sets = [MODULE_FEATURES[module][1]]
    if module in CPU_KERNEL_FEATURES:
        sets.append(CPU_KERNEL_FEATURES[module])
    return tuple(sets)


#: PyTorch's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, forward and
#: backward alike for float32/bfloat16): key columns per block, and query rows per block by length.
_CPU_ATTN_KV_BLOCK = 512


def cpu_attention_work(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample (query-key pairs, key-block calls) of the CPU flash-attention kernel, causal.

    lengths: [n] tokens per sample (0 gives 0 work). Returns two [n] float arrays.

    The kernel takes query blocks of q = 32 / 64 / 256 rows (L < 192 / < 768 / >= 768); each runs
    over whole key blocks of 512 up to its last row's diagonal, the last key block of the
    sequence cut at L. Since q divides 512, the s = 512 / q full query blocks inside key block t
    each see 512 (t + 1) keys, which gives a closed form: with nq = L // q full query blocks,
    r = L % q rows in a last partial one, g = nq // s complete groups and e = nq % s blocks left,
        pairs  = 512**2 g (g + 1) / 2 + e q min(512 (g + 1), L) + r L
        blocks = s g (g + 1) / 2 + e (g + 1) + [r > 0] ceil(L / 512).
    """
    L = np.asarray(lengths, dtype=np.int64).reshape(-1)
    kv = _CPU_ATTN_KV_BLOCK
    q = np.where(L >= 768, 256, np.where(L >= 192, 64, 32))
    per_key_block = kv // q
    full, rest = np.divmod(L, q)
    groups, left = np.divmod(full, per_key_block)
    last_keys = np.minimum(kv * (groups + 1), L)
    tail = rest > 0
    pairs = kv * kv * groups * (groups + 1) // 2 + left * q * last_keys + rest * L
    blocks = per_key_block * groups * (groups + 1) // 2 + left * (groups + 1) + tail * (-(-L // kv))
    return pairs.astype(np.float64), blocks.astype(np.float64)


def _check_features(features: Sequence[str]) -> None:
    unknown = [f for f in features if f not in FEATURE_NAMES]
    if unknown:
        raise UserError(f"unknown cost-model feature(s) {', '.join(unknown)}; known: {', '.join(FEATURE_NAMES)}")


def _token_columns(lengths: np.ndarray, features: Sequence[str]) -> dict[str, np.ndarray]:
    """The per-sample value of each token feature in `features`, for samples of these lengths
    (the kernel work only when asked for: it is the one costly column)."""
    columns = {"tokens": lengths, "tokens_pow1.5": lengths**1.5, "sq_tokens": lengths * lengths}
    if any(f.startswith("cpu_attn") for f in features):
        columns["cpu_attn_pairs"], columns["cpu_attn_blocks"] = cpu_attention_work(lengths)
    return columns


def profile_features(features: Sequence[str], batch: np.ndarray, seq_len: np.ndarray) -> np.ndarray:
    """[n_rows, n_features] features of profile rows: ``batch`` samples of size ``seq_len`` each.

    For tile modules a row is ``batch`` tiles (``seq_len`` = patches per tile, constant per model);
    for token modules it is ``batch`` packed samples of ``seq_len`` tokens each.
    """
    _check_features(features)
    b = np.asarray(batch, dtype=np.float64)
    per_sample = _token_columns(np.asarray(seq_len, dtype=np.float64), features)
    columns = {"tiles": b, "const": np.ones_like(b), **{f: b * v for f, v in per_sample.items()}}
    return np.stack([columns[f] for f in features], axis=1)


def sample_features(features: Sequence[str], kind: ShapeKind, sizes: np.ndarray) -> np.ndarray:
    """[n_samples, n_features] per-sample features (``const`` column 0).

    ``sizes`` are tiles per sample for tile modules and sequence lengths (tokens) for token
    modules. The features of a set of samples are ``const_features + sample_features.sum(0)``.
    """
    _check_features(features)
    x = np.asarray(sizes, dtype=np.float64).reshape(-1)
    columns = {"tiles": x} if kind is ShapeKind.TILES else _token_columns(x, features)
    missing = [f for f in features if f != "const" and f not in columns]
    if missing:
        raise UserError(f"feature(s) {', '.join(missing)} are not defined for {kind.value} modules")
    zero = np.zeros_like(x)
    return np.stack([zero if f == "const" else columns[f] for f in features], axis=1)


def const_features(features: Sequence[str]) -> np.ndarray:
    """[n_features] the per-microbatch part: 1 for ``const``, 0 elsewhere."""
    _check_features(features)
    return np.array([1.0 if f == "const" else 0.0 for f in features])
