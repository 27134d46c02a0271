"""How many vision-encoder inputs and LLM tokens a sample's images and videos become.

The data profiler calls this for every sample with only what file headers give (image width and
height, video frame counts), so the rules are pure integer arithmetic: no pixels, PIL or torch.
Each rule reproduces, to the token, what the Hugging Face processors of transformers 5.x do
(files under ``transformers/models/<name>/``); tests compare against those processors.

Two numbers per sample (``VisionShape``):

- ``n_tiles``: 2-D inputs the vision encoder runs on (AnyRes crops plus the base image, InternVL
  tiles plus the thumbnail, or video frames). Encoder cost is linear in it.
- ``vision_tokens``: tokens the sample's media occupy in the LLM sequence, i.e. what the
  processor substitutes for the ``<image>`` / ``<video>`` placeholders (newline tokens and
  InternVL's ``<img>``/``</img>`` markers included). ``seq_len = text_tokens + vision_tokens``.

Architectures (``arch``) and their keyword parameters, defaults from the released checkpoints:

- ``llava_ov`` (llava-onevision-qwen2-7b-ov): ``image_size=384``, ``patch_size=14`` (SigLIP:
  27x27 = 729 tokens per tile), ``grid_pinpoints`` = the 36 (height, width) canvases 384..2304 in
  steps of 384, ``anyres_max_tiles=9`` (the N of ``vision_aspect_ratio="anyres_max_N"``),
  ``video_frames=32`` (frames sampled per video).
- ``internvl`` (InternVL2.5/3, GotOcr2-style tiling): ``tile_size=448``, ``min_tiles=1``,
  ``max_tiles=12``, ``use_thumbnail=True``, ``tokens_per_tile=256`` ((448/14)^2 pixel-shuffled by
  0.5^2), ``video_frames=8``.

The keyword names match the config's ``model.llava_ov`` / ``model.internvl`` blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np

ARCHS = ("llava_ov", "internvl")

# (height, width) canvases of llava-onevision-qwen2-*-ov, in the order of its config and of
# LlavaOnevisionImageProcessor.image_grid_pinpoints (the order decides ties in the selection).
LLAVA_OV_GRID_PINPOINTS: tuple[tuple[int, int], ...] = tuple(
    (height, width) for height in range(384, 2305, 384) for width in range(384, 2305, 384)
)

DEFAULT_VIDEO_FRAMES = {"llava_ov": 32, "internvl": 8}


@dataclass(frozen=True)
class VisionShape:
    """Vision work of one sample: encoder inputs (tiles or frames) and LLM tokens they become."""

    n_tiles: int
    vision_tokens: int

    def __add__(self, other: VisionShape) -> VisionShape:
        return VisionShape(self.n_tiles + other.n_tiles, self.vision_tokens + other.vision_tokens)


NO_VISION = VisionShape(0, 0)


# --------------------------------------------------------------------------------------------
# Video frame sampling


def sampled_frame_count(total_frames: int, video_frames: int) -> int:
    """Frames the model sees from a video of `total_frames` frames when sampling `video_frames`.

    A video shorter than `video_frames` uses all its frames (HF's samplers refuse that case and
    LLaVA-OV's own loader keeps every frame of a short video).
    """
    _check_positive_int(total_frames, "total_frames")
    _check_positive_int(video_frames, "video_frames")
    return min(total_frames, video_frames)


def sample_frame_indices(total_frames: int, video_frames: int) -> list[int]:
    """Indices of the frames to decode: ``i * total_frames // n`` for i < n = min(total_frames,
    video_frames) (uniform, rounded down; all frames when the video is short).

    This is transformers' ``video_utils.default_sample_indices_fn(num_frames=n)`` as of 5.24 (what
    LlavaOnevisionVideoProcessor uses when it samples). transformers 5.17 stepped ``np.arange`` by
    the float ``total_frames / n`` with an int dtype, which numpy 2.5 steps by its integer part: 100
    frames, 32 wanted gave every 3rd frame up to 93 (we take 0, 3, ..., 21, 25, 28, ..., 96), and 15
    frames, 13 wanted gave 14. The token rules use only the count, n (`sampled_frame_count`).
    """
    count = sampled_frame_count(total_frames, video_frames)
    return [i * total_frames // count for i in range(count)]


# --------------------------------------------------------------------------------------------
# LLaVA-OneVision


def llava_ov_tokens_per_tile(*, image_size: int = 384, patch_size: int = 14) -> int:
    """Vision-tower tokens of one tile: (image_size // patch_size)^2 = 729 for SigLIP-384/14."""
    return (image_size // patch_size) ** 2


def select_best_resolution(
    height: int, width: int, grid_pinpoints: Sequence[tuple[int, int]]
) -> tuple[int, int]:
    """The (height, width) canvas that keeps the most image pixels, then wastes the fewest.

    Same rule, arithmetic and tie order as transformers'
    ``image_processing_utils.select_best_resolution`` (first canvas wins a full tie).
    """
    best_fit = None
    max_effective = 0
    min_wasted = float("inf")
    for canvas_height, canvas_width in grid_pinpoints:
        scale = min(canvas_width / width, canvas_height / height)
        downscaled_width, downscaled_height = int(width * scale), int(height * scale)
        effective = min(downscaled_width * downscaled_height, width * height)
        wasted = canvas_width * canvas_height - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            max_effective = effective
            min_wasted = wasted
            best_fit = (canvas_height, canvas_width)
    if best_fit is None:
        raise ValueError("grid_pinpoints is empty")
    return best_fit


@lru_cache(maxsize=65536)
def _llava_ov_single_image(
    width: int,
    height: int,
    image_size: int,
    patch_size: int,
    grid_pinpoints: tuple[tuple[int, int], ...],
    anyres_max_tiles: int,
) -> VisionShape:
    # Encoder inputs (LlavaOnevisionImageProcessor.get_image_patches): the image resized to one
    # tile (base) + the best canvas cut into image_size crops.
    canvas_height, canvas_width = select_best_resolution(height, width, grid_pinpoints)
    crops_down, crops_across = canvas_height // image_size, canvas_width // image_size

    # Tokens (LlavaOnevisionProcessor._get_number_of_features / _get_unpadded_features, which
    # mirror the model's pack_image_features + unpad_image): the crops' feature grid with the
    # letterbox padding removed, bilinearly shrunk when it exceeds anyres_max_tiles tiles of
    # features, one newline token per feature row, then the base tile's features.
    grid = image_size // patch_size
    rows, cols = grid * crops_down, grid * crops_across
    if width / height > cols / rows:
        new_height = int(round(height * (cols / width), 7))
        rows -= (rows - new_height) // 2 * 2
    else:
        new_width = int(round(width * (rows / height), 7))
        cols -= (cols - new_width) // 2 * 2
    ratio = math.sqrt(rows * cols / (anyres_max_tiles * grid**2))
    if ratio > 1.1:
        rows, cols = int(rows // ratio), int(cols // ratio)
    tokens = rows * cols + rows + grid * grid
    return VisionShape(n_tiles=1 + crops_down * crops_across, vision_tokens=tokens)


def llava_ov_image_shape(
    width: int,
    height: int,
    *,
    image_size: int = 384,
    patch_size: int = 14,
    grid_pinpoints: Sequence[tuple[int, int]] = LLAVA_OV_GRID_PINPOINTS,
    anyres_max_tiles: int = 9,
) -> VisionShape:
    """A sample's only image under LLaVA-OV AnyRes (width, height in pixels).

    n_tiles = 1 base + (canvas_h / image_size) * (canvas_w / image_size) crops, up to 37 with the
    default canvases: ``anyres_max_9`` shrinks the features, not the crops the encoder runs on.
    vision_tokens = unpadded (and possibly shrunk) crop features + one newline per feature row
    + 729 base-tile features.
    """
    _check_size(width, height)
    return _llava_ov_single_image(
        int(width),
        int(height),
        image_size,
        patch_size,
        _as_pinpoints(grid_pinpoints),
        anyres_max_tiles,
    )


def llava_ov_multi_image_shape(
    n_images: int, *, image_size: int = 384, patch_size: int = 14
) -> VisionShape:
    """A sample with several images: each is padded to a square and becomes one tile.

    LlavaOnevisionImageProcessor crops only samples with exactly one image (``need_patching``);
    LlavaOnevisionProcessor.replace_image_token gives each image of a multi-image sample
    729 + 1 (newline) tokens, whatever its size.
    """
    per_image = llava_ov_tokens_per_tile(image_size=image_size, patch_size=patch_size) + 1
    return VisionShape(n_tiles=n_images, vision_tokens=n_images * per_image)


def llava_ov_video_shape(
    n_frames: int, *, image_size: int = 384, patch_size: int = 14
) -> VisionShape:
    """A video of n_frames (already sampled) frames: one tile per frame.

    LlavaOnevisionProcessor.replace_video_token: each frame's 27x27 features are pooled 2x2 to
    ceil(27/2)^2 = 14x14 = 196 tokens, plus a single newline token for the whole video.
    """
    _check_positive_int(n_frames, "n_frames")
    pooled = math.ceil((image_size // patch_size) / 2)
    return VisionShape(n_tiles=n_frames, vision_tokens=n_frames * pooled * pooled + 1)


def _llava_ov_sample_shape(
    images: Sequence[tuple[int, int]],
    videos: Sequence[int],
    *,
    image_size: int = 384,
    patch_size: int = 14,
    grid_pinpoints: Sequence[tuple[int, int]] = LLAVA_OV_GRID_PINPOINTS,
    anyres_max_tiles: int = 9,
    video_frames: int = DEFAULT_VIDEO_FRAMES["llava_ov"],
) -> VisionShape:
    shape = NO_VISION
    if len(images) == 1:
        ((width, height),) = images
        shape = llava_ov_image_shape(
            width,
            height,
            image_size=image_size,
            patch_size=patch_size,
            grid_pinpoints=grid_pinpoints,
            anyres_max_tiles=anyres_max_tiles,
        )
    elif len(images) > 1:
        for width, height in images:
            _check_size(width, height)
        shape = llava_ov_multi_image_shape(
            len(images), image_size=image_size, patch_size=patch_size
        )
    for total_frames in videos:
        frames = sampled_frame_count(total_frames, video_frames)
        shape += llava_ov_video_shape(frames, image_size=image_size, patch_size=patch_size)
    return shape


# --------------------------------------------------------------------------------------------
# InternVL


@lru_cache(maxsize=64)
def _tile_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """(columns, rows) grids with min_tiles <= columns*rows <= max_tiles, by tile count.

    Same list and order as GotOcr2's get_all_supported_aspect_ratios (stable sort of the
    columns-major enumeration); the order decides ties in internvl_tile_grid.
    """
    grids = [
        (columns, rows)
        for columns in range(1, max_tiles + 1)
        for rows in range(1, max_tiles + 1)
        if min_tiles <= columns * rows <= max_tiles
    ]
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))


@lru_cache(maxsize=65536)
def internvl_tile_grid(
    width: int, height: int, *, tile_size: int = 448, min_tiles: int = 1, max_tiles: int = 12
) -> tuple[int, int]:
    """(columns, rows) of tiles InternVL cuts an image into: the grid closest in aspect ratio.

    GotOcr2ImageProcessor.get_optimal_tiled_canvas (InternVL's find_closest_aspect_ratio): on an
    exact tie in aspect-ratio distance the later (larger) grid wins while the image has more than
    half the grid's pixel area.
    """
    aspect_ratio = width / height
    area = width * height
    best_diff = float("inf")
    best_grid = (1, 1)
    for grid in _tile_grids(min_tiles, max_tiles):
        diff = abs(aspect_ratio - grid[0] / grid[1])
        if diff < best_diff:
            best_diff = diff
            best_grid = grid
        elif diff == best_diff and area > 0.5 * tile_size * tile_size * grid[0] * grid[1]:
            best_grid = grid
    return best_grid


def internvl_image_shape(
    width: int,
    height: int,
    *,
    tile_size: int = 448,
    min_tiles: int = 1,
    max_tiles: int = 12,
    use_thumbnail: bool = True,
    tokens_per_tile: int = 256,
) -> VisionShape:
    """One image under InternVL dynamic tiling (width, height in pixels).

    n_tiles = columns*rows of internvl_tile_grid, + 1 thumbnail (the whole image resized to one
    tile) when there is more than one tile (GotOcr2ImageProcessor.crop_image_to_patches; tiling is
    off when max_tiles == 1). vision_tokens = n_tiles * tokens_per_tile + 2 for the ``<img>`` and
    ``</img>`` markers (InternVLProcessor.replace_image_token). HF always adds the thumbnail;
    ``use_thumbnail=False`` follows InternVL's own config option of that name.
    """
    _check_size(width, height)
    tiles = 1
    if max_tiles > 1:
        columns, rows = internvl_tile_grid(
            int(width), int(height), tile_size=tile_size, min_tiles=min_tiles, max_tiles=max_tiles
        )
        tiles = columns * rows
        if use_thumbnail and tiles > 1:
            tiles += 1
    return VisionShape(n_tiles=tiles, vision_tokens=tiles * tokens_per_tile + 2)


def internvl_video_shape(n_frames: int, *, tokens_per_tile: int = 256) -> VisionShape:
    """A video of n_frames (already sampled) frames: each frame is one untiled tile.

    InternVLProcessor.replace_video_token writes ``FrameK: <img>`` + tokens_per_tile context
    tokens + ``</img>`` per frame, frames joined by newlines. The ``FrameK: `` labels and the
    newlines are ordinary text; they are counted as text tokens (see
    tokenizer.expand_video_placeholders), so vision_tokens = n_frames * (tokens_per_tile + 2).
    """
    _check_positive_int(n_frames, "n_frames")
    return VisionShape(n_tiles=n_frames, vision_tokens=n_frames * (tokens_per_tile + 2))


def _internvl_sample_shape(
    images: Sequence[tuple[int, int]],
    videos: Sequence[int],
    *,
    tile_size: int = 448,
    min_tiles: int = 1,
    max_tiles: int = 12,
    use_thumbnail: bool = True,
    tokens_per_tile: int = 256,
    video_frames: int = DEFAULT_VIDEO_FRAMES["internvl"],
) -> VisionShape:
    # InternVLProcessor tiles every image the same way, however many the sample has.
    shape = NO_VISION
    for width, height in images:
        shape += internvl_image_shape(
            width,
            height,
            tile_size=tile_size,
            min_tiles=min_tiles,
            max_tiles=max_tiles,
            use_thumbnail=use_thumbnail,
            tokens_per_tile=tokens_per_tile,
        )
    for total_frames in videos:
        frames = sampled_frame_count(total_frames, video_frames)
        shape += internvl_video_shape(frames, tokens_per_tile=tokens_per_tile)
    return shape


# --------------------------------------------------------------------------------------------
# Entry point for the data profiler

_SAMPLE_RULES: dict[str, Callable[..., VisionShape]] = {
    "llava_ov": _llava_ov_sample_shape,
    "internvl": _internvl_sample_shape,
}
_ARCH_PARAMS = {
    "llava_ov": ("image_size", "patch_size", "grid_pinpoints", "anyres_max_tiles", "video_frames"),
    "internvl": (
        "tile_size",
        "min_tiles",
        "max_tiles",
        "use_thumbnail",
        "tokens_per_tile",
        "video_frames",
    ),
}


def sample_vision_shape(
    arch: str,
    images: Sequence[tuple[int, int]] = (),
    videos: Sequence[int] = (),
    **arch_params: Any,
) -> VisionShape:
    """Encoder tiles and LLM vision tokens of one sample.

    Args:
        arch: "llava_ov" or "internvl".
        images: (width, height) in pixels of each image, in placeholder order.
        videos: total frame count of each video (from the container); each is sampled down to
            ``video_frames`` frames (sampled_frame_count).
        arch_params: the architecture's keyword parameters (module docstring), e.g. the config's
            ``model.<arch>`` block; unknown keys are an error.
    """
    if arch not in _SAMPLE_RULES:
        raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(ARCHS)}")
    unknown = sorted(set(arch_params) - set(_ARCH_PARAMS[arch]))
    if unknown:
        raise ValueError(
            f"unknown {arch} parameter(s) {', '.join(unknown)}: "
            f"expected {', '.join(_ARCH_PARAMS[arch])}"
        )
    return _SAMPLE_RULES[arch](images, videos, **arch_params)


def sample_vision_shapes(
    arch: str,
    images: Sequence[Sequence[tuple[int, int]]],
    videos: Sequence[Sequence[int]],
    **arch_params: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """sample_vision_shape over many samples: (n_tiles [n], vision_tokens [n]) int64 arrays."""
    if len(images) != len(videos):
        raise ValueError(f"images has {len(images)} samples but videos has {len(videos)}")
    n_tiles = np.zeros(len(images), dtype=np.int64)
    vision_tokens = np.zeros(len(images), dtype=np.int64)
    for i, (sample_images, sample_videos) in enumerate(zip(images, videos)):
        shape = sample_vision_shape(arch, sample_images, sample_videos, **arch_params)
        n_tiles[i], vision_tokens[i] = shape.n_tiles, shape.vision_tokens
    return n_tiles, vision_tokens


# --------------------------------------------------------------------------------------------
# Input checks


def _check_positive_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_size(width: Any, height: Any) -> None:
    for value, name in ((width, "width"), (height, "height")):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(
                f"image {name} must be a positive integer, "
                f"got {value!r} in size ({width!r}, {height!r})"
            )


def _as_pinpoints(grid_pinpoints: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    pinpoints = tuple((int(h), int(w)) for h, w in grid_pinpoints)
    if not pinpoints:
        raise ValueError("grid_pinpoints is empty")
    return pinpoints
