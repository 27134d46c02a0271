"""A small, deterministic LLaVA-format dataset with real image and video files, for demos and tests.

The mix is skewed like real instruction data: most samples are cheap (text, small and medium
single images), a heavy tail is expensive (multi-image posts, videos, 4K-wide panoramas, tall
screenshots) and text lengths are long-tailed, so the planner and scheduler have something to
balance. Same seed, same bytes (on one software stack): every random choice comes from numpy
generators seeded with (seed, purpose, sample index), the encoders (JPEG, PNG, MPEG-4 Part 2 / H.264
in MP4) are run single-threaded, and x264's macroblock-tree rate control is off (see _X264_PARAMS).
Other PyAV / libx264 builds may encode other bytes; the frames, sizes and rates stay the same.

Layout of `out_dir`: ``demo.json`` (the manifest, a JSON list), ``images/``, ``videos/``; media
paths in the manifest are relative to `out_dir` (the readers' default media root). Each file is
written to a temporary name and renamed, the manifest last, so a killed run leaves no manifest
that points at missing or half-written files, and a re-run simply writes everything again.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageDraw

# Fractions of samples per modality (text, single image, multi-image post, video).
MODALITY_FRACTIONS = {"text": 0.15, "image": 0.60, "multi_image": 0.15, "video": 0.10}

_WORDS = (
    "the a of and to in is that it for on with as this are be by at from image picture photo "
    "shows left right top bottom center red green blue yellow white black small large bright dark "
    "person people dog cat car tree building sky water road table chart text sign window door "
    "there two three several many some each one near behind above below next holding standing "
    "sitting walking looking color shape object scene background foreground detail light shadow "
    "because however while which when where what how why answer question describe explain count "
    "number total value axis line bar trend increase decrease between compared first second frame "
    "video moment motion camera moves slowly quickly appears then finally during beginning end"
).split()

_IMAGE_QUESTIONS = (
    "What is shown in this image?",
    "Describe the image in detail.",
    "What color is the largest object?",
    "Read the text in the picture.",
    "How many objects can you count?",
    "What is happening in the scene?",
)
_MULTI_IMAGE_QUESTIONS = (
    "What changed between these images?",
    "Compare the images.",
    "Which image is brighter, and why?",
    "Describe what the images have in common.",
)
_VIDEO_QUESTIONS = (
    "What happens in the video?",
    "Describe the camera motion.",
    "Summarize the video.",
    "What moves in the video, and in which direction?",
)
_TEXT_QUESTIONS = (
    "Explain this in simple words.",
    "Write a short summary.",
    "What is the answer?",
    "Give three reasons.",
)

_ASPECTS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 3 / 2, 2 / 3, 2.0, 0.5)
_PANORAMAS = ((3840, 720), (2560, 640), (3000, 600), (1920, 360))
_TALL = ((720, 2560), (600, 1800), (480, 1920), (540, 2400))
_VIDEO_SIZES = ((96, 64), (128, 96), (160, 120), (192, 108), (224, 160), (256, 144), (320, 240),
                (144, 256))
_VIDEO_RATES = (Fraction(8), Fraction(10), Fraction(12), Fraction(15), Fraction(24), Fraction(25),
                Fraction(30), Fraction(30000, 1001))
# x264 options for reproducible bytes. threads=1 alone is not enough: with macroblock-tree rate
# control on (the default), libx264 (core 165, PyAV 18.1 wheels) uses uninitialized stack memory
# in its lookahead (valgrind: "Use of uninitialised value of size 8" under x264_encoder_encode), so
# an encode depends on what the process ran before it, threads or not. With mbtree=0 valgrind
# reports no such use and the bytes depend on the input only; H.264 files get larger and slower to
# encode, a small share of the demo. asm=0 does not help (its C paths read more).
_X264_PARAMS = "threads=1:lookahead-threads=1:sliced-threads=0:mbtree=0"


def make_demo_data(out_dir: str | os.PathLike, n_samples: int = 300, seed: int = 0) -> Path:
    """Write the demo dataset into `out_dir`; return the manifest path (`out_dir/demo.json`).

    Roughly 15% text, 60% single image, 15% multi-image (2-6 images), 10% video (1-6 s).
    300 samples take a few seconds and ~20 MB.
    """
    if n_samples < 1:
        raise ValueError(f"make_demo_data: n_samples must be >= 1, got {n_samples}")
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    photos = _sample_photos()
    modalities = _assign_modalities(n_samples, _rng(seed, _MODALITY_STREAM, 0))
    samples = []
    for index, modality in enumerate(modalities):
        rng = _rng(seed, _SAMPLE_STREAM, index)
        sample_id = f"demo-{index:06d}"
        record: dict = {"id": sample_id}
        if modality == "text":
            question = str(rng.choice(_TEXT_QUESTIONS))
            if rng.random() < 0.3:  # some prompts carry a long context
                context = _sentence(rng, _long_tail_length(rng, median=120, cap=1500))
                question = context + "\n" + question
            record["conversations"] = _conversation(rng, question)
        elif modality == "image":
            size = _single_image_size(rng)
            record["image"] = _write_image(out_dir, f"images/img_{index:06d}_0", size, rng, photos)
            record["conversations"] = _conversation(
                rng, "<image>\n" + str(rng.choice(_IMAGE_QUESTIONS))
            )
        elif modality == "multi_image":
            n_images = int(rng.choice([2, 3, 4, 5, 6], p=[0.4, 0.25, 0.15, 0.12, 0.08]))
            stems = [f"images/img_{index:06d}_{k}" for k in range(n_images)]
            paths = [_write_image(out_dir, s, _post_image_size(rng), rng, photos) for s in stems]
            record["image"] = paths
            header = "".join(f"Image {k + 1}: <image>\n" for k in range(n_images))
            record["conversations"] = _conversation(
                rng, header + str(rng.choice(_MULTI_IMAGE_QUESTIONS))
            )
        else:
            record["video"] = _write_video(out_dir, f"videos/vid_{index:06d}.mp4", rng, photos)
            record["conversations"] = _conversation(
                rng, "<video>\n" + str(rng.choice(_VIDEO_QUESTIONS))
            )
        samples.append(record)
    manifest = out_dir / "demo.json"
    _write_atomic(manifest, _manifest_bytes(samples))
    return manifest


def make_image_manifest(
    out_dir: str | os.PathLike,
    n_samples: int = 50_000,
    seed: int = 0,
    n_distinct_images: int = 64,
    manifest_name: str = "images.json",
) -> Path:
    """A large single-image manifest over a few real image files, for data-profiler benchmarks.

    `n_distinct_images` files of varied sizes (the single-image size mix of the demo data) are
    written under `out_dir/bench_images/`; each of the `n_samples` samples points at one of them
    and has a short, long-tailed conversation. Returns the manifest path (`out_dir/manifest_name`).
    """
    if n_samples < 1 or n_distinct_images < 1:
        raise ValueError("make_image_manifest: n_samples and n_distinct_images must be >= 1")
    out_dir = Path(out_dir)
    (out_dir / "bench_images").mkdir(parents=True, exist_ok=True)
    photos = _sample_photos()
    paths = []
    for k in range(n_distinct_images):
        rng = _rng(seed, _BENCH_IMAGE_STREAM, k)
        paths.append(
            _write_image(out_dir, f"bench_images/img_{k:04d}", _single_image_size(rng), rng, photos)
        )
    rng = _rng(seed, _BENCH_SAMPLE_STREAM, 0)
    choice = rng.integers(0, n_distinct_images, size=n_samples)
    answer_lengths = np.clip(np.rint(rng.lognormal(np.log(20), 0.8, size=n_samples)), 1, 400)
    vocab = np.array(_WORDS)
    questions = _IMAGE_QUESTIONS
    samples = []
    for i in range(n_samples):
        words = vocab[rng.integers(0, len(vocab), size=int(answer_lengths[i]))]
        samples.append({
            "id": f"bench-{i:06d}",
            "image": paths[choice[i]],
            "conversations": [
                {"from": "human", "value": "<image>\n" + questions[i % len(questions)]},
                {"from": "gpt", "value": " ".join(words) + "."},
            ],
        })
    manifest = out_dir / manifest_name
    _write_atomic(manifest, _manifest_bytes(samples))
    return manifest


# --- what each sample holds ---------------------------------------------------------------------

# Independent random streams, one per purpose and index: sample i looks the same whatever else
# the generator draws.
_SAMPLE_STREAM, _MODALITY_STREAM, _BENCH_IMAGE_STREAM, _BENCH_SAMPLE_STREAM = 0, 1, 2, 3


def _rng(seed: int, purpose: int, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(purpose, index)))



def _assign_modalities(n_samples: int, rng: np.random.Generator) -> list[str]:
    """Exact modality counts (rounded fractions), in a seeded random order."""
    counts = {m: int(round(f * n_samples)) for m, f in MODALITY_FRACTIONS.items() if m != "image"}
    counts["image"] = max(0, n_samples - sum(counts.values()))
    labels = [m for m in MODALITY_FRACTIONS for _ in range(counts[m])][:n_samples]
    rng.shuffle(labels)
    return labels


def _single_image_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): mostly small/medium, a tail of large, panoramic, tall and tiny images."""
    r = rng.random()
    if r < 0.04:
        return int(rng.integers(16, 65)), int(rng.integers(16, 65))
    if r < 0.90:
        if r < 0.36:
            long_side = int(rng.integers(128, 449))
        elif r < 0.80:
            long_side = int(rng.integers(448, 1025))
        else:
            long_side = int(rng.integers(1024, 2049))
        return _with_aspect(long_side, float(rng.choice(_ASPECTS)))
    if r < 0.95:
        return _PANORAMAS[int(rng.integers(len(_PANORAMAS)))]
    return _TALL[int(rng.integers(len(_TALL)))]


def _post_image_size(rng: np.random.Generator) -> tuple[int, int]:
    """Images of multi-image posts: small to medium, any aspect."""
    return _with_aspect(int(rng.integers(96, 769)), float(rng.choice(_ASPECTS)))


def _with_aspect(long_side: int, aspect: float) -> tuple[int, int]:
    """(width, height) with the given long side and width/height ratio."""
    if aspect >= 1:
        return long_side, max(1, round(long_side / aspect))
    return max(1, round(long_side * aspect)), long_side


def _long_tail_length(rng: np.random.Generator, median: float, cap: int) -> int:
    return int(np.clip(round(rng.lognormal(np.log(median), 0.9)), 1, cap))


def _sentence(rng: np.random.Generator, n_words: int) -> str:
    words = [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n_words)]
    return " ".join(words).capitalize() + "."


def _conversation(rng: np.random.Generator, first_question: str) -> list[dict[str, str]]:
    """1-6 turns; media placeholders only in the first human turn; long-tailed answers."""
    n_turns = int(min(6, rng.geometric(0.55)))
    turns = []
    for t in range(n_turns):
        if t == 0:
            question = first_question
        else:
            question = _sentence(rng, _long_tail_length(rng, 10, 80))[:-1] + "?"
        turns.append({"from": "human", "value": question})
        turns.append({"from": "gpt", "value": _sentence(rng, _long_tail_length(rng, 30, 700))})
    return turns


# --- media files --------------------------------------------------------------------------------


def _sample_photos() -> list[np.ndarray]:
    """The two photos bundled with scikit-learn (no download), [427, 640, 3] uint8 each.

    Read from the package's data folder directly: importing sklearn.datasets takes over a second.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("make_demo_data needs scikit-learn's bundled sample photos")
    folder = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "images"
    photos = []
    for name in ("china.jpg", "flower.jpg"):
        with Image.open(folder / name) as image:
            photos.append(np.asarray(image.convert("RGB")))
    return photos


def _render_image(
    size: tuple[int, int], rng: np.random.Generator, photos: list[np.ndarray]
) -> Image.Image:
    """An RGB image of `size` (width, height): a resized photo crop (70%) or a drawing.

    Drawings (gradient + shapes, like charts and screenshots) have mode "RGB" and info["kind"]
    "drawing"; photos have info["kind"] "photo".
    """
    width, height = size
    if rng.random() < 0.7:
        photo = photos[int(rng.integers(len(photos)))]
        ph, pw = photo.shape[:2]
        # The largest crop with the target aspect that fits, shrunk a little at a random place.
        scale = float(rng.uniform(0.5, 1.0)) * min(pw / width, ph / height)
        cw, ch = max(1, int(width * scale)), max(1, int(height * scale))
        x0, y0 = int(rng.integers(0, pw - cw + 1)), int(rng.integers(0, ph - ch + 1))
        image = Image.fromarray(photo[y0:y0 + ch, x0:x0 + cw]).resize(size, Image.BILINEAR)
        image.info["kind"] = "photo"
    else:
        c0, c1 = rng.integers(0, 256, size=3), rng.integers(0, 256, size=3)
        ramp = np.linspace(0.0, 1.0, width)[None, :, None]
        row = (c0 + (c1 - c0) * ramp).astype(np.uint8)
        image = Image.fromarray(np.repeat(row, height, axis=0))
        image.info["kind"] = "drawing"
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(0, 4))):
        x = sorted(int(v) for v in rng.integers(0, width, size=2))
        y = sorted(int(v) for v in rng.integers(0, height, size=2))
        fill = tuple(int(v) for v in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.rectangle([x[0], y[0], x[1], y[1]], fill=fill)
        else:
            draw.ellipse([x[0], y[0], x[1], y[1]], fill=fill)
    return image


def _write_image(
    out_dir: Path, stem: str, size: tuple[int, int], rng: np.random.Generator,
    photos: list[np.ndarray],
) -> str:
    """Render and save one image; return its path relative to out_dir.

    Drawings become PNG (a quarter of them RGBA with an alpha ramp); photos become JPEG, some
    grayscale and some with an EXIF orientation tag (stored size differs from the displayed
    one; see media.py).
    """
    image = _render_image(size, rng, photos)
    kind = rng.random()
    buffer = io.BytesIO()
    if image.info["kind"] == "drawing":
        suffix = ".png"
        if kind < 0.25:
            alpha = np.linspace(64, 255, size[0], dtype=np.uint8)[None, :].repeat(size[1], axis=0)
            image.putalpha(Image.fromarray(alpha))
        image.save(buffer, "PNG")
    else:
        suffix = ".jpg"
        exif = Image.Exif()
        if kind < 0.08:
            image = image.convert("L")
        elif kind < 0.16:
            exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise on display
        image.save(buffer, "JPEG", quality=80, exif=exif)
    relative = stem + suffix
    _write_atomic(out_dir / relative, buffer.getvalue())
    return relative


def _write_video(
    out_dir: Path, relative: str, rng: np.random.Generator, photos: list[np.ndarray]
) -> str:
    """An MP4 of 1-6 s: the camera pans across a photo while a box moves. Returns `relative`."""
    width, height = _VIDEO_SIZES[int(rng.integers(len(_VIDEO_SIZES)))]
    rate = _VIDEO_RATES[int(rng.integers(len(_VIDEO_RATES)))]
    n_frames = max(1, round(float(rng.uniform(1.0, 6.0)) * float(rate)))
    codec = "libx264" if rng.random() < 0.3 and "libx264" in av.codecs_available else "mpeg4"
    photo = photos[int(rng.integers(len(photos)))]
    canvas = np.asarray(Image.fromarray(photo).resize((2 * width, 2 * height), Image.BILINEAR))
    box_color = rng.integers(0, 256, size=3).astype(np.uint8)

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        options = {"x264-params": _X264_PARAMS} if codec == "libx264" else {}
        stream = container.add_stream(codec, rate=rate, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1  # multi-threaded encoders are not byte-deterministic
        for t in range(n_frames):
            phase = t / max(1, n_frames - 1)
            x0, y0 = int(phase * width), int(phase * height) // 2
            frame = canvas[y0:y0 + height, x0:x0 + width].copy()
            bx = int(phase * (width - width // 4))
            frame[height // 3: height // 3 + height // 4, bx: bx + width // 4] = box_color
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    _write_atomic(out_dir / relative, buffer.getvalue())
    return relative


# --- files --------------------------------------------------------------------------------------


def _manifest_bytes(samples: list[dict]) -> bytes:
    return (json.dumps(samples, ensure_ascii=False, indent=1) + "\n").encode("utf-8")


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, then rename over `path` (atomic on POSIX filesystems)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
