"""A generated LLaVA-OneVision-like shape mix, for benchmarks and tests without real data.

Mix (fractions of samples): ~10% text only, ~65% one AnyRes image, ~15% multi-image, ~10%
32-frame video. Shapes follow LLaVA-OV's conventions: a 384x384 SigLIP tile gives 729 tokens;
AnyRes adds a base tile to an a x b grid of crops (1 <= a, b <= 3, so 2..10 tiles) whose tokens
are unpadded to the image's aspect ratio (up to ~7.3k vision tokens); multi-image samples use one
base tile per image; video frames are pooled to 196 tokens each, plus one separator token.
Text lengths are log-normal (long-tailed).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

TOKENS_PER_TILE = 729
VIDEO_FRAMES = 32
VIDEO_TOKENS_PER_FRAME = 196
MIX = (("text", 0.10), ("image", 0.65), ("multi_image", 0.15), ("video", 0.10))


def _text_tokens(rng: np.random.Generator, n: int, median: float, sigma: float) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 8, 16384).astype(np.int64)


def llava_ov_mix(n: int, seed: int = 0, dataset: str = "llava_ov_mix") -> pd.DataFrame:
    """`n` generated samples with the shapes.parquet columns (all status ``ok``)."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice([k for k, _ in MIX], size=n, p=[f for _, f in MIX])
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
    n_frames[video] = VIDEO_FRAMES
    n_tiles[video] = VIDEO_FRAMES
    vision_tokens[video] = VIDEO_FRAMES * VIDEO_TOKENS_PER_FRAME + 1
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
