"""Streaming readers for instruction datasets: LLaVA JSON, JSONL and Parquet with embedded images.

Every reader yields `RawSample` records one at a time, so a million-sample dataset never sits in
memory (the only per-sample state kept is the ids seen, to keep ids unique). Bad samples
never raise: they come out with `error` set to a short reason (``malformed_json``,
``not_an_object``, ``no_conversations``, ``bad_conversations``, ``unknown_modality:<key>``,
``bad_image_field``, ``bad_video_field``, ``multiple_videos``, ``media_outside_root``) that the
data profiler writes as ``status=skipped:<reason>``. File-level problems (missing file, unknown
format, a JSON list that stops parsing, an unreadable Parquet file or page) raise `DatasetError`, a
one-line `UserError` naming the file. Parquet pages are checked against their CRC where the writer stored one
(``write_page_checksum``), so a corrupt byte there is an error, not a silently wrong value.

Sample ids are stable across runs: the record's ``id`` when it has one not used by an earlier
record of the same dataset, else ``<dataset>:<index>`` (index = 0-based position of the record in
the dataset, over all files of a Parquet directory in name order). Ids are unique within a
dataset; (dataset, sample_id) is unique across datasets. A repeated id is renamed, not refused or
dropped: instruction sets often key records by their image, several conversations to one image, and
each conversation is a sample to keep. The renamed sample says so (`RawSample.id_note`) and the
data profiler reports it. The profiler and the trainer read through
`read_spec`, so both give every record the same id.

Media paths (`media_path`): a path is read only where it resolves, symlinks followed, inside the
dataset's media root; an absolute path outside it only when the dataset sets
``allow_absolute_paths``. Any other path makes the sample ``media_outside_root`` (skipped, like an
unreadable image), so a manifest cannot make a stage open ``../../etc/passwd`` as an image.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from dflop.config import DatasetSpec
from dflop.data.media import EmbeddedSource, ImageRef, VideoRef
from dflop.data.sampling import parse_sampling_rule, sample_stream
from dflop.errors import UserError, first_line

FORMATS = ("llava_json", "llava_jsonl", "parquet")

# Record keys that carry media this stack cannot feed to the model.
UNSUPPORTED_MODALITY_KEYS = ("audio", "audios", "speech", "sound", "point_cloud", "pointcloud")

_PARQUET_COLUMNS = ("id", "image", "images", "video", "conversations", *UNSUPPORTED_MODALITY_KEYS)


class DatasetError(UserError, ValueError):
    """A dataset that cannot be read at all (not one bad sample); one line naming the file.

    A `UserError`, so the CLI reports it without a traceback wherever it surfaces (while checking
    datasets, or mid-stream at a corrupt page).
    """


@dataclass(frozen=True)
class RawSample:
    """One sample as read, before any shape computation.

    images: in placeholder order; file paths are already resolved against the media root.
    conversations: turns as {"from": str, "value": str}; None when `error` is set.
    error: None for a usable sample, else the short skip reason (see module docstring).
    index: 0-based position of the record in its dataset.
    error_detail: what exactly was wrong, for the profiler's report (only some reasons have one).
    id_note: why the record's own id was not used (an earlier record has it), else None.
    """

    sample_id: str
    dataset: str
    index: int
    images: tuple[ImageRef, ...] = ()
    video: VideoRef | None = None
    conversations: tuple[dict[str, str], ...] | None = None
    error: str | None = None
    error_detail: str | None = None
    id_note: str | None = None

    @property
    def modality(self) -> str:
        """'video', 'multi_image', 'image' or 'text' (a video wins over images)."""
        if self.video is not None:
            return "video"
        if len(self.images) > 1:
            return "multi_image"
        return "image" if self.images else "text"


def check_dataset(path: str | os.PathLike, fmt: str = "auto") -> str:
    """Check that a dataset exists and can be opened; return its format (one of FORMATS).

    Cheap (reads at most Parquet footers), so a profiler can check every dataset before work.
    Raises DatasetError naming the path.
    """
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {path}: no such file or directory")
    if fmt == "auto":
        fmt = _detect_format(path)
    elif fmt not in FORMATS:
        raise DatasetError(
            f"dataset {path}: unknown format {fmt!r}; expected auto or one of {FORMATS}"
        )
    if fmt == "parquet":
        for part in _parquet_parts(path):
            _open_parquet(part)
    elif path.is_dir():
        raise DatasetError(f"dataset {path}: is a directory; format {fmt} needs a file")
    else:
        try:
            open(path, "rb").close()
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise DatasetError(f"dataset {path}: cannot be read ({reason})") from None
    return fmt


def count_records(path: str | os.PathLike, fmt: str = "auto") -> int | None:
    """Number of records when known without reading them (Parquet metadata), else None."""
    fmt = check_dataset(path, fmt)
    if fmt != "parquet":
        return None
    return sum(_open_parquet(part).metadata.num_rows for part in _parquet_parts(Path(path)))


def iter_raw_samples(
    path: str | os.PathLike,
    *,
    dataset: str | None = None,
    fmt: str = "auto",
    media_root: str | os.PathLike | None = None,
    allow_absolute_paths: bool = False,
) -> Iterator[RawSample]:
    """Every record of a dataset as a RawSample, in file order, streamed.

    dataset: name used in fallback ids (default: file stem, or the directory name).
    media_root: base of relative media paths, and where every media file must be (default: the
        manifest's directory, or the Parquet directory itself).
    allow_absolute_paths: read absolute media paths outside media_root too (`media_path`).
    Raises DatasetError at call time if the dataset is missing or its format unknown.
    """
    path = Path(path)
    fmt = check_dataset(path, fmt)
    name = _dataset_name(path, dataset)
    root = Path(media_root) if media_root is not None else (path if path.is_dir() else path.parent)
    if fmt == "llava_json":
        records = iter_json_array(path)
    elif fmt == "llava_jsonl":
        records = _jsonl_records(path)
    else:
        records = _parquet_records(path)
    return _to_samples(records, dataset=name, media=MediaRule(root, allow_absolute_paths))


def read_dataset(
    path: str | os.PathLike,
    *,
    dataset: str | None = None,
    fmt: str = "auto",
    media_root: str | os.PathLike | None = None,
    allow_absolute_paths: bool = False,
    sample: str = "all",
    seed: int = 0,
) -> Iterator[RawSample]:
    """The samples a sampling rule selects (see dflop.data.sampling), in file order, streamed.

    Error records take part in sampling like any other, so skipped samples are reported for the
    sampled subset. Raises DatasetError / SamplingRuleError at call time.
    """
    rule = parse_sampling_rule(sample)
    samples = iter_raw_samples(path, dataset=dataset, fmt=fmt, media_root=media_root,
                               allow_absolute_paths=allow_absolute_paths)
    total = count_records(path, fmt) if rule.kind == "random" else None
    return sample_stream(
        samples,
        rule,
        seed=seed,
        stream_name=_dataset_name(Path(path), dataset),
        key=lambda s: s.sample_id,
        total=total,
    )


def read_spec(spec: DatasetSpec, seed: int) -> Iterator[RawSample]:
    """The samples of one ``data.datasets`` entry; the data profiler and the trainer both read
    through here, so a sample has the same id and the same media rule in each."""
    return read_dataset(spec.path, dataset=spec.name, fmt=spec.format, media_root=spec.media_root,
                        allow_absolute_paths=spec.allow_absolute_paths, sample=spec.sample, seed=seed)


def _dataset_name(path: Path, dataset: str | None) -> str:
    return dataset or (path.name if path.is_dir() else path.stem)


# --- file formats -----------------------------------------------------------------------------

# A record as read from a file: the parsed JSON value, or _MALFORMED for a line that did not parse.
_MALFORMED = object()


def _detect_format(path: Path) -> str:
    if path.is_dir():
        return "parquet"
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix in (".jsonl", ".ndjson"):
        return "llava_jsonl"
    if suffix == ".json":
        # Some '.json' files are really JSON Lines; their first value is an object, not a list.
        return "llava_jsonl" if _first_char(path) == "{" else "llava_json"
    raise DatasetError(
        f"dataset {path}: cannot tell the format from the extension {suffix!r};"
        f" name a format ({', '.join(FORMATS)})"
    )


def _first_char(path: Path) -> str:
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        while chunk := f.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[0]
    return ""


def iter_json_array(
    path: str | os.PathLike, *, chunk_chars: int = 1 << 20, max_record_chars: int = 256 << 20
) -> Iterator[Any]:
    """The elements of a JSON file holding one list, parsed incrementally, one at a time.

    Memory is one read chunk plus the largest element. Raises DatasetError naming the file and
    the character offset when the file is not a JSON list or stops parsing (after a corrupt
    element the following ones cannot be found reliably, so the file as a whole is rejected).
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8-sig") as f:
        buf, pos, offset, eof = "", 0, 0, False

        def read_more(min_chars: int) -> None:
            nonlocal buf, pos, offset, eof
            if pos > 0:  # drop what was consumed so the buffer holds one element at most
                offset += pos
                buf, pos = buf[pos:], 0
            try:
                chunk = f.read(max(chunk_chars, min_chars))
            except UnicodeDecodeError:
                raise DatasetError(
                    f"dataset {path}: not UTF-8 text after character {offset + len(buf)}"
                ) from None
            eof = not chunk
            buf += chunk

        def next_char() -> str:
            """Skip whitespace; the next character without consuming it, '' at end of file."""
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf) or eof:
                    return buf[pos] if pos < len(buf) else ""
                read_more(0)

        def fail(at: int, what: str) -> DatasetError:
            return DatasetError(
                f"dataset {path}: malformed JSON at character {offset + at}: {what}"
            )

        if next_char() != "[":
            raise DatasetError(f"dataset {path}: expected a JSON list of samples ('[' first)")
        pos += 1
        expect_value = True  # after '[' or ',' a value is due; ']' allowed only right after '['
        first = True
        while True:
            char = next_char()
            if char == "]" and first:
                pos += 1
                break
            if char == "":
                raise fail(pos, "unexpected end of file")
            if not expect_value:
                if char == "]":
                    pos += 1
                    break
                if char != ",":
                    raise fail(pos, f"expected ',' or ']' between samples, found {char!r}")
                pos += 1
                expect_value = True
                continue
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as exc:
                incomplete = exc.pos >= len(buf) - 16 or exc.msg.startswith("Unterminated string")
                if incomplete and not eof:
                    if len(buf) - pos > max_record_chars:
                        too_long = f"a sample longer than {max_record_chars} characters"
                        raise fail(pos, too_long) from None
                    read_more(2 * (len(buf) - pos))
                    continue
                raise fail(exc.pos, exc.msg) from None
            if end == len(buf) and not eof:
                read_more(2 * (len(buf) - pos))  # a number at the buffer's end may go on
                continue
            pos = end
            expect_value = first = False
            yield value
        if next_char() != "":
            raise fail(pos, "data after the closing ']'")


def _jsonl_records(path: Path) -> Iterator[Any]:
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                yield _MALFORMED


def _parquet_parts(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    parts = sorted(p for p in path.glob("*.parquet") if p.is_file())
    if not parts:
        raise DatasetError(f"dataset {path}: directory holds no .parquet files")
    return parts


def _open_parquet(part: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(part, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"dataset {part}: unreadable Parquet file ({first_line(exc)})") from None


def _parquet_records(path: Path, batch_rows: int = 256) -> Iterator[Any]:
    """Rows as dicts, one batch of `batch_rows` rows in memory at a time (images included).

    Each row also carries its (file, row) under `_SOURCE_KEY`, so embedded images can be found
    again later without keeping their bytes (`embedded_image_bytes`).
    """
    for part in _parquet_parts(path):
        parquet_file = _open_parquet(part)
        columns = [c for c in parquet_file.schema_arrow.names if c in _PARQUET_COLUMNS]
        row = 0
        try:
            for batch in parquet_file.iter_batches(batch_size=batch_rows, columns=columns):
                for record in batch.to_pylist():
                    record[_SOURCE_KEY] = (part, row)
                    row += 1
                    yield record
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"dataset {part}: unreadable Parquet data after {row} readable rows "
                               f"({first_line(exc)})") from None


_SOURCE_KEY = "\0dflop_source"  # cannot clash with a Parquet column name used as a record key


@functools.lru_cache(maxsize=2)
def _row_group_column(file: Path, row_group: int, column: str) -> pa.ChunkedArray:
    """One column of one row group (the unit Parquet reads); the last two stay cached per process,
    so neighbouring images cost one read."""
    return _open_parquet(file).read_row_group(row_group, columns=[column]).column(column)


@functools.lru_cache(maxsize=64)
def _row_group_starts(file: Path) -> tuple[int, ...]:
    metadata = _open_parquet(file).metadata
    starts, total = [], 0
    for i in range(metadata.num_row_groups):
        starts.append(total)
        total += metadata.row_group(i).num_rows
    return tuple(starts) + (total,)


def embedded_image_bytes(source: EmbeddedSource) -> bytes:
    """The bytes of an embedded image, read back from its Parquet file (see `ImageRef.without_bytes`).

    Raises DatasetError naming the file and row when the file changed since it was read.
    """
    where = f"dataset {source.file} row {source.row}"
    try:
        starts = _row_group_starts(source.file)
        group = bisect.bisect_right(starts, source.row) - 1
        if not 0 <= source.row < starts[-1]:
            raise DatasetError(f"{where}: the file has only {starts[-1]} rows (changed since profile_data?)")
        value = _row_group_column(source.file, group, source.column)[source.row - starts[group]].as_py()
    except (pa.ArrowException, OSError, KeyError) as exc:
        raise DatasetError(f"{where}: cannot read column {source.column!r} ({first_line(exc)})") from None
    if source.item is not None:
        value = value[source.item] if isinstance(value, list) and source.item < len(value) else None
    data = value.get("bytes") if isinstance(value, dict) else None
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise DatasetError(f"{where}: no image bytes in column {source.column!r} (changed since profile_data?)")
    return bytes(data)


# --- records to samples -----------------------------------------------------------------------


class _BadSample(Exception):
    def __init__(self, reason: str, detail: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class MediaRule:
    """Where one dataset's media may be (`media_path`)."""

    root: Path
    allow_absolute: bool = False

    @functools.cached_property
    def real_root(self) -> str:
        """The root with symlinks followed, what a media file's real path must start with."""
        return _real_path(str(self.root)).rstrip(os.sep) + os.sep


MEDIA_OUTSIDE_ROOT = "media_outside_root"


def _to_samples(records: Iterable[Any], *, dataset: str, media: MediaRule) -> Iterator[RawSample]:
    seen_ids: dict[str, int] = {}  # id -> index of the record that has it
    for index, record in enumerate(records):
        sample_id, id_note = _sample_id(record, index, dataset, seen_ids)
        seen_ids[sample_id] = index
        try:
            images, video, conversations = _parse_record(record, media)
        except _BadSample as bad:
            yield RawSample(sample_id=sample_id, dataset=dataset, index=index, error=bad.reason,
                            error_detail=bad.detail, id_note=id_note)
            continue
        yield RawSample(
            sample_id=sample_id,
            dataset=dataset,
            index=index,
            images=images,
            video=video,
            conversations=conversations,
            id_note=id_note,
        )


def _sample_id(record: Any, index: int, dataset: str, seen_ids: Mapping[str, int]) -> tuple[str, str | None]:
    """(the record's id, why its own id was not used or None); the id rule of the module docstring."""
    raw = record.get("id") if isinstance(record, dict) else None
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raw = None
    candidate = str(raw).strip() if raw is not None else ""
    if candidate and candidate not in seen_ids:
        return candidate, None
    note = f"id {candidate!r} repeats record {seen_ids[candidate]}'s" if candidate else None
    fallback = f"{dataset}:{index}"
    # Only if an earlier record's own id happened to look like a fallback id.
    suffix = 1
    while fallback in seen_ids:
        fallback, suffix = f"{dataset}:{index}:{suffix}", suffix + 1
    return fallback, note


def _parse_record(
    record: Any, media: MediaRule
) -> tuple[tuple[ImageRef, ...], VideoRef | None, tuple[dict[str, str], ...]]:
    if record is _MALFORMED:
        raise _BadSample("malformed_json")
    if not isinstance(record, dict):
        raise _BadSample("not_an_object")
    for key in UNSUPPORTED_MODALITY_KEYS:
        if record.get(key) not in (None, "", [], {}):
            raise _BadSample(f"unknown_modality:{key}")
    conversations = _conversations(record.get("conversations"))
    column = "image" if record.get("image") is not None else "images"
    images = _image_refs(record.get(column), media, record.get(_SOURCE_KEY), column)
    video = _video_ref(record.get("video"), media)
    return images, video, conversations


def _conversations(value: Any) -> tuple[dict[str, str], ...]:
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        raise _BadSample("no_conversations")
    if not isinstance(value, (list, tuple)):
        raise _BadSample("bad_conversations")
    turns = []
    for turn in value:
        if not (
            isinstance(turn, dict)
            and isinstance(turn.get("from"), str)
            and isinstance(turn.get("value"), str)
        ):
            raise _BadSample("bad_conversations")
        turns.append({"from": turn["from"], "value": turn["value"]})
    return tuple(turns)


def _image_refs(value: Any, media: MediaRule, row: tuple[Path, int] | None = None,
                column: str = "image") -> tuple[ImageRef, ...]:
    """`row`: (Parquet file, row) of the record, for embedded images' `EmbeddedSource`."""
    if value is None:
        return ()
    items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
    return tuple(_image_ref(item, media, row and EmbeddedSource(*row, column, k)) for k, item in items)


def _image_ref(item: Any, media: MediaRule, source: EmbeddedSource | None = None) -> ImageRef:
    if isinstance(item, str) and item.strip():
        return ImageRef(path=media_path(item, media))
    if isinstance(item, dict):  # Hugging Face Image feature: {"bytes": ..., "path": ...}
        data, name = item.get("bytes"), item.get("path")
        if isinstance(data, (bytes, bytearray)) and data:
            return ImageRef(data=bytes(data), name=name if isinstance(name, str) else None, source=source)
        if isinstance(name, str) and name.strip():
            return ImageRef(path=media_path(name, media))
    raise _BadSample("bad_image_field")


def _video_ref(value: Any, media: MediaRule) -> VideoRef | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not value:
            return None
        if len(value) > 1:
            raise _BadSample("multiple_videos")
        value = value[0]
    if isinstance(value, str) and value.strip():
        return VideoRef(path=media_path(value, media))
    raise _BadSample("bad_video_field")


def media_path(value: str, media: MediaRule) -> Path:
    """The file a manifest's media path names: relative paths resolve against the media root.

    The one media-path rule (module docstring): the file must be inside the media root once
    symlinks are followed, or, for an absolute path, the dataset must allow absolute paths.
    Otherwise `_BadSample` ``media_outside_root``, with the path and where it leads as detail.
    The path is returned as written (joined to the root), not resolved, so reports name it as the
    manifest does.
    """
    path = Path(value)
    if path.is_absolute() and media.allow_absolute:
        return path
    joined = path if path.is_absolute() else media.root / path
    real = _real_path(str(joined))
    if real.startswith(media.real_root) or real + os.sep == media.real_root:
        return joined
    hint = "; absolute paths outside it need allow_absolute_paths: true" if path.is_absolute() else ""
    raise _BadSample(MEDIA_OUTSIDE_ROOT, f"{value} leads to {real}, outside media_root {media.root}{hint}")


def _real_path(path: str) -> str:
    """`os.path.realpath(path)` through the cached real path of its directory: one lstat a file,
    where resolving every component costs ~60 us a file (and each rank reads every manifest)."""
    directory, name = os.path.split(path)
    if name in ("", ".", ".."):
        return os.path.realpath(path)
    full = os.path.join(_real_dir(directory if os.path.isabs(directory) else os.path.join(os.getcwd(), directory)),
                        name)
    return os.path.realpath(full) if os.path.islink(full) else full


@functools.lru_cache(maxsize=4096)
def _real_dir(directory: str) -> str:
    """`os.path.realpath` of an absolute directory path, cached: a dataset's files share a few."""
    return os.path.realpath(directory)
