"""Data profiler: shapes.parquet / histograms.parquet contents, bad input, determinism."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from bad_inputs import (
    VIDEO_CONV,
    corrupt_image_page,
    cut_file,
    decodable_frames,
    header_frames,
    packet_ranges,
    write_image_parquet,
    write_video,
)
from dflop.cli import main
from dflop.config import Config
from dflop.data.media import image_size
from dflop.errors import UserError
from dflop.profiling.data_profiler import profile_data
from dflop.shapes import SHAPE_COLUMNS

DESIGN_SHAPE_COLUMNS = ["sample_id", "dataset", "modality", "n_images", "n_frames", "n_tiles",
                        "vision_tokens", "text_tokens", "seq_len", "media_pixels", "status"]


def _cfg(datasets, **data):
    return Config.from_dict({"data": {"datasets": datasets, **data}})


def _run(tmp_path, cfg, workers=1):
    shapes, hist = tmp_path / "shapes.parquet", tmp_path / "hist.parquet"
    summary = profile_data(cfg, shapes_path=shapes, histograms_path=hist, workers=workers, progress=False)
    return summary, shapes, hist


def test_demo_shapes_have_design_columns_and_one_row_per_sample(tmp_path, demo_manifest):
    _, shapes_path, _ = _run(tmp_path, _cfg([{"name": "demo", "path": str(demo_manifest)}]))
    shapes = pd.read_parquet(shapes_path)
    assert list(shapes.columns) == DESIGN_SHAPE_COLUMNS == list(SHAPE_COLUMNS)
    records = json.loads(Path(demo_manifest).read_text())
    assert len(shapes) == len(records) and shapes["sample_id"].is_unique
    assert (shapes["status"] == "ok").all()
    assert (shapes["seq_len"] == shapes["text_tokens"] + shapes["vision_tokens"]).all()
    assert set(shapes["modality"]) == {"text", "image", "multi_image", "video"}
    text = shapes[shapes["modality"] == "text"]
    assert (text[["n_images", "n_tiles", "vision_tokens"]] == 0).all().all()
    video = shapes[shapes["modality"] == "video"]
    assert (video["n_frames"] > 0).all() and (video["n_tiles"] == video["n_frames"]).all()


def test_image_counts_and_decoded_pixels_match_the_media(tmp_path, demo_manifest):
    import av

    _, shapes_path, _ = _run(tmp_path, _cfg([{"name": "demo", "path": str(demo_manifest)}]))
    shapes = pd.read_parquet(shapes_path).set_index("sample_id")
    root = Path(demo_manifest).parent
    for record in json.loads(Path(demo_manifest).read_text()):
        images = record.get("image", [])
        images = [images] if isinstance(images, str) else images
        assert shapes.loc[record["id"], "n_images"] == len(images)
        # every pixel the loader decodes: PIL's decoded sizes, and every frame PyAV decodes from the video
        pixels = sum(np.prod(Image.open(root / name).size) for name in images)
        if record.get("video"):
            with av.open(str(root / record["video"])) as container:
                pixels += sum(frame.width * frame.height for frame in container.decode(video=0))
        assert shapes.loc[record["id"], "media_pixels"] == pixels, record["id"]


def test_worker_count_does_not_change_output(tmp_path, demo_manifest):
    cfg = _cfg([{"name": "demo", "path": str(demo_manifest)}])
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    _, one, _ = _run(tmp_path / "one", cfg, workers=1)
    _, two, _ = _run(tmp_path / "two", cfg, workers=2)
    pd.testing.assert_frame_equal(pd.read_parquet(one), pd.read_parquet(two))


def test_histograms_count_every_ok_sample_per_group(tmp_path, demo_manifest):
    _, shapes_path, hist_path = _run(tmp_path, _cfg([{"name": "demo", "path": str(demo_manifest)}]))
    shapes = pd.read_parquet(shapes_path)
    hist = pd.read_parquet(hist_path)
    assert {"dataset", "feature", "bin_lo", "bin_hi", "count", "frac"} <= set(hist.columns)
    for (dataset, modality, feature), part in hist.groupby(["dataset", "modality", "feature"]):
        sel = shapes if dataset == "all" else shapes[shapes["dataset"] == dataset]
        sel = sel if modality == "all" else sel[sel["modality"] == modality]
        assert part["count"].sum() == len(sel), (dataset, modality, feature)
        assert part["frac"].sum() == pytest.approx(1.0)
        # Bins are contiguous, so each value lands in exactly one.
        assert (part["bin_lo"].to_numpy()[1:] == part["bin_hi"].to_numpy()[:-1]).all()
    seq = hist[(hist.dataset == "all") & (hist.modality == "all") & (hist.feature == "seq_len")]
    for lo, hi, count in seq[["bin_lo", "bin_hi", "count"]].itertuples(index=False):
        assert count == ((shapes.seq_len >= lo) & (shapes.seq_len < hi)).sum()


def _bad_dataset(root: Path) -> Path:
    """Two good samples and one of each kind of bad input."""
    Image.new("RGB", (640, 480), (10, 20, 30)).save(root / "ok.jpg")
    good = Image.new("RGB", (800, 600), (200, 10, 10))
    good.save(root / "full.png")
    data = (root / "full.png").read_bytes()
    (root / "truncated.png").write_bytes(data[:40])  # header cut mid-way
    (root / "garbage.jpg").write_bytes(b"this is not an image at all" * 10)
    conv = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A colour."}]
    lines = [
        json.dumps({"id": "good-image", "image": "ok.jpg", "conversations": conv}),
        json.dumps({"id": "good-text", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}),
        json.dumps({"id": "missing", "image": "nope.jpg", "conversations": conv}),
        json.dumps({"id": "truncated", "image": "truncated.png", "conversations": conv}),
        json.dumps({"id": "garbage", "image": "garbage.jpg", "conversations": conv}),
        '{"id": "broken", "image": ',
        json.dumps({"id": "noconv", "image": "ok.jpg"}),
        json.dumps({"id": "audio", "audio": "x.wav", "conversations": conv}),
        json.dumps({"id": "two-placeholders", "image": "ok.jpg",
                    "conversations": [{"from": "human", "value": "<image><image> twice?"}, {"from": "gpt", "value": "no"}]}),
    ]
    path = root / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_input_becomes_skipped_rows_with_reasons(tmp_path):
    manifest = _bad_dataset(tmp_path)
    summary, shapes_path, _ = _run(tmp_path, _cfg([{"name": "bad", "path": str(manifest)}], max_skip_frac=1.0))
    shapes = pd.read_parquet(shapes_path)
    status = dict(zip(shapes["sample_id"], shapes["status"]))
    assert status["good-image"] == "ok" and status["good-text"] == "ok"
    assert status["missing"] == "skipped:missing_file"
    assert status["truncated"] == "skipped:truncated_image"
    assert status["garbage"] == "skipped:unreadable_image"
    assert status["noconv"] == "skipped:no_conversations"
    assert status["audio"] == "skipped:unknown_modality:audio"
    assert status["two-placeholders"] == "skipped:placeholder_mismatch"
    assert "skipped:malformed_json" in status.values()
    assert summary.total == 9 and summary.skipped_total == 7
    # The good image's shape is that of the decoded file (independent of the header path).
    width, height = Image.open(tmp_path / "ok.jpg").convert("RGB").size
    assert image_size(tmp_path / "ok.jpg") == (width, height)


def test_too_many_skipped_fails_and_writes_nothing(tmp_path):
    manifest = _bad_dataset(tmp_path)
    with pytest.raises(UserError, match=r"7 of 9 samples skipped .*max_skip_frac=1\.0%.*missing_file: 1"):
        _run(tmp_path, _cfg([{"name": "bad", "path": str(manifest)}]))
    assert not (tmp_path / "shapes.parquet").exists() and not (tmp_path / "hist.parquet").exists()
    assert not list(tmp_path.glob(".shapes.parquet*"))  # no temp file left behind


def test_missing_dataset_fails_before_work_naming_path(tmp_path):
    cfg = _cfg([{"name": "gone", "path": str(tmp_path / "nowhere.json")}])
    with pytest.raises(UserError, match=r"data.datasets\[0\] \(gone\).*nowhere\.json"):
        _run(tmp_path, cfg)


def _profile_data_cli(tmp_path, capsys, datasets, workers=1, **settings) -> tuple[int, list[str]]:
    """Run `dflop profile-data`; return its exit code and its stderr lines, less the progress bar."""
    settings = json.dumps({"data": {"datasets": datasets}, **settings})
    out = tmp_path / "results"
    code = main(["profile-data", "--settings", settings, "--shapes", str(out / "shapes.parquet"),
                 "--histograms", str(out / "histograms.parquet"), "--workers", str(workers)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, [line for line in lines if not line.startswith("profile_data: ")]


def _nothing_written(tmp_path) -> bool:
    out = tmp_path / "results"
    return not out.exists() or not any(out.iterdir())  # no outputs, no temp files


@pytest.mark.parametrize("workers", [1, 2])
def test_corrupt_parquet_page_fails_in_one_line_and_writes_nothing(tmp_path, capsys, workers):
    folder = tmp_path / "ov"
    folder.mkdir()
    part = write_image_parquet(folder / "part-0.parquet", n_rows=40, row_group_size=10)
    corrupt_image_page(part, row_group=2, where="header")
    code, err = _profile_data_cli(tmp_path, capsys, [{"name": "ov", "path": str(folder)}], workers=workers)
    assert code == 2
    assert len(err) == 1 and err[0].startswith(
        f"dflop profile-data: data.datasets[0] (ov): dataset {part}: unreadable Parquet data after "), err
    assert _nothing_written(tmp_path)


def test_truncated_video_is_skipped_and_counts_toward_max_skip_frac(tmp_path, capsys):
    whole = write_video(tmp_path / "whole.mp4", codec="libx264", n_frames=23)
    pos, size = packet_ranges(whole)[5]
    cut = cut_file(whole, tmp_path / "cut.mp4", pos + size // 2)
    # The header of the cut copy still says 23 frames, of which a decoder delivers a handful: the
    # trainer's loader fails on it (SampleError) unless profile_data skips it.
    assert header_frames(cut) == 23 and decodable_frames(cut) <= 6
    manifest = tmp_path / "videos.jsonl"
    manifest.write_text("".join(json.dumps({"id": name, "video": f"{name}.mp4", "conversations": VIDEO_CONV}) + "\n"
                                for name in ("whole", "cut")))
    datasets = [{"name": "vids", "path": str(manifest)}]

    summary, shapes_path, _ = _run(tmp_path, _cfg(datasets, max_skip_frac=0.5))
    status = dict(zip(*pd.read_parquet(shapes_path)[["sample_id", "status"]].to_numpy().T))
    assert status == {"whole": "ok", "cut": "skipped:truncated_video"}
    assert summary.skipped == {"truncated_video": 1}
    assert "cut.mp4: truncated_video" in summary.skipped_examples[0]

    code, err = _profile_data_cli(tmp_path, capsys, datasets)  # default max_skip_frac: 1%
    assert code == 2
    assert len(err) == 1 and err[0].startswith(
        "dflop profile-data: profile_data: 1 of 2 samples skipped (50.0%), more than data.max_skip_frac=1.0% "
        "(truncated_video: 1; first: vids/cut: truncated_video"), err
    assert str(cut) in err[0]
    assert _nothing_written(tmp_path)


def _escaping_manifest(tmp_path) -> tuple[Path, Path]:
    """data/m.jsonl: a good image, a `../` escape and an absolute path to secret.png outside data/."""
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (64, 48)).save(data / "ok.png")
    Image.new("RGB", (64, 48)).save(tmp_path / "secret.png")
    conv = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A box."}]
    images = {"good": "ok.png", "dotdot": "../secret.png", "absolute": str(tmp_path / "secret.png")}
    manifest = data / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": k, "image": v, "conversations": conv}) + "\n"
                                for k, v in images.items()))
    return manifest, tmp_path / "secret.png"


def test_media_outside_media_root_is_skipped_with_its_path(tmp_path):
    manifest, secret = _escaping_manifest(tmp_path)
    summary, shapes_path, _ = _run(tmp_path, _cfg([{"name": "m", "path": str(manifest)}], max_skip_frac=1.0))
    status = dict(zip(*pd.read_parquet(shapes_path)[["sample_id", "status"]].to_numpy().T))
    assert status == {"good": "ok", "dotdot": "skipped:media_outside_root", "absolute": "skipped:media_outside_root"}
    assert summary.skipped == {"media_outside_root": 2}
    assert summary.skipped_examples[0] == (f"m/dotdot: media_outside_root (../secret.png leads to {secret.resolve()}, "
                                           f"outside media_root {manifest.parent})")

    allowed = _cfg([{"name": "m", "path": str(manifest), "allow_absolute_paths": True}], max_skip_frac=1.0)
    _, shapes_path, _ = _run(tmp_path, allowed)
    status = dict(zip(*pd.read_parquet(shapes_path)[["sample_id", "status"]].to_numpy().T))
    assert status == {"good": "ok", "dotdot": "skipped:media_outside_root", "absolute": "ok"}


def test_duplicate_manifest_ids_are_renamed_and_reported(tmp_path, capsys):
    turns = [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}],
             [{"from": "human", "value": "a longer question here"}, {"from": "gpt", "value": "and a longer answer"}]]
    manifest = tmp_path / "dup.jsonl"
    manifest.write_text("".join(json.dumps({"id": "a", "conversations": t}) + "\n" for t in turns))
    summary, shapes_path, _ = _run(tmp_path, _cfg([{"name": "dup", "path": str(manifest)}]))
    shapes = pd.read_parquet(shapes_path)
    assert list(shapes["sample_id"]) == ["a", "dup:1"] and (shapes["status"] == "ok").all()
    assert shapes["seq_len"].iloc[1] > shapes["seq_len"].iloc[0]  # each row is its own record
    assert summary.renamed_ids == 1
    out = capsys.readouterr().out
    assert "renamed 1 duplicate id(s) to <dataset>:<index>:\n  dup/dup:1: record 1's id 'a' repeats record 0's" in out


@pytest.mark.parametrize("settings, message", [
    ({"model": {"tokenizer": "/no/such/tokenizer"}},
     "model.tokenizer: tokenizer '/no/such/tokenizer': expected 'qwen2.5' or a local tokenizer directory"),
    ({"model": {"vision": "siglip-huge"}}, "model.vision: unknown vision preset 'siglip-huge'"),
])
def test_bad_model_setting_fails_in_one_line(tmp_path, capsys, demo_manifest, settings, message):
    code, err = _profile_data_cli(tmp_path, capsys, [{"name": "demo", "path": str(demo_manifest)}], **settings)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"dflop profile-data: {message}"), err
    assert _nothing_written(tmp_path)


def test_sampling_rule_out_of_range_fails_before_work(tmp_path, demo_manifest):
    # "0%" passes the schema's pattern; the rule itself refuses it.
    cfg = _cfg([{"name": "demo", "path": str(demo_manifest), "sample": "0%"}])
    with pytest.raises(UserError, match=r"^data.datasets\[0\] \(demo\).sample: sampling rule '0%': percentage"):
        _run(tmp_path, cfg)


def test_sampling_rule_limits_rows(tmp_path, demo_manifest):
    _, shapes_path, _ = _run(tmp_path, _cfg([{"name": "demo", "path": str(demo_manifest), "sample": "random:17"}]))
    first = pd.read_parquet(shapes_path)
    assert len(first) == 17
    _, again, _ = _run(tmp_path, _cfg([{"name": "demo", "path": str(demo_manifest), "sample": "random:17"}]))
    assert list(pd.read_parquet(again)["sample_id"]) == list(first["sample_id"])


def _decoded_frame_count(path: Path) -> int:
    import av

    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


@pytest.mark.slow
@pytest.mark.parametrize("arch, vision", [("llava_ov", "siglip-so400m"), ("internvl", "internvit-300m")])
def test_profiled_sequence_equals_hf_processor_on_demo_data(tmp_path, demo_manifest, arch, vision):
    """End to end: every profiled sample's seq_len and vision_tokens are what transformers' own
    processor produces from the decoded media and the chat-templated text."""
    from hf_reference import make_internvl_processor, make_llava_ov_processor, qwen_processor_tokenizer

    from dflop.data.tokenizer import load_tokenizer, render_conversation

    n = 45
    cfg = Config.from_dict({"model": {"arch": arch, "vision": vision},
                            "data": {"datasets": [{"name": "demo", "path": str(demo_manifest), "sample": f"first:{n}"}]}})
    _, shapes_path, _ = _run(tmp_path, cfg, workers=1)
    shapes = pd.read_parquet(shapes_path).set_index("sample_id")
    qwen = load_tokenizer("qwen2.5")
    processor = (make_llava_ov_processor if arch == "llava_ov" else make_internvl_processor)(qwen_processor_tokenizer(qwen))
    frames_per_video = cfg.model.arch_params["video_frames"]
    records = json.loads(Path(demo_manifest).read_text())[:n]
    assert {r.get("video") is not None for r in records} == {True, False}  # the slice has videos
    for record in records:
        row = shapes.loc[record["id"]]
        conversation = record["conversations"]
        prompt = render_conversation(qwen, conversation)
        inputs = {}
        images = record.get("image", [])
        images = [images] if isinstance(images, str) else images
        if images:
            arrays = [np.asarray(Image.open(Path(demo_manifest).parent / p).convert("RGB")) for p in images]
            inputs["images"] = [arrays] if arch == "llava_ov" else arrays
        if record.get("video"):
            total = _decoded_frame_count(Path(demo_manifest).parent / record["video"])
            inputs["videos"] = [np.zeros((min(total, frames_per_video), 8, 8, 3), dtype=np.uint8)]
        if arch == "internvl":
            prompt = prompt.replace("<image>", "<IMG_CONTEXT>")
        out = processor(text=[prompt], return_tensors="pt", **inputs)
        assert row["seq_len"] == out["input_ids"].shape[1], record["id"]
