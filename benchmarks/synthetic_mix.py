"""A generated LLaVA-OneVision-like shape mix, for benchmarks and tests without real data.

Mix (fractions of samples): ~10% text only, ~65% one AnyRes image, ~15% multi-image, ~10%
32-frame video. Shapes follow LLaVA-OV's conventions: a 384x384 SigLIP tile gives 729 tokens;
AnyRes adds a base tile to an a x b grid of crops (1 <= a, b <= 3, so 2..10 tiles) whose tokens
are unpadded to the image's aspect ratio (up to ~7.3k vision tokens); multi-image samples use one
base tile per image; video frames are pooled to 196 tokens each, plus one separator token.
Text lengths are log-normal (long-tailed).

`heavy_mix` is the same generator with a quarter of the samples videos of 8-64 frames. Both give
LLaVA-OV's token counts; `for_architecture` rebuilds vision_tokens and seq_len for InternVL.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dflop.errors import UserError

TOKENS_PER_TILE = 729
VIDEO_FRAMES = 32
VIDEO_TOKENS_PER_FRAME = 196
MIX = (("text", 0.10), ("image", 0.65), ("multi_image", 0.15), ("video", 0.10))
HEAVY_MIX = (("text", 0.05), ("image", 0.45), ("multi_image", 0.25), ("video", 0.25))
HEAVY_VIDEO_FRAMES = (8, 64)  # inclusive range, uniform


def _text_tokens(rng: np.random.Generator, n: int, median: float, sigma: float) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 8, 16384).astype(np.int64)


def llava_ov_mix(n: int, seed: int = 0, dataset: str = "llava_ov_mix") -> pd.DataFrame:
    """`n` generated samples with the shapes.parquet columns (all status ``ok``)."""
    return _generate(n, seed, dataset, MIX, (VIDEO_FRAMES, VIDEO_FRAMES))


def heavy_mix(n: int, seed: int = 0, dataset: str = "heavy_mix") -> pd.DataFrame:
    """A video-heavy variant of `llava_ov_mix`: 25 % videos of 8-64 frames (HEAVY_MIX)."""
    return _generate(n, seed, dataset, HEAVY_MIX, HEAVY_VIDEO_FRAMES)


def _generate(n: int, seed: int, dataset: str, mix, frames: tuple[int, int]) -> pd.DataFrame:
    """The mix generator: `mix` (kind, fraction) pairs; video frame counts uniform in `frames`
    (inclusive; a fixed count draws nothing, so llava_ov_mix's samples stay what they were)."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice([k for k, _ in mix], size=n, p=[f for _, f in mix])
    n_images = np.zeros(n, dtype=np.int64)
    n_frames = np.zeros(n, dtype=np.int64)
    n_tiles = np.zeros(n, dtype=np.int64)
    vision_tokens = np.zeros(n, dtype=np.int64)
    text_tokens = np.zeros(n, dtype=np.int64)

    text = kinds == "text"
    text_tokens[text] = _text_tokens(rng, int(text.sum()), 600, 0.9)

    image = kinds == "image"
    k = int(image.sum())
    grid_a, grid_b = rng.integers(1, 4, k), rng.integers(1, 4, k)
    crops = grid_a * grid_b
    unpadded = rng.uniform(0.7, 1.0, k)  # share of crop features kept after removing padding
    n_images[image] = 1
    n_tiles[image] = 1 + crops
    vision_tokens[image] = TOKENS_PER_TILE + np.round(crops * TOKENS_PER_TILE * unpadded).astype(np.int64) + 27 * grid_a
    text_tokens[image] = _text_tokens(rng, k, 180, 1.0)

    multi = kinds == "multi_image"
    k = int(multi.sum())
    imgs = rng.integers(2, 7, k)
    n_images[multi] = imgs
    n_tiles[multi] = imgs
    vision_tokens[multi] = imgs * TOKENS_PER_TILE
    text_tokens[multi] = _text_tokens(rng, k, 250, 0.9)

    video = kinds == "video"
    k = int(video.sum())
    frame_counts = np.full(k, frames[0], dtype=np.int64) if frames[0] == frames[1] else \
        rng.integers(frames[0], frames[1] + 1, k)
    n_frames[video] = frame_counts
    n_tiles[video] = frame_counts
    vision_tokens[video] = frame_counts * VIDEO_TOKENS_PER_FRAME + 1
    text_tokens[video] = _text_tokens(rng, k, 150, 0.8)

    return pd.DataFrame({
        "sample_id": [f"{dataset}-{seed}-{i}" for i in range(n)],
        "dataset": dataset,
        "modality": kinds,
        "n_images": n_images,
        "n_frames": n_frames,
        "n_tiles": n_tiles,
        "vision_tokens": vision_tokens,
        "text_tokens": text_tokens,
        "seq_len": vision_tokens + text_tokens,
        "status": "ok",
    })


def for_architecture(shapes: pd.DataFrame, arch: str, llm_tokens_per_tile: int) -> pd.DataFrame:
    """`shapes` (tiles and tokens as LLaVA-OV with SigLIP-so400m counts them, like the mixes here)
    with vision_tokens and seq_len rebuilt for `arch` at `llm_tokens_per_tile`
    (`dflop.models.info.ModelInfo`); tiles, frames and text stay.

    InternVL (`dflop.data.vision_tokens` internvl_image_shape / internvl_video_shape): every tile
    or frame becomes llm_tokens_per_tile tokens, plus ``<img>``/``</img>`` per image and per frame.
    LLaVA-OV's counts (AnyRes unpadding, pooled video frames) cannot be rebuilt from tiles alone, so
    for llava_ov only the 729 tokens per tile the shapes were counted with are accepted."""
    if arch == "llava_ov":
        if llm_tokens_per_tile != TOKENS_PER_TILE:
            raise UserError(f"shapes count LLaVA-OV tokens at {TOKENS_PER_TILE} per tile; a llava_ov model with "
                            f"{llm_tokens_per_tile} per tile needs its own shapes (dflop profile-data)")
        return shapes
    if arch != "internvl":
        raise UserError(f"no token rule for architecture {arch!r} (llava_ov, internvl)")
    missing = [c for c in ("n_images", "n_frames", "text_tokens") if c not in shapes.columns]
    if missing:
        raise UserError(f"shapes: missing column(s) {', '.join(missing)} needed to recount vision tokens for {arch}")
    markers = 2 * (shapes["n_images"].to_numpy(dtype=np.int64) + shapes["n_frames"].to_numpy(dtype=np.int64))
    vision = shapes["n_tiles"].to_numpy(dtype=np.int64) * int(llm_tokens_per_tile) + markers
    return shapes.assign(vision_tokens=vision, seq_len=vision + shapes["text_tokens"].to_numpy(dtype=np.int64))
