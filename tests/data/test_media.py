"""Header probing: sizes and frame counts equal what decoding gives; bad files get typed reasons."""

import io
import json
from fractions import Fraction

import av
import numpy as np
import pytest
from PIL import Image, ImageFile
from transformers.image_utils import load_image

from dflop.data.media import ImageRef, MediaError, VideoMeta, image_size, video_meta


def _demo_media(manifest):
    root = manifest.parent
    images, videos = [], []
    for sample in json.loads(manifest.read_text()):
        image = sample.get("image")
        images += [root / p for p in ([image] if isinstance(image, str) else image or [])]
        if "video" in sample:
            videos.append(root / sample["video"])
    return images, videos


def _jpeg_bytes(width=64, height=48, **save_args) -> bytes:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "JPEG", **save_args)
    return buffer.getvalue()


def _image_bytes(fmt: str, width=64, height=48) -> bytes:
    rng = np.random.default_rng(1)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)).save(buffer, fmt)
    return buffer.getvalue()


def _reason(ref, **kwargs) -> str:
    with pytest.raises(MediaError) as info:
        image_size(ref, **kwargs)
    return info.value.reason


def test_header_size_equals_decoded_size_for_every_demo_image(demo_manifest):
    images, _ = _demo_media(demo_manifest)
    n_rotated = 0
    for path in images:
        with Image.open(path) as image:
            decoded = np.asarray(image)  # full decode: the independent reference
        assert image_size(path) == (decoded.shape[1], decoded.shape[0]), path
        # With orientation applied, the size transformers' own loader produces.
        upright = load_image(str(path)).size
        assert image_size(path, apply_exif_orientation=True) == upright, path
        n_rotated += upright != (decoded.shape[1], decoded.shape[0])
    assert n_rotated > 0  # the demo data exercises the EXIF choice


def test_embedded_bytes_same_as_file(demo_manifest):
    images, _ = _demo_media(demo_manifest)
    for path in images[:20]:
        ref = ImageRef(data=path.read_bytes(), name=path.name)
        assert image_size(ref) == image_size(path)


def test_probing_does_not_decode_pixels(demo_manifest, monkeypatch):
    images, _ = _demo_media(demo_manifest)

    def refuse(self):
        raise AssertionError("pixels decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    for path in images:
        image_size(path, apply_exif_orientation=True)


def test_video_meta_equals_decoded_frames(demo_manifest):
    _, videos = _demo_media(demo_manifest)
    assert videos
    for path in videos:
        meta = video_meta(path)
        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert meta.n_frames == len(frames), path
        assert (meta.height, meta.width) == frames[0].shape[:2], path
        # the container time base rounds the duration (e.g. 1/1024 s ticks)
        assert meta.duration_s == pytest.approx(meta.n_frames / meta.fps, abs=2e-3), path


@pytest.mark.parametrize("rate", [Fraction(12), Fraction(30000, 1001)])
def test_video_meta_without_frame_count_in_container(tmp_path, rate):
    path = tmp_path / "clip.mkv"  # Matroska stores no frame count: duration x rate is used
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for t in range(37):
            frame = np.full((48, 64, 3), t * 6, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0
        decoded = sum(1 for _ in container.decode(video=0))
    meta = video_meta(path)
    assert meta == VideoMeta(
        n_frames=decoded, fps=float(rate), duration_s=meta.duration_s, width=64, height=48
    )
    assert meta.duration_s == pytest.approx(decoded / float(rate), abs=1.5 / float(rate))


def test_missing_and_unreadable_images(tmp_path):
    assert _reason(tmp_path / "nope.jpg") == "missing_file"
    (tmp_path / "empty.jpg").write_bytes(b"")
    assert _reason(tmp_path / "empty.jpg") == "unreadable_image"
    (tmp_path / "text.jpg").write_text("not an image at all\n" * 10)
    assert _reason(tmp_path / "text.jpg") == "unreadable_image"
    assert _reason(ImageRef(data=b"\x00\x01garbage" * 20)) == "unreadable_image"


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "WEBP"])
def test_truncated_images(tmp_path, fmt):
    data = _image_bytes(fmt, 200, 150)
    with Image.open(io.BytesIO(data)) as image:
        image.load()  # the full file is fine
    assert image_size(ImageRef(data=data)) == (200, 150)
    header_cut = data[:20]
    body_cut = data[: len(data) // 2]
    assert _reason(ImageRef(data=header_cut)) == "truncated_image"
    path = tmp_path / f"cut.{fmt.lower()}"
    path.write_bytes(body_cut)
    assert _reason(path) == "truncated_image"


def test_trailing_bytes_after_a_complete_image_are_accepted(tmp_path):
    # e.g. a motion photo: a JPEG with a video appended; PIL decodes it, so training can use it.
    path = tmp_path / "motion.jpg"
    path.write_bytes(_jpeg_bytes(80, 60) + b"\x00\x00\x00\x18ftypmp42" + bytes(5000))
    assert image_size(path) == (80, 60)


def test_exif_orientation(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 8
    path = tmp_path / "portrait.jpg"
    path.write_bytes(_jpeg_bytes(90, 30, exif=exif))
    assert image_size(path) == (90, 30)
    assert image_size(path, apply_exif_orientation=True) == load_image(str(path)).size == (30, 90)


def test_oversized_image_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "big.png"
    path.write_bytes(_image_bytes("PNG", 400, 300))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 120k pixels > 2x the limit
    assert _reason(path) == "image_too_large"


def test_bad_videos(tmp_path):
    with pytest.raises(MediaError) as info:
        video_meta(tmp_path / "nope.mp4")
    assert info.value.reason == "missing_file"
    assert "nope.mp4" in str(info.value)

    (tmp_path / "text.mp4").write_text("hello\n" * 100)
    with pytest.raises(MediaError) as info:
        video_meta(tmp_path / "text.mp4")
    assert info.value.reason == "unreadable_video"

    audio = tmp_path / "tone.mka"
    with av.open(str(audio), "w") as container:
        stream = container.add_stream("mp2", rate=16000)
        samples = np.sin(np.arange(16000) / 10.0)[None, :].astype(np.float32) * 0.1
        frame = av.AudioFrame.from_ndarray(
            (samples * 32767).astype(np.int16), format="s16", layout="mono"
        )
        frame.sample_rate = 16000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with pytest.raises(MediaError) as info:
        video_meta(audio)
    assert info.value.reason == "no_video_stream"


def test_truncated_mp4_is_unreadable(demo_manifest, tmp_path):
    _, videos = _demo_media(demo_manifest)
    data = videos[0].read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) // 2])  # PyAV writes the index (moov) last: now missing
    with pytest.raises(MediaError) as info:
        video_meta(cut)
    assert info.value.reason == "unreadable_video"
