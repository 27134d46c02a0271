"""Header probing: sizes and frame counts equal what decoding gives; bad files get typed reasons."""

import io
import json
from fractions import Fraction

import av
import numpy as np
import pytest
from PIL import Image, ImageFile
from transformers.image_utils import load_image

from bad_inputs import cut_file, decodable_frames, header_frames, packet_ranges, write_video
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
    assert video_meta(path, check_complete=True) == meta  # no per-frame index: packets are counted
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


def _truncated_reason(path) -> MediaError:
    with pytest.raises(MediaError) as info:
        video_meta(path, check_complete=True)
    return info.value


def test_no_demo_video_is_taken_for_truncated(demo_manifest):
    # The demo has what a packet or byte count could stumble on: H.264 with B-frames (packets in
    # decode order, timestamps shifted by an edit list) next to MPEG-4 Part 2; every MP4 has an elst.
    _, videos = _demo_media(demo_manifest)
    codecs, with_b_frames = set(), 0
    for path in videos:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            codecs.add(stream.codec_context.name)
            with_b_frames += bool(stream.codec_context.has_b_frames)
        assert b"elst" in path.read_bytes(), path
        assert video_meta(path, check_complete=True) == video_meta(path), path
    assert codecs == {"mpeg4", "h264"} and with_b_frames > 0


@pytest.mark.parametrize("codec", ["mpeg4", "libx264"])
@pytest.mark.parametrize("suffix", [".mp4", ".mov", ".mkv", ".avi"])
def test_video_cut_after_its_header_is_truncated(tmp_path, codec, suffix):
    whole = write_video(tmp_path / f"whole{suffix}", codec=codec, n_frames=23)
    assert video_meta(whole, check_complete=True).n_frames == 23
    packets = packet_ranges(whole)
    assert len(packets) == 23
    pos, size = packets[5]
    cut = cut_file(whole, tmp_path / f"cut{suffix}", pos + size // 2)  # stops inside frame 5
    # The break is real: the header still promises 23 frames, a decoder delivers frames 0-4 and
    # at best a damaged frame 5.
    assert video_meta(cut).n_frames == 23
    assert decodable_frames(cut) <= 6
    error = _truncated_reason(cut)
    assert error.reason == "truncated_video" and str(cut) in str(error)


@pytest.mark.parametrize("codec", ["mpeg4", "libx264"])
def test_mp4_missing_only_its_last_byte_is_truncated(tmp_path, codec):
    whole = write_video(tmp_path / "whole.mp4", codec=codec, n_frames=23)
    pos, size = max(packet_ranges(whole))
    assert pos + size == whole.stat().st_size  # faststart: the last frame ends the file
    cut = cut_file(whole, tmp_path / "cut.mp4", pos + size - 1)
    assert header_frames(cut) == 23
    error = _truncated_reason(cut)
    assert error.reason == "truncated_video"
    assert "(1 cut off)" in str(error)


@pytest.mark.parametrize("source", ["all_keyframes", "demo"])
def test_edit_list_hiding_frames_is_not_truncation(tmp_path, demo_manifest, source):
    # An edit list that starts the presentation 5 frames in (as a trimmed copy made without
    # re-encoding has). FFmpeg then keeps the hidden frames a decoder needs (the demo's MPEG-4 has
    # one keyframe: all 5 stay, flagged discard) and drops the others from its index and packets
    # (noise frames are all keyframes: all 5 go), so packet counts fall short of the header's 23.
    path = tmp_path / "trimmed.mp4"
    if source == "demo":
        _, videos = _demo_media(demo_manifest)
        path.write_bytes(next(v for v in videos if header_frames(v) > 10 and _codec(v) == "mpeg4").read_bytes())
    else:
        write_video(path, codec="mpeg4", n_frames=23)
    n_frames = header_frames(path)
    data = bytearray(path.read_bytes())
    at = data.index(b"elst")
    assert data[at + 4] == 0 and int.from_bytes(data[at + 8:at + 12], "big") == 1  # version 0, one entry
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        ticks_per_frame = int(1 / (stream.time_base * stream.average_rate))
    media_time = int.from_bytes(data[at + 16:at + 20], "big", signed=True)
    data[at + 16:at + 20] = (media_time + 5 * ticks_per_frame).to_bytes(4, "big", signed=True)
    path.write_bytes(bytes(data))
    assert header_frames(path) == n_frames and decodable_frames(path) == n_frames - 5  # took effect
    assert video_meta(path, check_complete=True) == video_meta(path)


def _codec(path) -> str:
    with av.open(str(path)) as container:
        return container.streams.video[0].codec_context.name
