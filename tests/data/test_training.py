"""Training inputs of a sample against transformers' own processors.

References: LlavaOnevisionProcessor (run on the sample's rendered conversation, its images and its
sampled frames) for the expanded input ids and the image tiles; an independent decode + PIL resize
for video frames; the tokenizer's decode for the answer mask; InternVLProcessor for InternVL's
token expansion, and the data profiler's InternVL video counts. The processors are the PIL classes (torchvision is not installed); HF's video
processors need torchvision, so a stand-in hands the frames through (the expansion only counts them).
"""

from __future__ import annotations

import json
from dataclasses import replace

import av
import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from transformers import InternVLProcessor, LlavaOnevisionProcessor
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

from dflop.config import Config
from dflop.data.demo import make_demo_data
from dflop.data.readers import read_dataset
from dflop.data.tokenizer import load_tokenizer, render_conversation
from dflop.data.training import ExpectedShape, SampleError, SampleRules, TrainingData
from dflop.data.vision_tokens import sample_frame_indices
from dflop.models.presets import tower_arch_params
from dflop.profiling.data_profiler import profile_data

torch.set_num_threads(1)
TINY_IMAGE, TINY_VIDEO, TINY_VOCAB = 2040, 2041, 2048
QWEN_IMAGE, QWEN_VIDEO = 151665, 151666  # <image>, <video> in the bundled Qwen2.5 tokenizer


class _FrameCountVideoProcessor:
    def __call__(self, videos, **kwargs):
        return {"pixel_values_videos": torch.stack([torch.zeros(len(v), 3, 2, 2) for v in videos])}


class _LlavaProcessor(LlavaOnevisionProcessor):
    def check_argument_for_proper_class(self, argument_name, argument):
        return type(argument) if argument_name == "video_processor" else super().check_argument_for_proper_class(
            argument_name, argument)


class _InternVLProcessor(InternVLProcessor):
    def check_argument_for_proper_class(self, argument_name, argument):
        return type(argument) if argument_name == "video_processor" else super().check_argument_for_proper_class(
            argument_name, argument)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(samples, shapes, manifest) of a 40-sample demo dataset under the tiny LLaVA-OV model."""
    manifest = make_demo_data(tmp_path_factory.mktemp("train_demo"), n_samples=40, seed=2)
    path = tmp_path_factory.mktemp("shapes") / "shapes.parquet"
    profile_data(Config.from_dict({"data": {"datasets": [{"name": "demo", "path": str(manifest)}]}}),
                 shapes_path=path, histograms_path=path.with_name("h.parquet"), workers=1, progress=False)
    return list(read_dataset(manifest, dataset="demo")), pd.read_parquet(path), manifest


def llava_rules(**changes) -> SampleRules:
    params = tower_arch_params("llava_ov", "siglip-tiny", {"anyres_max_tiles": 9, "video_frames": 32})
    return replace(SampleRules("llava_ov", params, TINY_IMAGE, TINY_VIDEO, TINY_VOCAB, remap_text_ids=True), **changes)


def expected(shapes: pd.DataFrame) -> list[ExpectedShape]:
    return [ExpectedShape(int(r.n_tiles), int(r.vision_tokens), int(r.seq_len)) for r in shapes.itertuples()]


def hf_llava(sample, params):
    """LlavaOnevisionProcessor's input ids and pixel values for one sample."""
    tokenizer = load_tokenizer("qwen2.5")
    size = params["image_size"]
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": size, "width": size},
                                                      image_grid_pinpoints=[list(p) for p in params["grid_pinpoints"]],
                                                      image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = _LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                video_processor=_FrameCountVideoProcessor(),
                                num_image_tokens=(size // params["patch_size"]) ** 2,
                                vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9")
    text = render_conversation(tokenizer, sample.conversations)
    kwargs = {}
    if sample.images:
        kwargs["images"] = [[Image.open(ref.path).convert("RGB") for ref in sample.images]]
    if sample.video is not None:
        with av.open(str(sample.video.path)) as container:
            stream = container.streams.video[0]
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        kwargs["videos"] = [np.stack([frames[i] for i in sample_frame_indices(len(frames), params["video_frames"])])]
        text = text.replace("<image>", "<video>")
    out = processor(text=[text], return_tensors="np", **kwargs)
    return np.asarray(out["input_ids"][0]), out.get("pixel_values")


def to_tiny_vocab(ids: np.ndarray) -> np.ndarray:
    """The module's documented mapping, restated: placeholders -> the model's ids, text mod 2040."""
    text = np.where(ids >= 2040, ids % 2040, ids)
    return np.where(ids == QWEN_IMAGE, TINY_IMAGE, np.where(ids == QWEN_VIDEO, TINY_VIDEO, text))


@pytest.mark.parametrize("modality", ["image", "multi_image", "video", "text"])
def test_llava_ov_ids_and_tiles_match_the_hf_processor(demo, modality):
    samples, shapes, _ = demo
    data = TrainingData(samples, llava_rules(), expected(shapes))
    rows = shapes.index[shapes["modality"] == modality][:2]
    for i in rows:
        loaded = data[int(i)]
        hf_ids, hf_pixels = hf_llava(samples[i], data.rules.arch_params)
        np.testing.assert_array_equal(loaded.input_ids.numpy(), to_tiny_vocab(hf_ids))
        assert loaded.input_ids.numel() == shapes.loc[i, "seq_len"]
        assert loaded.pixels.shape[0] == shapes.loc[i, "n_tiles"]
        if modality in ("image", "multi_image"):  # processor pads images to the most tiles: [images, tiles, ...]
            tiles = [m.n_tiles for m in loaded.layout.media]
            ours = torch.split(loaded.pixels, tiles)
            for k, n in enumerate(tiles):
                np.testing.assert_allclose(ours[k].numpy(), hf_pixels[k][:n], rtol=0, atol=1e-6)


def test_video_frames_are_the_sampled_frames_resized(demo):
    samples, shapes, _ = demo
    data = TrainingData(samples, llava_rules(), expected(shapes))
    i = int(shapes.index[shapes["modality"] == "video"][0])
    pixels = data[i].pixels
    with av.open(str(samples[i].video.path)) as container:
        frames = [f.to_image() for f in container.decode(video=0)]
    picked = sample_frame_indices(len(frames), 32)
    assert pixels.shape == (len(picked), 3, 56, 56)
    for k, index in enumerate(picked[:4] + picked[-2:]):
        resized = np.asarray(frames[index].resize((56, 56), Image.BICUBIC), dtype=np.float32) / 255.0
        reference = (resized - 0.5) / 0.5
        position = picked.index(index)
        np.testing.assert_allclose(pixels[position].permute(1, 2, 0).numpy(), reference, atol=1e-5)


def test_labels_are_exactly_the_answers(demo):
    samples, shapes, _ = demo
    # The real vocabulary (no remapping), so the labels decode back to text.
    data = TrainingData(samples, llava_rules(image_token_id=151646, video_token_id=151647, vocab_size=151936,
                                             remap_text_ids=False), expected(shapes))
    tokenizer = load_tokenizer("qwen2.5")
    for i in range(6):
        ids, labels = data.tokens(i)
        answers = "".join(t["value"] + "<|im_end|>\n" for t in samples[i].conversations if t["from"] == "gpt")
        assert tokenizer.decode(labels[labels != -100].tolist()) == answers
        assert not ((labels != -100) & ((ids == 151646) | (ids == 151647))).any()


def test_small_vocabulary_remap_and_real_vocabulary_errors(demo):
    samples, shapes, _ = demo
    tiny = TrainingData(samples, llava_rules(), expected(shapes))
    ids, _ = tiny.tokens(0)
    assert int(ids.max()) < TINY_VOCAB
    assert int((ids == TINY_IMAGE).sum() + (ids == TINY_VIDEO).sum()) == shapes.loc[0, "vision_tokens"]
    real = TrainingData(samples, llava_rules(vocab_size=128256, image_token_id=128002, video_token_id=128003,
                                             remap_text_ids=False))
    with pytest.raises(SampleError, match=r"sample demo/\S+: text token id 1516\d\d is outside the LLM vocabulary"):
        real.tokens(0)


def test_shape_mismatch_names_the_sample(demo):
    samples, shapes, _ = demo
    bad = expected(shapes)
    bad[3] = replace(bad[3], seq_len=bad[3].seq_len + 1)
    bad[4] = replace(bad[4], n_tiles=bad[4].n_tiles + 1)
    data = TrainingData(samples, llava_rules(), bad)
    with pytest.raises(SampleError, match=rf"sample demo/{shapes.sample_id[3]}: the trainer builds \d+ tokens"):
        data.tokens(3)
    with pytest.raises(SampleError, match=rf"sample demo/{shapes.sample_id[4]}: the trainer builds n_tiles="):
        data.layout(4)


def internvl_rules() -> SampleRules:
    params = tower_arch_params("internvl", "internvit-tiny", {"min_tiles": 1, "max_tiles": 12,
                                                             "use_thumbnail": True, "video_frames": 8})
    return SampleRules("internvl", params, TINY_IMAGE, TINY_VIDEO, TINY_VOCAB, remap_text_ids=True)


def test_internvl_expansion_and_tiles_match_the_hf_processor(demo):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    samples, shapes, _ = demo
    data = TrainingData(samples, internvl_rules())
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    names = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>"}
    words = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                    extra_special_tokens={"video_token": "<video>", **names})
    image_processor = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True, max_patches=12,
                                               image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    processor = _InternVLProcessor(image_processor=image_processor,
                                   tokenizer=words, video_processor=_FrameCountVideoProcessor(), image_seq_length=4)
    for i in shapes.index[shapes["modality"].isin(["image", "multi_image"])][:4]:
        sample, loaded = samples[i], data[int(i)]
        images = [Image.open(ref.path).convert("RGB") for ref in sample.images]
        out = processor(text=[" ".join(["<IMG_CONTEXT>"] * len(images))], images=images, return_tensors="np")
        hf = np.asarray(out["input_ids"][0])
        count = lambda t: int((hf == words.convert_tokens_to_ids(t)).sum())  # noqa: E731
        assert int((loaded.input_ids == TINY_IMAGE).sum()) == count("<IMG_CONTEXT>")
        start, end = (int(x) for x in data._text_id(np.array(data._marker_ids()), int(i)))
        assert int((loaded.input_ids == start).sum()) == count("<img>") == len(images)
        assert int((loaded.input_ids == end).sum()) == count("</img>")
        np.testing.assert_allclose(loaded.pixels.numpy(), out["pixel_values"], rtol=0, atol=1e-6)


def test_internvl_video_sequence_length_agrees_with_the_data_profiler(demo, tmp_path):
    """The trainer writes InternVLProcessor's 'FrameK: ' labels; shapes.parquet must count them."""
    samples, _, manifest = demo
    cfg = Config.from_dict({"model": {"arch": "internvl", "vision": "internvit-tiny", "llm": "llama3-tiny"},
                            "data": {"datasets": [{"name": "demo", "path": str(manifest)}]}})
    path = tmp_path / "shapes.parquet"
    profile_data(cfg, shapes_path=path, histograms_path=tmp_path / "h.parquet", workers=1, progress=False)
    shapes = pd.read_parquet(path)
    data = TrainingData(samples, internvl_rules(), expected(shapes))
    for i in shapes.index[shapes["modality"] == "video"][:3]:
        ids, _ = data.tokens(int(i))  # raises SampleError on any disagreement
        assert ids.numel() == shapes.loc[i, "seq_len"]


def test_parquet_images_load_from_their_source_without_bytes_in_memory(demo, tmp_path):
    """The trainer keeps embedded images as (file, row) only; loading reads the same pixels as the
    files they were made from."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    samples, shapes, _ = demo
    rows = [int(i) for m in ("image", "multi_image") for i in shapes.index[shapes["modality"] == m][:2]]
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    turn = pa.struct([("from", pa.string()), ("value", pa.string())])
    table = pa.table({
        "id": [samples[i].sample_id for i in rows],
        "images": pa.array([[{"bytes": ref.path.read_bytes(), "path": ref.path.name} for ref in samples[i].images]
                            for i in rows], type=pa.list_(image)),
        "conversations": pa.array([list(samples[i].conversations) for i in rows], type=pa.list_(turn)),
    })
    pq.write_table(table, tmp_path / "embedded.parquet", row_group_size=2)
    from dflop.config import DatasetSpec
    from dflop.data.training import pool_samples

    pool = pd.DataFrame({"dataset": "demo", "sample_id": [samples[i].sample_id for i in rows]})
    lean = pool_samples(pool, [DatasetSpec.from_dict({"name": "demo", "path": str(tmp_path / "embedded.parquet")})],
                        seed=0)  # what every rank keeps
    assert [s.sample_id for s in lean] == list(pool["sample_id"])
    assert all(r.data is None and r.source is not None for s in lean for r in s.images)

    exp = [expected(shapes)[i] for i in rows]
    from_files = TrainingData([samples[i] for i in rows], llava_rules(), exp)
    from_source = TrainingData(lean, llava_rules(), exp)
    for k in range(len(rows)):
        np.testing.assert_array_equal(from_source[k].pixels.numpy(), from_files[k].pixels.numpy())
        np.testing.assert_array_equal(from_source[k].input_ids.numpy(), from_files[k].input_ids.numpy())


def _profile(tmp_path, datasets) -> pd.DataFrame:
    """The usable shapes.parquet rows of `datasets`, as the trainer reads them (`read_shapes`)."""
    from dflop.shapes import read_shapes

    path = tmp_path / "shapes.parquet"
    profile_data(Config.from_dict({"data": {"datasets": datasets, "max_skip_frac": 1.0}}), shapes_path=path,
                 histograms_path=tmp_path / "h.parquet", workers=1, progress=False)
    return read_shapes(path)


def test_each_row_of_a_renamed_duplicate_id_loads_its_own_record(tmp_path):
    """Profiler and trainer give a repeated manifest id the same fallback id, so every planned row
    loads the record it was sized from (a longer second record would not fit the first's seq_len)."""
    from dflop.config import DatasetSpec
    from dflop.data.training import pool_samples

    answers = ["short", "a much longer answer than the first record has, to make the lengths differ"]
    manifest = tmp_path / "dup.jsonl"
    manifest.write_text("".join(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"},
                                                                        {"from": "gpt", "value": a}]}) + "\n"
                                for a in answers))
    datasets = [{"name": "dup", "path": str(manifest)}]
    pool = _profile(tmp_path, datasets)
    samples = pool_samples(pool, [DatasetSpec.from_dict(d) for d in datasets], seed=0)
    assert [s.conversations[1]["value"] for s in samples] == answers
    data = TrainingData(samples, llava_rules(), expected(pool))
    assert [data[i].input_ids.numel() for i in range(2)] == list(pool["seq_len"])


def test_media_that_left_media_root_since_profiling_is_skipped_by_the_trainer(tmp_path):
    """The trainer applies the media rule the profiler does: an absolute path outside media_root
    planned while the dataset allowed it is unreadable media (skipped) once it no longer does."""
    from dflop.config import DatasetSpec
    from dflop.data.training import UnreadableMedia, pool_samples

    (tmp_path / "data").mkdir()
    Image.new("RGB", (64, 48)).save(tmp_path / "outside.png")
    manifest = tmp_path / "data" / "m.jsonl"
    manifest.write_text(json.dumps({"id": "abs", "image": str(tmp_path / "outside.png"), "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A box."}]}) + "\n")
    allowed = {"name": "m", "path": str(manifest), "allow_absolute_paths": True}
    pool = _profile(tmp_path, [allowed])
    assert list(pool["sample_id"]) == ["abs"]

    read = TrainingData(pool_samples(pool, [DatasetSpec.from_dict(allowed)], seed=0), llava_rules(), expected(pool))
    assert read.layout(0).n_tiles == pool["n_tiles"].iloc[0]
    refused = pool_samples(pool, [DatasetSpec.from_dict({**allowed, "allow_absolute_paths": False})], seed=0)
    with pytest.raises(UnreadableMedia, match=r"^sample m/abs: unusable \(media_outside_root: .*outside\.png leads to "):
        TrainingData(refused, llava_rules(), expected(pool)).layout(0)
