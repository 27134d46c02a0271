"""Image and video sizes from file headers and container metadata, without decoding pixels.

The data profiler needs each sample's image sizes and video frame counts for a million samples;
decoding them would take hours, reading headers takes milliseconds.

Choices that decide what a size means:

- EXIF orientation is NOT applied by default. The LLaVA / LLaVA-OneVision / InternVL training code
  opens images with ``Image.open(...).convert("RGB")``, and Hugging Face image processors given a
  PIL image use the pixels as stored, so the stored (width, height) is what gets tiled: a portrait
  photo with orientation tag 6 reports its stored landscape size. Note that
  ``transformers.image_utils.load_image`` (used when a processor or chat template is given a path
  or URL) DOES apply the tag; a trainer loading images that way must call
  ``image_size(..., apply_exif_orientation=True)`` so that shapes agree. The tag is read from the
  header (for PNG only when its eXIf chunk precedes the pixel data).
- Truncation. ``Image.open`` reads the header only, so a file whose header is cut fails there and is
  reported as ``truncated_image`` when it starts with a known image signature (else
  ``unreadable_image``). A file cut after its header opens fine; to catch it cheaply we read the
  last bytes and look for the format's end marker (JPEG EOI, PNG IEND, GIF trailer, or the RIFF
  length for WebP). Only when that marker is missing do we fully decode the image, once, to tell a
  truncated file (decode fails: ``truncated_image``) from a valid one followed by extra bytes
  (e.g. a motion photo with a video appended: accepted, as the training loader accepts it).
  Formats without an end marker (BMP, TIFF, ...) get the header check only.
- Videos: frame count from the container index (``stream.frames``), or duration x frame rate when
  the container has no count (Matroska/WebM). A video cut after its header (an MP4 with its index
  first, a Matroska file) still claims every frame; the trainer's decoder then runs out of frames.
  ``video_meta(..., check_complete=True)`` catches that without decoding: an MP4/MOV sample table
  gives every frame's byte range, and the file must reach the end of each (nothing beyond the
  header is read; B-frames and edit lists do not matter); other containers (Matroska, AVI,
  fragmented MP4) have their packets demuxed (the file is read, nothing decoded) and the whole
  ones counted against the header.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import av
from PIL import Image

from dflop.errors import first_line

# Reasons carried by MediaError; the data profiler writes them as ``status=skipped:<reason>``.
MISSING_FILE = "missing_file"
UNREADABLE_IMAGE = "unreadable_image"
TRUNCATED_IMAGE = "truncated_image"
IMAGE_TOO_LARGE = "image_too_large"
UNREADABLE_VIDEO = "unreadable_video"
NO_VIDEO_STREAM = "no_video_stream"
TRUNCATED_VIDEO = "truncated_video"

_TAIL_BYTES = 64
# Bytes that some writers pad after the end marker; they do not make a file truncated.
_TAIL_PADDING = b"\x00\r\n \t"
_SIGNATURES = (
    b"\xff\xd8\xff",  # JPEG
    b"\x89PNG\r\n\x1a\n",
    b"GIF87a",
    b"GIF89a",
    b"BM",
    b"II*\x00",  # TIFF little endian
    b"MM\x00*",  # TIFF big endian
)


class MediaError(Exception):
    """A media file that cannot be used; `reason` is one of the module's reason constants."""

    def __init__(self, reason: str, source: str, detail: str = "") -> None:
        self.reason = reason
        self.source = source
        self.detail = detail
        message = f"{source}: {reason}" + (f" ({detail})" if detail else "")
        super().__init__(message)


@dataclass(frozen=True)
class EmbeddedSource:
    """Where embedded image bytes live: row `row` (0-based, in the file) of Parquet `file`,
    column `column`, list element `item` (None when the column holds one image per row)."""

    file: Path
    row: int
    column: str
    item: int | None = None


@dataclass(frozen=True)
class ImageRef:
    """One image of a sample: a file on disk, or bytes embedded in the dataset (Parquet).

    Either `path` is set, or the image is embedded: its bytes in `data`, or only its `source`
    (the trainer keeps that, not the bytes, so a rank holds no dataset's images in memory; see
    `without_bytes` and `dflop.data.readers.embedded_image_bytes`). `name` is the image's
    original path inside the dataset, kept for error messages when the bytes are embedded.
    """

    path: Path | None = None
    data: bytes | None = field(default=None, repr=False)
    name: str | None = None
    source: EmbeddedSource | None = None

    def __post_init__(self) -> None:
        embedded = self.data is not None or self.source is not None
        if (self.path is None) == (not embedded):
            raise ValueError("ImageRef needs either a path or embedded bytes / their source")

    def without_bytes(self) -> "ImageRef":
        """The same image with its embedded bytes dropped when they can be read again from `source`."""
        if self.data is None or self.source is None:
            return self
        return ImageRef(name=self.name, source=self.source)

    @property
    def label(self) -> str:
        """Short description for messages: the path, or '<embedded NAME, N bytes>'."""
        if self.path is not None:
            return str(self.path)
        if self.data is None and self.source is not None:
            return f"<embedded {self.name or 'image'} in {self.source.file} row {self.source.row}>"
        return f"<embedded {self.name or 'image'}, {len(self.data or b'')} bytes>"


@dataclass(frozen=True)
class VideoRef:
    """The video of a sample: a file on disk."""

    path: Path


@dataclass(frozen=True)
class VideoMeta:
    """Container-level facts of a video. Seconds for duration, frames per second for fps."""

    n_frames: int
    fps: float
    duration_s: float
    width: int
    height: int


def image_size(
    ref: ImageRef | str | os.PathLike, *, apply_exif_orientation: bool = False
) -> tuple[int, int]:
    """(width, height) in pixels of an image, read from its header.

    As stored by default; with apply_exif_orientation, as displayed (width and height swapped for
    EXIF orientations 5-8), matching transformers.image_utils.load_image.
    Raises MediaError with reason missing_file, unreadable_image, truncated_image or
    image_too_large.
    """
    if not isinstance(ref, ImageRef):
        ref = ImageRef(path=Path(ref))
    if ref.data is not None:
        return _probe_image(io.BytesIO(ref.data), ref.label, apply_exif_orientation)
    try:
        fp = open(ref.path, "rb")
    except FileNotFoundError:
        raise MediaError(MISSING_FILE, ref.label) from None
    except OSError as exc:
        raise MediaError(UNREADABLE_IMAGE, ref.label, exc.strerror or type(exc).__name__) from None
    with fp:
        return _probe_image(fp, ref.label, apply_exif_orientation)


def _probe_image(fp: BinaryIO, label: str, apply_exif_orientation: bool) -> tuple[int, int]:
    head = fp.read(16)
    fp.seek(0)
    if not head:
        raise MediaError(UNREADABLE_IMAGE, label, "empty file")
    try:
        image = Image.open(fp)
        size = image.size
    except Image.DecompressionBombError as exc:
        raise MediaError(IMAGE_TOO_LARGE, label, str(exc).split(" could be")[0]) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        reason = TRUNCATED_IMAGE if _has_image_signature(head) else UNREADABLE_IMAGE
        raise MediaError(reason, label, first_line(exc)) from None
    if size[0] <= 0 or size[1] <= 0:
        raise MediaError(UNREADABLE_IMAGE, label, f"size {size}")
    if _end_marker_present(fp, image.format) is False:
        # Cheap check failed: decide by decoding once (rare: broken or padded files only).
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise MediaError(TRUNCATED_IMAGE, label, first_line(exc)) from None
    if apply_exif_orientation and _exif_orientation(image) in (5, 6, 7, 8):
        return size[1], size[0]
    return size


def _exif_orientation(image: Image.Image) -> int:
    """EXIF orientation tag (1-8; 1 when absent), from header data only: no pixel decoding."""
    try:
        if image.format == "PNG":  # PngImageFile.getexif() would decode to reach a late eXIf
            raw = image.info.get("exif")
            if not raw:
                return 1
            exif = Image.Exif()
            exif.load(raw)
        else:
            exif = image.getexif()
        return int(exif.get(0x0112, 1))
    except (OSError, SyntaxError, ValueError, TypeError, KeyError, EOFError):
        return 1  # an unreadable EXIF block: PIL's exif_transpose would not rotate either


def _has_image_signature(head: bytes) -> bool:
    """Whether the first bytes start like a known image format (a failure then means a cut file)."""
    is_webp = head.startswith(b"RIFF") and head[8:12] == b"WEBP"
    return is_webp or head.startswith(_SIGNATURES)


def _end_marker_present(fp: BinaryIO, image_format: str | None) -> bool | None:
    """Whether the file ends like a complete file of its format; None: format has no end marker."""
    file_size = fp.seek(0, os.SEEK_END)
    if image_format == "WEBP":
        fp.seek(4)
        riff_payload = int.from_bytes(fp.read(4), "little")
        return file_size >= riff_payload + 8
    end_markers = {
        "JPEG": b"\xff\xd9",
        "MPO": b"\xff\xd9",
        "PNG": b"IEND\xaeB`\x82",
        "GIF": b";",
    }
    marker = end_markers.get(image_format or "")
    if marker is None:
        return None
    fp.seek(max(0, file_size - _TAIL_BYTES))
    tail = fp.read(_TAIL_BYTES).rstrip(_TAIL_PADDING)
    return tail.endswith(marker)


def video_meta(path: str | os.PathLike, *, check_complete: bool = False) -> VideoMeta:
    """Frame count, frame rate, duration and size of a video's first video stream, from metadata.

    check_complete: also check, without decoding, that the file holds every frame the header
        counts (module docstring); a file cut short raises MediaError(truncated_video).
    Raises MediaError with reason missing_file, unreadable_video, no_video_stream or
    truncated_video.
    """
    label = str(path)
    if not os.path.exists(path):
        raise MediaError(MISSING_FILE, label)
    try:
        container = av.open(os.fspath(path))
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise MediaError(UNREADABLE_VIDEO, label, first_line(exc)) from None
    with container:
        if not container.streams.video:
            raise MediaError(NO_VIDEO_STREAM, label)
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else 0.0
        if stream.duration is not None and stream.time_base is not None:
            duration_s = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            duration_s = container.duration / av.time_base
        else:
            duration_s = 0.0
        n_frames = int(stream.frames) if stream.frames else round(duration_s * fps)
        if duration_s <= 0 and fps > 0:
            duration_s = n_frames / fps
        width, height = stream.codec_context.width, stream.codec_context.height
        if n_frames <= 0 or width <= 0 or height <= 0:
            raise MediaError(
                UNREADABLE_VIDEO, label, f"no frame count or size ({n_frames} frames, {width}x{height})"
            )
        if check_complete:
            missing = _missing_frames(container, stream, n_frames, os.path.getsize(path))
            if missing:
                raise MediaError(TRUNCATED_VIDEO, label, missing)
    return VideoMeta(n_frames=n_frames, fps=fps, duration_s=duration_s, width=width, height=height)


def _missing_frames(container, stream, n_frames: int, file_size: int) -> str | None:
    """Why the file cannot hold the `n_frames` frames its header counts (None when it can).

    MP4/MOV with a sample table: the table gives each frame's byte range and the file must reach
    the end of every one; nothing beyond the header is read. Frame counts are not compared there:
    an edit list that hides the first frames (a trimmed copy) can take them out of the demuxer's
    index and packets altogether. Other containers (Matroska, AVI, fragmented MP4) have no such
    table: their packets are demuxed, not decoded, and the whole ones (not cut by the end of the
    file) are counted against the header.
    """
    if stream.frames and "mp4" in container.format.name.split(","):
        ends = [entry.pos + entry.size for entry in stream.index_entries]
        cut = sum(1 for end in ends if end > file_size)
        if not cut:
            return None
        return f"the file ends at byte {file_size} but its index puts frames up to byte {max(ends)} ({cut} cut off)"
    whole, error = 0, ""
    try:
        for packet in container.demux(stream):
            whole += packet.size > 0 and not packet.is_corrupt
    except (av.FFmpegError, OSError, ValueError) as exc:  # what came before it is what a decoder gets
        error = f" before an error ({first_line(exc)})"
    if whole >= n_frames:
        return None
    return f"the header says {n_frames} frames but the file holds {whole} whole ones{error}"
