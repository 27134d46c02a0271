"""Training inputs of one sample: LLM token ids with placeholders expanded, labels, and pixel tiles.

Each rank loads only what it needs (docs/design.md), so a sample has three separately loadable parts:

- ``layout(i)``: its media (kind, tiles, LLM tokens, stored size) from file headers and container
  metadata only, the same way the data profiler sizes it (no pixel decoding);
- ``tokens(i)``: input ids [seq_len] with every placeholder expanded to the media's vision tokens,
  and labels [seq_len] (the id on answer tokens, -100 elsewhere; not shifted: the packed row
  shifts inside each sample);
- ``pixels(i)``: float32 tiles [n_tiles, 3, S, S] for the vision tower, S the tower's tile size.

Shapes are checked against shapes.parquet (`ExpectedShape`): the scheduler balanced the batch with
those numbers, so a mismatch is a bug that would silently unbalance it, and is an error naming the
sample.

Token expansion (what transformers' processors write):
- ``llava_ov``: each ``<image>`` becomes ``vision_tokens`` copies of the model's image token, a
  video's placeholder (``<video>``, or a lone ``<image>`` in LLaVA-Video data) as many video
  tokens (LlavaOnevisionProcessor).
- ``internvl``: each image becomes ``<img>`` + n_tiles * P image tokens + ``</img>``; a video is
  first rewritten as ``Frame1: <video>\\nFrame2: <video>...`` (text, `expand_video_placeholders`)
  and each frame becomes ``<img>`` + P image tokens + ``</img>`` (InternVLProcessor). The markers
  are the tokenizer's ``<img>``/``</img>`` when it has them, else Qwen2's
  ``<|vision_start|>``/``<|vision_end|>``.

Small-vocabulary test models (``remap_text_ids``): the tiny presets have 2048 ids but the Qwen2.5
tokenizer 151,667, so every text id ``t >= limit`` becomes ``t % limit`` with ``limit = min(vocab,
image id, video id)``: deterministic, and never a placeholder id. Real models never remap; an id
outside their vocabulary, or a text token equal to the image/video id, is an error.

Pixels: LLaVA-OV images go through transformers' `LlavaOnevisionImageProcessorPil` (AnyRes crops +
base image for a lone image, pad-to-square for images of a multi-image sample), InternVL images
through `GotOcr2ImageProcessorPil` (dynamic tiles + thumbnail), both configured for the tower's
tile size. Video frames are decoded with PyAV (only the sampled frames) and resized to one tile
with the same processor's resize/rescale/normalize (transformers' video processors need
torchvision). Normalisation follows the released checkpoints: SigLIP's 0.5/0.5 for LLaVA-OV,
ImageNet mean/std for InternVL.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

import av
import numpy as np
import pandas as pd
import torch
from PIL import Image

from dflop.config import DatasetSpec
from dflop.data.media import ImageRef, MediaError, image_size, video_meta
from dflop.data.readers import MEDIA_OUTSIDE_ROOT, DatasetError, RawSample, embedded_image_bytes, read_spec
from dflop.data.tokenizer import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    encode_conversation,
    expand_video_placeholders,
)
from dflop.data.vision_tokens import (
    internvl_image_shape,
    internvl_video_shape,
    llava_ov_image_shape,
    llava_ov_multi_image_shape,
    llava_ov_video_shape,
    sample_frame_indices,
)
from dflop.errors import UserError

IGNORE_INDEX = -100
IMAGE, VIDEO = "image", "video"
SIGLIP_MEAN_STD = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
IMAGENET_MEAN_STD = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


class SampleError(UserError):
    """A sample that cannot be turned into training inputs; the message names it."""


class UnreadableMedia(SampleError):
    """A sample whose image or video file cannot be read or decoded (missing, cut short, corrupt):
    a fault of that one sample, which training skips (`dflop.runtime.skipping`). Other
    SampleErrors (shapes.parquet out of date, a tokenizer or vocabulary that does not fit) hit
    every sample alike and stop the run."""


@dataclass(frozen=True)
class SampleRules:
    """How samples become model inputs for one model (plain data, picklable for loader workers).

    arch_params: the tower-completed token rules (``dflop.models.presets.tower_arch_params``):
        llava_ov: image_size, patch_size, grid_pinpoints, anyres_max_tiles, video_frames;
        internvl: tile_size, min_tiles, max_tiles, use_thumbnail, tokens_per_tile, video_frames.
    image_token_id, video_token_id, vocab_size: the LLM's.
    tokenizer: "qwen2.5" or a local tokenizer directory.
    remap_text_ids: fold text ids into a small test vocabulary (module docstring).
    """

    arch: str
    arch_params: Mapping[str, Any]
    image_token_id: int
    video_token_id: int
    vocab_size: int
    tokenizer: str = "qwen2.5"
    remap_text_ids: bool = False

    @property
    def tile_size(self) -> int:
        key = "image_size" if self.arch == "llava_ov" else "tile_size"
        return int(self.arch_params[key])


@dataclass(frozen=True)
class ExpectedShape:
    """What shapes.parquet says about a sample (the scheduler planned with it)."""

    n_tiles: int
    vision_tokens: int
    seq_len: int


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a sample, sized from headers.

    size_hw: stored (height, width) in pixels (images; LLaVA-OV unpads with it).
    frame_indices: the decoded frames of a video (uniform sampling).
    """

    kind: str
    n_tiles: int
    vision_tokens: int
    size_hw: tuple[int, int] | None = None
    frame_indices: tuple[int, ...] = ()


@dataclass(frozen=True)
class SampleLayout:
    """A sample's media in placeholder order."""

    sample_id: str
    media: tuple[MediaItem, ...]

    @property
    def n_tiles(self) -> int:
        return sum(m.n_tiles for m in self.media)

    @property
    def vision_tokens(self) -> int:
        return sum(m.vision_tokens for m in self.media)


@dataclass(frozen=True)
class LoadedSample:
    """What one rank asked for of one sample (parts not asked for are None).

    input_ids, labels: int64 [seq_len]; pixels: float32 [n_tiles, 3, S, S].
    error: why the sample could not be loaded (a `SampleError`'s message; every part is then None).
    load_s: seconds the load took (set by the trainer's loader, `dflop.runtime.loading`).
    """

    index: int
    layout: SampleLayout | None = None
    input_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    pixels: torch.Tensor | None = None
    error: str | None = None
    load_s: float = 0.0

    def pin_memory(self) -> "LoadedSample":
        """Pinned copy (DataLoader's pin_memory calls this on CUDA)."""
        pin = (lambda t: None if t is None else t.pin_memory())
        return LoadedSample(self.index, self.layout, pin(self.input_ids), pin(self.labels), pin(self.pixels),
                            self.error, self.load_s)


@dataclass(frozen=True)
class Request:
    """Which parts of sample `index` to load (the key a loader passes to `TrainingData`)."""

    index: int
    layout: bool = False
    tokens: bool = False
    pixels: bool = False


def _with_bytes(ref: ImageRef) -> ImageRef:
    """`ref` with its embedded bytes, read back from the dataset when only their source is kept
    (the trainer's samples; see `ImageRef.without_bytes`)."""
    if ref.path is not None or ref.data is not None:
        return ref
    return ImageRef(data=embedded_image_bytes(ref.source), name=ref.name, source=ref.source)


def pool_samples(pool: pd.DataFrame, datasets: Sequence[DatasetSpec], seed: int) -> list[RawSample]:
    """The RawSample of every pool row, read from the datasets (each rank reads the manifests).

    Images embedded in Parquet datasets are kept as their (file, row) source, not their bytes:
    the loader reads the bytes of the images a step needs (`embedded_image_bytes`), so no rank
    holds a dataset's images in memory.
    """
    wanted = set(zip(pool["dataset"], pool["sample_id"]))
    found: dict[tuple[str, str], RawSample] = {}
    for ds in datasets:
        for sample in read_spec(ds, seed):
            key = (sample.dataset, sample.sample_id)
            if key in wanted:
                found[key] = dataclasses.replace(sample, images=tuple(r.without_bytes() for r in sample.images))
    out = []
    for dataset, sample_id in zip(pool["dataset"], pool["sample_id"]):
        sample = found.get((dataset, sample_id))
        if sample is None:
            raise UserError(f"shapes.parquet sample {dataset}/{sample_id} is not in the configured datasets "
                            "(data changed since profile_data? re-run it)")
        out.append(sample)
    return out


class TrainingData(torch.utils.data.Dataset):
    """Training inputs of a fixed list of samples (index i = samples[i]).

    expected: per-sample shapes.parquet values to check against (same order), or None.
    """

    def __init__(self, samples: Sequence[RawSample], rules: SampleRules,
                 expected: Sequence[ExpectedShape] | None = None):
        if rules.arch not in ("llava_ov", "internvl"):
            raise UserError(f"model.arch: unknown architecture {rules.arch!r}")
        if expected is not None and len(expected) != len(samples):
            raise ValueError(f"{len(expected)} expected shapes for {len(samples)} samples")
        self.samples = list(samples)
        self.rules = rules
        self.expected = None if expected is None else list(expected)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, request: Request | int) -> LoadedSample:
        if isinstance(request, (int, np.integer)):
            request = Request(int(request), layout=True, tokens=True, pixels=True)
        i = request.index
        layout = self.layout(i) if (request.layout or request.tokens or request.pixels) else None
        ids = labels = pixels = None
        if request.tokens:
            ids, labels = self.tokens(i, layout)
        if request.pixels:
            pixels = self.pixels(i, layout)
        return LoadedSample(i, layout if request.layout else None, ids, labels, pixels)

    def prepare(self, *, tokens: bool, pixels: bool) -> None:
        """Build now the processors that loading `tokens` / `pixels` needs (the tokenizer: up to
        seconds of BPE conversion, `load_tokenizer`), so that the first load does not pay for them: the
        trainer calls it before its first step, whose wait for samples and first forward (which is
        charged the loads' seconds) would otherwise include them."""
        if tokens:
            self._tokenizer  # noqa: B018 (cached_property: building it is the point)
        if pixels:
            self._image_processor  # noqa: B018

    # -- helpers shared by the processors (built lazily: workers build their own) -------------

    @cached_property
    def _tokenizer(self):
        from dflop.data.tokenizer import load_tokenizer

        return load_tokenizer(self.rules.tokenizer)

    @cached_property
    def _image_processor(self):
        size = {"height": self.rules.tile_size, "width": self.rules.tile_size}
        if self.rules.arch == "llava_ov":
            from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
                LlavaOnevisionImageProcessorPil,
            )

            mean, std = SIGLIP_MEAN_STD
            pinpoints = [list(p) for p in self.rules.arch_params["grid_pinpoints"]]
            return LlavaOnevisionImageProcessorPil(size=size, image_grid_pinpoints=pinpoints, image_mean=mean,
                                                   image_std=std)
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        mean, std = IMAGENET_MEAN_STD
        params = self.rules.arch_params
        return GotOcr2ImageProcessorPil(size=size, crop_to_patches=True, min_patches=params["min_tiles"],
                                        max_patches=params["max_tiles"], image_mean=mean, image_std=std)

    def _name(self, i: int) -> str:
        s = self.samples[i]
        return f"sample {s.dataset}/{s.sample_id}"

    # -- layout (headers only) ---------------------------------------------------------------

    def layout(self, i: int) -> SampleLayout:
        """The sample's media from headers, checked against shapes.parquet."""
        sample = self.samples[i]
        if sample.error is not None:
            # Media that left the media root since profile_data (a symlink or allow_absolute_paths changed)
            # is that one sample's fault, skipped like an unreadable file; any other error means stale shapes.
            error = UnreadableMedia if sample.error == MEDIA_OUTSIDE_ROOT else SampleError
            detail = f": {sample.error_detail}" if sample.error_detail else ""
            raise error(f"{self._name(i)}: unusable ({sample.error}{detail})")
        try:
            sizes = [image_size(_with_bytes(ref)) for ref in sample.images]  # (width, height)
            frames = video_meta(sample.video.path).n_frames if sample.video is not None else None
        except (MediaError, DatasetError) as exc:
            raise UnreadableMedia(f"{self._name(i)}: {exc}") from None
        params = self.rules.arch_params
        media: list[MediaItem] = []
        if self.rules.arch == "llava_ov":
            geometry = dict(image_size=params["image_size"], patch_size=params["patch_size"])
            if len(sizes) == 1:
                (w, h), = sizes
                shape = llava_ov_image_shape(w, h, grid_pinpoints=params["grid_pinpoints"],
                                             anyres_max_tiles=params["anyres_max_tiles"], **geometry)
                media.append(MediaItem(IMAGE, shape.n_tiles, shape.vision_tokens, (h, w)))
            else:
                per_image = llava_ov_multi_image_shape(1, **geometry)
                media.extend(MediaItem(IMAGE, 1, per_image.vision_tokens, (h, w)) for w, h in sizes)
            if frames is not None:
                indices = tuple(sample_frame_indices(frames, params["video_frames"]))
                shape = llava_ov_video_shape(len(indices), **geometry)
                media.append(MediaItem(VIDEO, shape.n_tiles, shape.vision_tokens, None, indices))
        else:
            for w, h in sizes:
                shape = internvl_image_shape(w, h, tile_size=params["tile_size"], min_tiles=params["min_tiles"],
                                             max_tiles=params["max_tiles"], use_thumbnail=params["use_thumbnail"],
                                             tokens_per_tile=params["tokens_per_tile"])
                media.append(MediaItem(IMAGE, shape.n_tiles, shape.vision_tokens, (h, w)))
            if frames is not None:
                indices = tuple(sample_frame_indices(frames, params["video_frames"]))
                shape = internvl_video_shape(len(indices), tokens_per_tile=params["tokens_per_tile"])
                media.append(MediaItem(VIDEO, shape.n_tiles, shape.vision_tokens, None, indices))
        layout = SampleLayout(sample.sample_id, tuple(media))
        if self.expected is not None:
            want = self.expected[i]
            for what, got, expected in (("n_tiles", layout.n_tiles, want.n_tiles),
                                        ("vision_tokens", layout.vision_tokens, want.vision_tokens)):
                if got != expected:
                    raise SampleError(f"{self._name(i)}: the trainer builds {what}={got} but shapes.parquet says "
                                      f"{expected} (shapes from another model or data version? re-run profile_data)")
        return layout

    # -- tokens ------------------------------------------------------------------------------

    def _marker_ids(self) -> tuple[int, int]:
        vocab = self._tokenizer.get_added_vocab()
        for start, end in (("<img>", "</img>"), ("<|vision_start|>", "<|vision_end|>")):
            if start in vocab and end in vocab:
                return vocab[start], vocab[end]
        raise SampleError(f"tokenizer {self.rules.tokenizer!r} has neither <img>/</img> nor "
                          "<|vision_start|>/<|vision_end|> for InternVL's image markers")

    def _text_id(self, ids: np.ndarray, i: int) -> np.ndarray:
        """Map text ids into the LLM vocabulary (module docstring)."""
        rules = self.rules
        limit = min(rules.vocab_size, rules.image_token_id, rules.video_token_id)
        if rules.remap_text_ids:
            return np.where(ids >= limit, ids % limit, ids)
        bad = ids[(ids >= rules.vocab_size) | (ids == rules.image_token_id) | (ids == rules.video_token_id)]
        if bad.size:
            raise SampleError(f"{self._name(i)}: text token id {int(bad[0])} is outside the LLM vocabulary "
                              f"({rules.vocab_size}) or equals its image/video token; use the model's own tokenizer")
        return ids

    def tokens(self, i: int, layout: SampleLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [seq_len], labels [seq_len]) int64; labels -100 off the answers."""
        layout = layout if layout is not None else self.layout(i)
        sample, rules = self.samples[i], self.rules
        conversations = list(sample.conversations)
        video = next((m for m in layout.media if m.kind == VIDEO), None)
        if video is not None and not sample.images:
            # LLaVA-Video data often marks its one video with <image>; make it a video placeholder.
            conversations = [{**t, "value": t["value"].replace(IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)}
                             for t in conversations]
            if rules.arch == "internvl":
                conversations = expand_video_placeholders(conversations, [len(video.frame_indices)], arch="internvl")
        try:
            encoded = encode_conversation(self._tokenizer, conversations)
        except ValueError as exc:
            raise SampleError(f"{self._name(i)}: {exc}") from None
        pieces = self._vision_pieces(layout, encoded.placeholder_tokens, i)
        text_ids = self._text_id(encoded.input_ids, i)
        mask = encoded.labels_mask
        ids_out: list[np.ndarray] = []
        labels_out: list[np.ndarray] = []
        start = 0
        for position, piece in zip(encoded.placeholder_positions.tolist(), pieces):
            ids_out += [text_ids[start:position], piece]
            labels_out += [np.where(mask[start:position], text_ids[start:position], IGNORE_INDEX),
                           np.full(len(piece), IGNORE_INDEX)]
            start = position + 1
        ids_out.append(text_ids[start:])
        labels_out.append(np.where(mask[start:], text_ids[start:], IGNORE_INDEX))
        input_ids = torch.from_numpy(np.concatenate(ids_out).astype(np.int64))
        labels = torch.from_numpy(np.concatenate(labels_out).astype(np.int64))
        if self.expected is not None and input_ids.numel() != self.expected[i].seq_len:
            raise SampleError(f"{self._name(i)}: the trainer builds {input_ids.numel()} tokens but shapes.parquet "
                              f"says seq_len={self.expected[i].seq_len} (re-run profile_data)")
        return input_ids, labels

    def _vision_pieces(self, layout: SampleLayout, placeholders: tuple[str, ...], i: int) -> list[np.ndarray]:
        """Token ids replacing each placeholder, in order."""
        rules = self.rules
        n_images = sum(m.kind == IMAGE for m in layout.media)
        n_videos = len(layout.media) - n_images
        pieces: list[np.ndarray] = []
        if rules.arch == "llava_ov":
            expected = [IMAGE_PLACEHOLDER] * n_images + [VIDEO_PLACEHOLDER] * n_videos
            if sorted(placeholders) != sorted(expected):
                raise SampleError(f"{self._name(i)}: placeholders {list(placeholders)} do not match its media "
                                  f"({n_images} image(s), {n_videos} video(s))")
            images = iter(m for m in layout.media if m.kind == IMAGE)
            videos = iter(m for m in layout.media if m.kind == VIDEO)
            for token in placeholders:
                item = next(images) if token == IMAGE_PLACEHOLDER else next(videos)
                token_id = rules.image_token_id if item.kind == IMAGE else rules.video_token_id
                pieces.append(np.full(item.vision_tokens, token_id))
            return pieces
        start, end = (int(x) for x in self._text_id(np.array(self._marker_ids()), i))
        per_tile = int(rules.arch_params["tokens_per_tile"])
        expected_count = n_images + sum(len(m.frame_indices) for m in layout.media if m.kind == VIDEO)
        if len(placeholders) != expected_count:
            raise SampleError(f"{self._name(i)}: {len(placeholders)} placeholders for {n_images} image(s) and "
                              f"{expected_count - n_images} video frame(s)")
        tiles = [m.n_tiles for m in layout.media if m.kind == IMAGE]
        tiles += [1 for m in layout.media if m.kind == VIDEO for _ in m.frame_indices]
        for n in tiles:
            pieces.append(np.concatenate([[start], np.full(n * per_tile, rules.image_token_id), [end]]))
        return pieces

    # -- pixels ------------------------------------------------------------------------------

    def pixels(self, i: int, layout: SampleLayout | None = None) -> torch.Tensor:
        """float32 [n_tiles, 3, S, S]: every image's tiles, then the video's frames."""
        layout = layout if layout is not None else self.layout(i)
        sample = self.samples[i]
        size = self.rules.tile_size
        parts: list[np.ndarray] = []
        if sample.images:
            images = [self._open_image(ref, i) for ref in sample.images]
            parts.extend(self._image_tiles(images))
        video = next((m for m in layout.media if m.kind == VIDEO), None)
        if video is not None:
            parts.append(self._frames(sample.video.path, video.frame_indices, i))
        if not parts:
            return torch.zeros(0, 3, size, size)
        pixels = torch.from_numpy(np.concatenate(parts).astype(np.float32))
        if pixels.shape[0] != layout.n_tiles:
            raise SampleError(f"{self._name(i)}: the image processor made {pixels.shape[0]} tiles but the tiling "
                              f"rules say {layout.n_tiles}")
        return pixels

    def _open_image(self, ref: ImageRef, i: int) -> Image.Image:
        """Pixels as stored (no EXIF transpose), like the data profiler's sizes."""
        try:
            ref = _with_bytes(ref)
            with Image.open(ref.path if ref.path is not None else io.BytesIO(ref.data)) as image:
                return image.convert("RGB")
        except DatasetError as exc:
            raise UnreadableMedia(f"{self._name(i)}: {exc}") from None
        except (OSError, ValueError) as exc:
            raise UnreadableMedia(f"{self._name(i)}: cannot decode image {ref.label} ({exc})") from None

    def _image_tiles(self, images: list[Image.Image]) -> list[np.ndarray]:
        processor = self._image_processor
        if self.rules.arch == "llava_ov":
            out = processor([images], do_pad=False)
            return list(out["pixel_values"])
        out = processor(images)
        tiles = np.stack(out["pixel_values"])
        if self.rules.arch_params["use_thumbnail"]:
            return [tiles]
        # InternVL's use_thumbnail=False: drop the thumbnail HF appends after each image's tiles.
        keep, start = [], 0
        for n in out["num_patches"]:
            keep.append(tiles[start:start + (n - 1 if n > 1 else 1)])
            start += n
        return keep

    def _frames(self, path, indices: Sequence[int], i: int) -> np.ndarray:
        """Decode only the frames at `indices` and make each one tile: [n, 3, S, S]."""
        from transformers.image_utils import SizeDict

        wanted = set(indices)
        frames: dict[int, np.ndarray] = {}
        try:
            with av.open(str(path)) as container:
                for k, frame in enumerate(container.decode(video=0)):
                    if k in wanted:
                        frames[k] = frame.to_ndarray(format="rgb24")
                    if k >= max(indices):
                        break
        except (av.FFmpegError, OSError, ValueError) as exc:
            raise UnreadableMedia(f"{self._name(i)}: cannot decode video {path} ({exc})") from None
        missing = [k for k in indices if k not in frames]
        if missing:
            raise UnreadableMedia(f"{self._name(i)}: video {path} has no frame {missing[0]} (decoded {len(frames)} of "
                              f"{len(indices)} sampled frames; the container metadata overstates its length)")
        processor, size = self._image_processor, self.rules.tile_size
        mean, std = processor.image_mean, processor.image_std
        tiles = []
        for k in indices:
            chw = frames[k].transpose(2, 0, 1)
            chw = processor.resize(chw, SizeDict(height=size, width=size), resample=processor.resample)
            chw = processor.normalize(processor.rescale(chw, processor.rescale_factor), mean, std)
            tiles.append(chw)
        return np.stack(tiles)
