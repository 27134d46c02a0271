"""The samples a batch is priced on, and the bytes each sample sends across a pipeline hop.

`Pool` holds per-sample shapes (from shapes.parquet) as arrays, so a global batch is a `take` of
it; `TransferSizes` turns token and tile counts into bytes for the transfers `Pricing` charges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dflop.costmodel.memory import canonical_dtype
from dflop.shapes import usable

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Pool:
    """The samples plans are judged on (rows of shapes.parquet with status ok).

    n_tiles, seq_len, vision_tokens: [N] tiles through the vision tower, tokens in the packed LLM
    sequence, and tokens the vision features become. sample_id: [N] for error messages.
    n_frames, n_images, media_pixels: [N] video frames, images and the pixels decoded, what a
    sample's load costs besides its tiles (`dflop.costmodel.model.LoadLine`); zeros where the
    table has no such column. draw_p: [N] probability of drawing each sample into a sampled global
    batch (the datasets' mix, `dflop.data.sampling.DatasetMix.probabilities`); None: uniform.
    """

    sample_id: np.ndarray
    n_tiles: np.ndarray
    seq_len: np.ndarray
    vision_tokens: np.ndarray
    n_frames: np.ndarray | None = None
    n_images: np.ndarray | None = None
    media_pixels: np.ndarray | None = None
    draw_p: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self):
        for name in ("n_frames", "n_images", "media_pixels"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(len(self.seq_len), dtype=np.int64))

    @classmethod
    def from_shapes(cls, shapes: pd.DataFrame, *, where: str = "shapes", llm_tokens_per_tile: int = 0) -> "Pool":
        """The pool from the usable rows of a shapes table (`dflop.shapes.usable`); `vision_tokens`
        falls back to tiles x llm_tokens_per_tile where the table has no such column."""
        shapes = usable(shapes, where)
        tiles = shapes["n_tiles"].to_numpy(dtype=np.int64)
        vis = (shapes["vision_tokens"].to_numpy(dtype=np.int64) if "vision_tokens" in shapes.columns
               else tiles * llm_tokens_per_tile)
        counts = {name: shapes[name].to_numpy(dtype=np.int64) for name in ("n_frames", "n_images", "media_pixels")
                  if name in shapes.columns}
        return cls(shapes["sample_id"].astype(str).to_numpy(), tiles, shapes["seq_len"].to_numpy(dtype=np.int64), vis,
                   **counts)

    def __len__(self) -> int:
        return len(self.seq_len)

    @property
    def load_features(self) -> dict[str, np.ndarray]:
        """What a sample's load costs, by `dflop.costmodel.model.LOAD_FEATURES` name."""
        return {"n_tiles": self.n_tiles, "n_frames": self.n_frames, "n_images": self.n_images,
                "text_tokens": self.seq_len - self.vision_tokens, "media_pixels": self.media_pixels}

    def take(self, index: np.ndarray) -> "Pool":
        return Pool(self.sample_id[index], self.n_tiles[index], self.seq_len[index], self.vision_tokens[index],
                    self.n_frames[index], self.n_images[index], self.media_pixels[index])


@dataclass(frozen=True)
class TransferSizes:
    """Bytes that cross a pipeline hop per token or tile (activations in the training dtype).

    llm_token_bytes: one LLM hidden state (hidden x dtype bytes): per sequence token between LLM
        stages, and per vision token from the vision tower to the LLM.
    vision_tile_bytes: one tile's hidden states between vision stages (tokens per tile x width).
    """

    llm_token_bytes: float
    vision_tile_bytes: float
    llm_hidden: int = 0  # what sequence parallelism's saving is priced from (`CostModel.llm_stage_terms`)

    @classmethod
    def for_model(cls, *, llm_hidden: int, vision_hidden: int, vision_tokens_per_tile: int, dtype: str):
        nbytes = _DTYPE_BYTES[canonical_dtype(dtype)]
        return cls(float(llm_hidden * nbytes), float(vision_tokens_per_tile * vision_hidden * nbytes), int(llm_hidden))
