"""Real broken input for the error-path tests: Parquet files with a corrupt data page, videos cut short.

Each helper breaks a file the way it breaks in the field (bytes flipped inside a page, a copy that
stopped part-way) and returns what an independent reader sees, so tests can check that the break
is real before checking how dflop reports it.
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
TURN = pa.struct([("from", pa.string()), ("value", pa.string())])
IMAGE_CONV = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "Noise."}]
VIDEO_CONV = [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "Noise."}]


def png_bytes(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def write_image_parquet(path: Path, n_rows: int = 40, row_group_size: int = 10, **write_args) -> Path:
    """A LLaVA-OneVision-style Parquet file: id, embedded PNG image, conversations.

    No dictionary encoding and no compression: each row group's image data page holds the PNG
    bytes themselves, so a flipped byte there changes an image unless a page checksum catches it.
    """
    table = pa.table({
        "id": [f"row{i}" for i in range(n_rows)],
        "image": pa.array([{"bytes": png_bytes(32, 24, i), "path": f"{i}.png"} for i in range(n_rows)],
                          type=IMAGE_STRUCT),
        "conversations": pa.array([IMAGE_CONV] * n_rows, type=pa.list_(TURN)),
    })
    pq.write_table(table, path, row_group_size=row_group_size, use_dictionary=False, compression="none",
                   **write_args)
    return path


def corrupt_image_page(path: Path, row_group: int, where: str) -> tuple[int, int]:
    """Flip 8 bytes of the image-bytes data page of one row group, in place.

    where: "header" (the page's Thrift header, at the page's first byte) or "payload" (the middle
    of the page, inside a PNG). Returns the (start, end) byte range of that column chunk.
    """
    column = _column_chunk(pq.ParquetFile(path).metadata.row_group(row_group), "image.bytes")
    assert column.dictionary_page_offset is None, "the page must hold the values, not dictionary ids"
    start, end = column.data_page_offset, column.data_page_offset + column.total_compressed_size
    at = start + 2 if where == "header" else (start + end) // 2
    data = bytearray(path.read_bytes())
    data[at:at + 8] = bytes(b ^ 0xFF for b in data[at:at + 8])
    path.write_bytes(bytes(data))
    return start, end


def _column_chunk(row_group, dotted_path: str):
    for j in range(row_group.num_columns):
        if row_group.column(j).path_in_schema == dotted_path:
            return row_group.column(j)
    raise KeyError(dotted_path)


def write_video(path: Path, *, codec: str = "mpeg4", n_frames: int = 23, rate: Fraction = Fraction(12),
                fmt: str | None = None, faststart: bool = True) -> Path:
    """A video of random frames (every frame costs bytes). faststart: an MP4 with its index (moov)
    before the frames, so that cutting the file keeps the header, as a partial download does."""
    options = {"movflags": "faststart"} if faststart and path.suffix in (".mp4", ".mov") else {}
    rng = np.random.default_rng(n_frames)
    with av.open(str(path), "w", format=fmt, options=options) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for _ in range(n_frames):
            frame = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def packet_ranges(path: Path) -> list[tuple[int, int]]:
    """(byte offset, size) of each video packet in file order, as the demuxer reads them."""
    with av.open(str(path)) as container:
        return [(p.pos, p.size) for p in container.demux(video=0) if p.size]


def cut_file(path: Path, out: Path, length: int) -> Path:
    """The first `length` bytes of `path` (a transfer that stopped part-way)."""
    out.write_bytes(path.read_bytes()[:length])
    return out


def header_frames(path: Path) -> int:
    with av.open(str(path)) as container:
        return container.streams.video[0].frames


def decodable_frames(path: Path) -> int:
    """Frames a decoder delivers before the data runs out or breaks (what a training loader gets)."""
    count = 0
    try:
        with av.open(str(path)) as container:
            for _ in container.decode(video=0):
                count += 1
    except av.FFmpegError:
        pass
    return count
