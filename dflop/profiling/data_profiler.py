"""Data profiler: the shape of every sample (tiles, vision and text tokens) from file headers.

Reads each dataset of the config as a stream, sizes images from their headers and videos from
their container metadata (no pixel decoding; a video whose file stops short of the frames its
header counts is skipped as ``truncated_video``), turns sizes into encoder tiles and LLM tokens
with the architecture's rules (dflop.data.vision_tokens) and counts text tokens with the model's
tokenizer and chat template. Writes ``shapes.parquet`` (one row per sample, docs/design.md) and
``histograms.parquet``, both atomically and only when the whole stage succeeds: a dataset that
cannot be read (a corrupt Parquet page), a bad setting or too many skipped samples raise a
one-line UserError and leave neither file. Work is spread over a process pool in chunks, in order,
so the output is the same whatever the worker count.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dflop.config import Config
from dflop.data.media import MediaError, image_size, video_meta
from dflop.data.readers import DatasetError, RawSample, check_dataset, count_records, read_spec
from dflop.data.sampling import SamplingRuleError, parse_sampling_rule
from dflop.data.tokenizer import count_text_tokens_batch, expand_video_placeholders, load_tokenizer
from dflop.data.vision_tokens import NO_VISION, sample_vision_shape, sampled_frame_count
from dflop.errors import UserError
from dflop.io import atomic_path
from dflop.models.presets import tower_arch_params
from dflop.progress import progress as progress_counter
from dflop.shapes import SHAPES_SCHEMA

HISTOGRAM_FEATURES = ("n_images", "n_frames", "n_tiles", "vision_tokens", "text_tokens", "seq_len")
HISTOGRAM_COLUMNS = ("dataset", "modality", "feature", "bin_lo", "bin_hi", "count", "frac")
ALL = "all"  # the dataset / modality value of histogram rows that pool every dataset / modality

CHUNK_SAMPLES = 256


@dataclass(frozen=True)
class ShapeRules:
    """What turns a raw sample into a shape row; small and picklable, sent to every worker."""

    arch: str
    arch_params: Mapping[str, Any]
    tokenizer: str


@dataclass
class ProfileSummary:
    """Counts the profiler prints and checks against data.max_skip_frac."""

    total: int = 0
    by_modality: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    # First few skipped samples with their detail, for the log and the error message.
    skipped_examples: list[str] = field(default_factory=list)
    # Records whose own id an earlier record of their dataset has (they take <dataset>:<index>).
    renamed_ids: int = 0
    renamed_examples: list[str] = field(default_factory=list)

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())


# --- per-sample shape ------------------------------------------------------------------------

_worker_tokenizer = None


def _init_worker(tokenizer_name: str) -> None:
    global _worker_tokenizer
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_tokenizer = load_tokenizer(tokenizer_name)


def _skipped_row(sample: RawSample, reason: str) -> dict:
    return {
        "sample_id": sample.sample_id,
        "dataset": sample.dataset,
        "modality": sample.modality if sample.error is None else "text",
        "n_images": len(sample.images),
        "n_frames": 0,
        "n_tiles": 0,
        "vision_tokens": 0,
        "text_tokens": 0,
        "seq_len": 0,
        "media_pixels": 0,
        "status": f"skipped:{reason}",
    }


def placeholder_problem(sample: RawSample) -> str | None:
    """Why the sample's placeholders do not match its media (None when they do).

    The processors replace each ``<image>`` with one image's tokens and ``<video>`` with the
    video's, so the counts must agree. LLaVA-Video data often marks its video with ``<image>``;
    a single such placeholder is accepted for a video sample.
    """
    text = "".join(turn.get("value", "") for turn in sample.conversations or ())
    n_image, n_video = text.count("<image>"), text.count("<video>")
    if sample.video is not None and not sample.images:
        if (n_video, n_image) in ((1, 0), (0, 1)):
            return None
        return f"{n_video} <video> and {n_image} <image> placeholders for 1 video"
    if n_video or n_image != len(sample.images):
        return f"{n_image} <image> and {n_video} <video> placeholders for {len(sample.images)} images"
    return None


def _vision_row(sample: RawSample, rules: ShapeRules) -> tuple[dict | None, str | None]:
    """Shape fields from media headers; (None, 'reason: detail') when the sample is unusable."""
    mismatch = placeholder_problem(sample)
    if mismatch is not None:
        return None, f"placeholder_mismatch: {mismatch}"
    try:
        sizes = [image_size(ref) for ref in sample.images]
        video = video_meta(sample.video.path, check_complete=True) if sample.video is not None else None
        video_frames = [video.n_frames] if video is not None else []
    except MediaError as exc:
        return None, f"{exc.reason}: {exc}"
    if not sizes and not video_frames:
        shape, n_frames = NO_VISION, 0
    else:
        shape = sample_vision_shape(rules.arch, sizes, video_frames, **rules.arch_params)
        per_video = rules.arch_params.get("video_frames")
        n_frames = sum(sampled_frame_count(n, per_video) for n in video_frames) if per_video else 0
    return {
        "sample_id": sample.sample_id,
        "dataset": sample.dataset,
        "modality": sample.modality,
        "n_images": len(sample.images),
        "n_frames": n_frames,
        "n_tiles": shape.n_tiles,
        "vision_tokens": shape.vision_tokens,
        "media_pixels": sum(w * h for w, h in sizes) + (video.n_frames * video.width * video.height if video else 0),
        "status": "ok",
    }, None


def shape_rows(samples: Sequence[RawSample], rules: ShapeRules, tokenizer=None) -> list[tuple[dict, str | None]]:
    """Shape rows of a chunk of samples, each with the skip detail (None when ok).

    Text tokens are counted in one batched tokenizer call for the chunk.
    """
    tokenizer = tokenizer if tokenizer is not None else _worker_tokenizer
    out: list[tuple[dict, str | None]] = []
    pending: list[int] = []
    for sample in samples:
        if sample.error is not None:
            out.append((_skipped_row(sample, sample.error), sample.error_detail))
            continue
        row, problem = _vision_row(sample, rules)
        if row is None:
            reason, _, detail = problem.partition(": ")
            out.append((_skipped_row(sample, reason), detail))
            continue
        out.append((row, None))
        pending.append(len(out) - 1)
    if pending:
        # InternVL writes a "FrameK: " label before each video frame: text tokens of their own.
        conversations = [
            _internvl_video_conversation(samples[i], out[i][0]["n_frames"])
            if rules.arch == "internvl" and samples[i].video else samples[i].conversations
            for i in pending
        ]
        counts = count_text_tokens_batch(tokenizer, conversations)
        for i, n_text in zip(pending, counts):
            row = out[i][0]
            row["text_tokens"] = int(n_text)
            row["seq_len"] = int(n_text) + row["vision_tokens"]
    return out


def _internvl_video_conversation(sample: RawSample, n_frames: int) -> list[dict]:
    """The video sample's turns as InternVLProcessor lays them out ("Frame1: <video>\\n...")."""
    turns = sample.conversations
    if not any("<video>" in turn.get("value", "") for turn in turns):
        # LLaVA-Video style data marks the video with <image> (accepted by placeholder_problem).
        turns = [{**turn, "value": turn.get("value", "").replace("<image>", "<video>")} for turn in turns]
    return expand_video_placeholders(turns, [n_frames], arch="internvl")


def _shape_chunk(args: tuple[list[RawSample], ShapeRules]) -> list[tuple[dict, str | None]]:
    samples, rules = args
    return shape_rows(samples, rules)


# --- the stage -------------------------------------------------------------------------------


def _chunks(items: Iterable[RawSample], size: int) -> Iterator[list[RawSample]]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def _all_samples(cfg: Config, summary: ProfileSummary) -> Iterator[RawSample]:
    """Every sample of the config's datasets; notes renamed duplicate ids in `summary`."""
    for i, ds in enumerate(cfg.datasets):
        try:
            for sample in read_spec(ds, cfg.seed):
                if sample.id_note is not None:
                    summary.renamed_ids += 1
                    if len(summary.renamed_examples) < 10:
                        summary.renamed_examples.append(
                            f"{sample.dataset}/{sample.sample_id}: record {sample.index}'s {sample.id_note}")
                yield sample
        except DatasetError as exc:  # found mid-stream (a corrupt Parquet page): the whole stage fails
            raise UserError(f"data.datasets[{i}] ({ds.name}): {exc}") from None


def check_datasets(cfg: Config, *, pending: Container[Path] = ()) -> None:
    """Fail before any work if a dataset is missing or unreadable or its sampling rule is invalid;
    the one-line UserError names the dataset key and its path.

    Cheap: opens each file, reads Parquet footers only. pending: dataset paths a workflow rule
    has yet to make (the demo manifest); their absence is fine.
    """
    for i, ds in enumerate(cfg.datasets):
        where = f"data.datasets[{i}] ({ds.name})"
        try:
            parse_sampling_rule(ds.sample)
        except SamplingRuleError as exc:
            raise UserError(f"{where}.sample: {exc}") from None
        if ds.path in pending and not ds.path.exists():
            continue
        try:
            check_dataset(ds.path, ds.format)
        except DatasetError as exc:
            raise UserError(f"{where}: {exc}") from None
        if ds.media_root is not None and not ds.media_root.is_dir():
            raise UserError(f"{where}: media_root {ds.media_root} is not a directory")


def _expected_total(cfg: Config) -> int | None:
    """Samples to expect, for the progress bar; None when unknown without reading the data."""
    total = 0
    for ds in cfg.datasets:
        kind, _, arg = ds.sample.partition(":")
        if kind in ("first", "random"):
            known = count_records(ds.path, ds.format)
            total += int(arg) if known is None else min(int(arg), known)
            continue
        known = count_records(ds.path, ds.format)
        if known is None:
            return None
        total += known if ds.sample == "all" else round(known * float(ds.sample.rstrip("%")) / 100)
    return total


def usable_cpus() -> int:
    """CPUs this process may run on: the Slurm/cgroup allocation where the OS reports it, not
    the whole node (Snakemake does not cap a rule's threads on Slurm)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def profile_data(
    cfg: Config,
    *,
    shapes_path: str | Path,
    histograms_path: str | Path,
    workers: int = 0,
    progress: bool = True,
) -> ProfileSummary:
    """Write shapes.parquet and histograms.parquet for the config's datasets; return the summary.

    workers: processes (0 = all cores; 1 = in this process). Raises UserError (and writes
    nothing) when a dataset is missing or unreadable, a setting is bad, or more than
    data.max_skip_frac of the samples are skipped.
    """
    check_datasets(cfg)
    rules = ShapeRules(
        arch=cfg.model.arch,
        arch_params=tower_arch_params(cfg.model.arch, cfg.model.vision, cfg.model.arch_params),
        tokenizer=cfg.model.tokenizer,
    )
    # Load the tokenizer here first, so a bad tokenizer setting fails once, with its own message.
    try:
        tokenizer = load_tokenizer(rules.tokenizer)
    except ValueError as exc:
        raise UserError(f"model.tokenizer: {exc}") from None
    usable = usable_cpus()
    if workers > usable:
        print(f"profile_data: {workers} workers asked, {usable} CPUs usable here; using {usable}", file=sys.stderr)
    workers = min(workers, usable) if workers else usable
    summary = ProfileSummary()
    started = time.perf_counter()
    shapes_path, histograms_path = Path(shapes_path), Path(histograms_path)

    with atomic_path(shapes_path) as tmp_shapes:
        writer = pq.ParquetWriter(tmp_shapes, SHAPES_SCHEMA)
        bar = progress_counter(_expected_total(cfg), "profile_data", "sample", enabled=progress)
        try:
            for rows in _shape_stream(_all_samples(cfg, summary), rules, tokenizer, workers):
                _account(summary, rows)
                writer.write_table(pa.Table.from_pylist([row for row, _ in rows], schema=SHAPES_SCHEMA))
                bar.update(len(rows))
        finally:
            writer.close()
            bar.close()
        elapsed = time.perf_counter() - started
        _check_skip_fraction(summary, cfg.data.max_skip_frac)
        shapes = pd.read_parquet(tmp_shapes)
        # Before shapes.parquet is renamed into place: a failure here leaves neither file.
        write_histograms(shapes, histograms_path)

    print(format_summary(summary, shapes, elapsed))
    return summary


def _shape_stream(samples: Iterable[RawSample], rules: ShapeRules, tokenizer, workers: int):
    chunks = _chunks(samples, CHUNK_SAMPLES)
    if workers <= 1:
        for chunk in chunks:
            yield shape_rows(chunk, rules, tokenizer)
        return
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(rules.tokenizer,)) as pool:
        # imap keeps chunk order, so the output does not depend on the worker count.
        yield from pool.imap(_shape_chunk, ((chunk, rules) for chunk in chunks), chunksize=1)


def _account(summary: ProfileSummary, rows: list[tuple[dict, str | None]]) -> None:
    for row, detail in rows:
        summary.total += 1
        if row["status"] == "ok":
            summary.by_modality[row["modality"]] += 1
            continue
        reason = row["status"].removeprefix("skipped:")
        summary.skipped[reason] += 1
        if len(summary.skipped_examples) < 10:
            where = f" ({detail})" if detail else ""
            summary.skipped_examples.append(f"{row['dataset']}/{row['sample_id']}: {reason}{where}")


def _check_skip_fraction(summary: ProfileSummary, max_skip_frac: float) -> None:
    if summary.total == 0:
        raise UserError("profile_data: the datasets yielded no samples (check data.datasets[*].sample)")
    frac = summary.skipped_total / summary.total
    if frac > max_skip_frac:
        reasons = ", ".join(f"{r}: {n}" for r, n in summary.skipped.most_common())
        first = summary.skipped_examples[0] if summary.skipped_examples else ""
        raise UserError(
            f"profile_data: {summary.skipped_total} of {summary.total} samples skipped ({frac:.1%}), more than "
            f"data.max_skip_frac={max_skip_frac:.1%} ({reasons}; first: {first})"
        )


# --- histograms and summary ------------------------------------------------------------------


def histogram_edges(values: np.ndarray) -> np.ndarray:
    """Bin edges: unit bins for small counts (tiles, images, frames), powers of two for tokens."""
    top = int(values.max()) if len(values) else 0
    if top <= 64:
        return np.arange(0, top + 2)
    return np.concatenate([[0, 1], 2.0 ** np.arange(1, math.ceil(math.log2(top + 1)) + 1)]).astype(np.int64)


def histograms(shapes: pd.DataFrame) -> pd.DataFrame:
    """Histogram rows of every feature per dataset and modality of the ok samples, plus 'all' pools."""
    ok = shapes[shapes["status"] == "ok"]
    rows = []
    groups: list[tuple[str, str, pd.DataFrame]] = [(ALL, ALL, ok)]
    for dataset, by_dataset in ok.groupby("dataset", sort=True):
        groups.append((dataset, ALL, by_dataset))
        groups.extend((dataset, modality, part) for modality, part in by_dataset.groupby("modality", sort=True))
    for feature in HISTOGRAM_FEATURES:
        edges = histogram_edges(ok[feature].to_numpy())
        for dataset, modality, part in groups:
            counts, _ = np.histogram(part[feature].to_numpy(), bins=edges)
            total = max(len(part), 1)
            for lo, hi, count in zip(edges[:-1], edges[1:], counts):
                rows.append((dataset, modality, feature, int(lo), int(hi), int(count), count / total))
    return pd.DataFrame(rows, columns=list(HISTOGRAM_COLUMNS))


def write_histograms(shapes: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        histograms(shapes).to_parquet(tmp, index=False)


def format_summary(summary: ProfileSummary, shapes: pd.DataFrame, elapsed_s: float) -> str:
    """The short report printed at the end of the stage."""
    ok = shapes[shapes["status"] == "ok"]
    lines = [f"profiled {summary.total} samples in {elapsed_s:.1f} s ({summary.total / max(elapsed_s, 1e-9):.0f} samples/s)"]
    lines.append("by modality: " + ", ".join(f"{m}={n}" for m, n in sorted(summary.by_modality.items())))
    for feature in ("n_tiles", "seq_len"):
        if len(ok):
            q = np.percentile(ok[feature], [50, 90, 99])
            lines.append(f"{feature}: p50={q[0]:.0f} p90={q[1]:.0f} p99={q[2]:.0f} max={ok[feature].max()}")
    if summary.skipped:
        lines.append(f"skipped {summary.skipped_total}: " + ", ".join(f"{r}={n}" for r, n in summary.skipped.most_common()))
        lines.extend(f"  {example}" for example in summary.skipped_examples)
    else:
        lines.append("skipped 0")
    if summary.renamed_ids:
        lines.append(f"renamed {summary.renamed_ids} duplicate id(s) to <dataset>:<index>:")
        lines.extend(f"  {example}" for example in summary.renamed_examples)
    return "\n".join(lines)
