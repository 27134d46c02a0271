"""The demo dataset: deterministic, real media files, a skewed modality mix, long-tailed text."""

import hashlib
import json
from collections import Counter
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from dflop.data.demo import MODALITY_FRACTIONS, make_demo_data, make_image_manifest


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _modality(sample: dict) -> str:
    if "video" in sample:
        return "video"
    image = sample.get("image")
    if image is None:
        return "text"
    return "multi_image" if isinstance(image, list) else "image"


def test_same_seed_gives_identical_bytes(demo_manifest, tmp_path):
    """Two runs in one process, on one software stack, write the same bytes, H.264 videos included.

    The second run starts from another heap state than the first, which is what exposed x264's
    reads of uninitialized memory (see demo._X264_PARAMS). Bytes are only comparable on the same
    stack: another PyAV / FFmpeg / libx264 build writes its version into the file (x264 SEI, the
    "Lavf..." encoder tag) and may choose other coding decisions. What holds across builds is
    checked by test_videos_decode_to_the_drawn_shape_on_any_build.
    """
    again = make_demo_data(tmp_path / "again", n_samples=300, seed=0)
    assert again.read_bytes() == demo_manifest.read_bytes()
    assert _tree_digest(again.parent) == _tree_digest(demo_manifest.parent)
    if "libx264" in av.codecs_available:  # the comparison above covered the H.264 encoder
        codecs = Counter()
        for video in sorted((again.parent / "videos").iterdir()):
            with av.open(str(video)) as container:
                codecs[container.streams.video[0].codec_context.name] += 1
        assert codecs["h264"] >= 5 and codecs["mpeg4"] >= 5, codecs


def test_other_seed_gives_other_data(tmp_path):
    a = make_demo_data(tmp_path / "a", n_samples=20, seed=1)
    b = make_demo_data(tmp_path / "b", n_samples=20, seed=2)
    assert a.read_bytes() != b.read_bytes()


def test_rerun_over_existing_dir_leaves_no_temp_files(tmp_path):
    make_demo_data(tmp_path, n_samples=12, seed=3)
    first = _tree_digest(tmp_path)
    # A killed run leaves a temporary file behind; the re-run must not be disturbed by it.
    (tmp_path / "images" / ".img_000000_0.jpg.tmp-1").write_bytes(b"partial")
    make_demo_data(tmp_path, n_samples=12, seed=3)
    second = {k: v for k, v in _tree_digest(tmp_path).items() if ".tmp-1" not in k}
    assert second == first
    assert not [p for p in tmp_path.rglob("*.tmp-*") if not p.name.endswith(".tmp-1")]


def test_modality_mix_is_skewed_like_instruction_data(demo_manifest):
    samples = json.loads(demo_manifest.read_text())
    assert len(samples) == 300
    counts = Counter(_modality(s) for s in samples)
    for modality, fraction in MODALITY_FRACTIONS.items():
        assert counts[modality] == round(fraction * 300), (modality, counts)
    # Cheap samples dominate, the expensive ones form a tail.
    assert counts["text"] + counts["image"] >= 0.7 * len(samples)
    multi = [len(s["image"]) for s in samples if _modality(s) == "multi_image"]
    assert min(multi) == 2 and max(multi) <= 6 and len(set(multi)) >= 3
    assert len({s["id"] for s in samples}) == len(samples)


def test_text_lengths_are_long_tailed(demo_manifest):
    samples = json.loads(demo_manifest.read_text())
    words = np.array([sum(len(t["value"].split()) for t in s["conversations"]) for s in samples])
    assert np.percentile(words, 99) > 5 * np.median(words)
    turns = Counter(len(s["conversations"]) // 2 for s in samples)
    assert turns[1] > turns[2] > 0 and max(turns) >= 3


def test_placeholders_match_media(demo_manifest):
    for sample in json.loads(demo_manifest.read_text()):
        turns = sample["conversations"]
        assert [t["from"] for t in turns] == ["human", "gpt"] * (len(turns) // 2)
        text = "".join(t["value"] for t in turns)
        first_human = turns[0]["value"]
        image = sample.get("image")
        n_images = 0 if image is None else (len(image) if isinstance(image, list) else 1)
        assert text.count("<image>") == first_human.count("<image>") == n_images, sample["id"]
        n_videos = 1 if "video" in sample else 0
        assert text.count("<video>") == first_human.count("<video>") == n_videos, sample["id"]


def test_images_are_real_files_of_many_shapes(demo_manifest):
    root = demo_manifest.parent
    samples = json.loads(demo_manifest.read_text())
    paths = [p for s in samples for p in ([s["image"]] if isinstance(s.get("image"), str)
                                          else s.get("image", []))]
    sizes, formats, modes = [], Counter(), Counter()
    for rel in paths:
        with Image.open(root / rel) as image:
            image.load()  # decodes: every file is complete
            sizes.append(image.size)
            formats[image.format] += 1
            modes[image.mode] += 1
            assert np.asarray(image).std() > 0, rel  # not a blank canvas
    widths = np.array([w for w, _ in sizes])
    heights = np.array([h for _, h in sizes])
    assert min(widths.min(), heights.min()) <= 64  # tiny
    assert (widths >= 3 * heights).any() and widths.max() >= 2560  # wide panoramas
    assert (heights >= 3 * widths).any()  # tall
    assert formats["JPEG"] > formats["PNG"] > 0
    assert modes["L"] > 0 and modes["RGBA"] > 0
    total_bytes = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert total_bytes < 30e6


def test_videos_are_real_and_vary(demo_manifest):
    root = demo_manifest.parent
    videos = [s["video"] for s in json.loads(demo_manifest.read_text()) if "video" in s]
    frame_counts, rates = [], set()
    for rel in videos:
        with av.open(str(root / rel)) as container:
            stream = container.streams.video[0]
            frames = list(container.decode(video=0))
            rates.add(stream.average_rate)
            duration = len(frames) / float(stream.average_rate)
            assert 1.0 - 1e-6 <= duration <= 6.0 + 1e-6, rel
            assert frames[0].to_ndarray().std() > 0
        frame_counts.append(len(frames))
    assert len(rates) >= 3 and len(set(frame_counts)) >= 5


# Every video of the default demo data (300 samples, seed 0): sample index, codec, width, height,
# average frame rate, decoded frames. "h264" is written with libx264 where PyAV has it, else mpeg4.
_SEED0_VIDEOS = (
    (3, "mpeg4", 320, 240, "8", 23), (5, "h264", 160, 120, "12", 72),
    (6, "mpeg4", 192, 108, "30", 100), (13, "h264", 192, 108, "8", 27),
    (20, "h264", 320, 240, "10", 46), (22, "mpeg4", 128, 96, "10", 58),
    (23, "mpeg4", 320, 240, "30000/1001", 40), (33, "h264", 224, 160, "10", 26),
    (39, "mpeg4", 160, 120, "30000/1001", 71), (46, "h264", 160, 120, "30000/1001", 101),
    (47, "mpeg4", 128, 96, "15", 71), (52, "mpeg4", 256, 144, "24", 108),
    (84, "mpeg4", 128, 96, "8", 36), (90, "mpeg4", 96, 64, "10", 52),
    (101, "mpeg4", 128, 96, "12", 52), (115, "mpeg4", 256, 144, "12", 17),
    (129, "h264", 160, 120, "25", 72), (144, "mpeg4", 160, 120, "25", 149),
    (163, "mpeg4", 224, 160, "12", 49), (171, "mpeg4", 224, 160, "10", 26),
    (172, "mpeg4", 160, 120, "8", 32), (175, "mpeg4", 192, 108, "24", 89),
    (177, "h264", 128, 96, "15", 50), (183, "h264", 160, 120, "15", 32),
    (237, "mpeg4", 144, 256, "25", 95), (244, "mpeg4", 256, 144, "10", 43),
    (245, "mpeg4", 224, 160, "12", 56), (247, "mpeg4", 128, 96, "15", 29),
    (276, "h264", 224, 160, "25", 95), (294, "mpeg4", 160, 120, "30", 117),
)


def test_videos_decode_to_the_drawn_shape_on_any_build(demo_manifest):
    """What the data profiler and trainer read from a video (codec, size, frame rate, decoded
    frame count, duration) follows from the seed alone, so it holds on any PyAV / FFmpeg / libx264
    build, unlike the encoded bytes (see test_same_seed_gives_identical_bytes)."""
    root = demo_manifest.parent
    videos = {s["video"] for s in json.loads(demo_manifest.read_text()) if "video" in s}
    h264 = "h264" if "libx264" in av.codecs_available else "mpeg4"
    assert videos == {f"videos/vid_{i:06d}.mp4" for i, *_ in _SEED0_VIDEOS}
    for index, codec, width, height, rate, n_frames in _SEED0_VIDEOS:
        with av.open(str(root / f"videos/vid_{index:06d}.mp4")) as container:
            stream = container.streams.video[0]
            got = (stream.codec_context.name, stream.width, stream.height, stream.average_rate)
            assert got == (h264 if codec == "h264" else codec, width, height, Fraction(rate)), index
            frames = [f for f in container.decode(video=0)]
            assert len(frames) == n_frames, index
            assert {(f.width, f.height) for f in frames} == {(width, height)}, index
            duration = float(stream.duration * stream.time_base)
            assert abs(duration - n_frames / Fraction(rate)) < 0.5 / Fraction(rate), index


def test_image_manifest_reuses_a_few_real_files(tmp_path):
    manifest = make_image_manifest(tmp_path, n_samples=2000, seed=0, n_distinct_images=8)
    samples = json.loads(manifest.read_text())
    assert len(samples) == 2000 and len({s["id"] for s in samples}) == 2000
    files = {s["image"] for s in samples}
    assert len(files) == 8
    for rel in files:
        with Image.open(tmp_path / rel) as image:
            image.load()
    again = make_image_manifest(tmp_path / "again", n_samples=2000, seed=0, n_distinct_images=8)
    assert again.read_bytes() == manifest.read_bytes()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="n_samples"):
        make_demo_data(tmp_path, n_samples=0)
