"""Running a vision stage on a share of samples, and the per-sample image features of the last one.

A vision replica gets a microbatch's share of samples: their tiles, concatenated in share order,
[n_tiles, 3, S, S]. Middle stages map hidden states [n_tiles, P, d_vision] to the same shape. The
last stage turns each sample's tiles into the rows it occupies in the LLM sequence, in the order
of the sample's placeholders:

- LLaVA-OV images: projector + AnyRes packing (`VisionStage.image_features`, transformers'
  ``pack_image_features``): base tile, unpadded crop grid, one newline per feature row; an image of
  a multi-image sample is one tile + one newline.
- LLaVA-OV videos (which `dflop.models.stages` does not cover): projector on every frame, 2x2
  bilinear pooling (transformers' ``apply_pooling``) and one newline after the whole video, as
  ``LlavaOnevisionModel.get_video_features``.
- InternVL images and video frames alike: final norm, pixel shuffle, projector per tile.

`feature_rows` gives those row counts from shapes.parquet numbers alone, so the first LLM stage
can split a message from a vision replica into samples without loading anything.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel

from dflop.data.training import IMAGE, SampleLayout
from dflop.models.architectures import ImageLayout, architecture_of
from dflop.models.stages import VisionStage


def feature_rows(arch: str, n_tiles: int, vision_tokens: int, tokens_per_tile: int = 0) -> int:
    """Rows of image features a sample contributes to the LLM input.

    LLaVA-OV: all of its vision tokens are feature rows. InternVL: ``n_tiles * tokens_per_tile``
    (its ``<img>``/``</img>`` markers, counted in vision_tokens, are text tokens).
    """
    if arch == "llava_ov":
        return int(vision_tokens)
    return int(n_tiles) * int(tokens_per_tile)


class VisionRunner:
    """Forward of one vision stage over a share of samples (see module docstring)."""

    def __init__(self, stage: VisionStage, model: PreTrainedModel):
        self.stage = stage
        spec = architecture_of(model)
        self.arch = spec.name
        # LLaVA-OV's video pooling is a method of the inner model (it reads only the config).
        self._pool = model.model.apply_pooling if self.arch == "llava_ov" else None

    def __call__(self, x: torch.Tensor, layouts: Sequence[SampleLayout]) -> torch.Tensor:
        """x: pixels [n_tiles, 3, S, S] (first stage) or hidden [n_tiles, P, d_vision].

        Returns hidden [n_tiles, P, d_vision], or on the last stage the features of every sample
        concatenated in share order, [sum of feature rows, d_model].
        """
        stage = self.stage
        hidden = stage.run_layers(stage.embeddings(x) if stage.is_first else x)
        if not stage.is_last:
            return hidden
        if self.arch == "internvl":
            return stage.image_features(hidden)
        return self._llava_ov_features(hidden, layouts)

    def _llava_ov_features(self, hidden: torch.Tensor, layouts: Sequence[SampleLayout]) -> torch.Tensor:
        tail = self.stage.image_features
        image_slices, image_tiles, image_sizes = [], [], []
        items = []  # (kind, first tile, tiles) per media item in share order
        start = 0
        for layout in layouts:
            for item in layout.media:
                items.append((item.kind, start, item.n_tiles))
                if item.kind == IMAGE:
                    image_slices.append(hidden[start:start + item.n_tiles])
                    image_tiles.append(item.n_tiles)
                    image_sizes.append(item.size_hw)
                start += item.n_tiles
        if start != hidden.shape[0]:
            raise ValueError(f"vision share has {hidden.shape[0]} tiles but its samples' layouts {start}")
        image_rows = iter(())
        if image_slices:
            layout = ImageLayout(tuple(image_tiles), torch.tensor(image_sizes, dtype=torch.long))
            packed = tail(torch.cat(image_slices), layout)
            sizes = [item.vision_tokens for lay in layouts for item in lay.media if item.kind == IMAGE]
            image_rows = iter(torch.split(packed, sizes))
        pieces = []
        for kind, first, n in items:
            if kind == IMAGE:
                pieces.append(next(image_rows))
            else:
                pieces.append(self._video_features(hidden[first:first + n]))
        return torch.cat(pieces)

    def _video_features(self, frames: torch.Tensor) -> torch.Tensor:
        """[frames, P, d_vision] -> [frames * pooled + 1, d_model] (LlavaOnevision get_video_features)."""
        tail = self.stage.image_features
        if tail.drop_first:
            frames = frames[:, 1:]
        pooled = self._pool(tail.projector(frames))
        pooled = pooled.reshape(-1, pooled.shape[-1])
        return torch.cat([pooled, tail.image_newline[None].to(pooled.dtype)])
