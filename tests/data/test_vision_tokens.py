"""Vision token and tile counts against transformers' own processors, built offline.

References: LlavaOnevisionProcessor and InternVLProcessor (transformers 5.x) run on real pixel
arrays; we count the placeholder tokens they expand into input_ids and the tiles in
pixel_values. A denser sweep of sizes uses the processors' own counting API
(``_get_num_multimodal_tokens``, what vLLM calls, through ``hf_reference.count_multimodal_tokens``),
which needs no pixels. A few closed forms are worked by hand.

The reference is the transformers installed (5.17 and 5.24 checked): where releases differ the
tests ask the processor at hand what it does (5.17's counting API counts no LLaVA-OV videos) or pin
DFLOP's rule and name the release it follows (frame sampling: 5.24's; `sample_frame_indices`).

Image processors are the PIL ("slow") classes: the torchvision ones cannot be imported here. HF's
video processors need torchvision too; without it a stand-in that hands the frames through
unchanged replaces them (HF's keep every frame when do_sample_frames=False,
BaseVideoProcessor._preprocess), so the token expansion under test is still HF's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

import hf_reference
from hf_reference import (
    INTERNVL_TOKEN_NAMES,
    _FrameKeepingVideoProcessor,
    _LlavaOnevisionProcessor,
    _placeholder_tokenizer,
    count_multimodal_tokens,
    make_internvl_processor,
    make_llava_ov_processor,
)

from dflop.data.vision_tokens import (
    LLAVA_OV_GRID_PINPOINTS,
    VisionShape,
    internvl_image_shape,
    internvl_tile_grid,
    llava_ov_image_shape,
    sample_frame_indices,
    sample_vision_shape,
    sample_vision_shapes,
    sampled_frame_count,
)

torch.set_num_threads(1)

# (width, height): tiny, panoramas, tall, squares, canvas and tile edges, odd sizes.
IMAGE_SIZES = [
    (20, 20),
    (3840, 600),
    (600, 3840),
    (300, 2000),
    (384, 384),
    (385, 384),
    (383, 383),
    (768, 384),
    (384, 768),
    (1152, 384),
    (2304, 2304),
    (2305, 2304),
    (1920, 1080),
    (1080, 1920),
    (640, 480),
    (448, 448),
    (896, 448),
    (449, 448),
    (100, 3000),
    (3000, 100),
    (333, 777),
    (1344, 896),
    (10, 700),
    (3024, 4032),
    (1008, 896),  # InternVL: area exactly half of 3x3 tiles, where 2x2 and 3x3 tie
]



# --------------------------------------------------------------------------------------------
# Processors, built offline


@pytest.fixture(scope="module")
def placeholder_tokenizer():
    return _placeholder_tokenizer()


@pytest.fixture(scope="module")
def llava_processor(placeholder_tokenizer):
    return make_llava_ov_processor(placeholder_tokenizer)


@pytest.fixture(scope="module")
def internvl_processor(placeholder_tokenizer):
    return make_internvl_processor(placeholder_tokenizer)


def _image(width: int, height: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _video(n_frames: int, width: int = 64, height: int = 48) -> np.ndarray:
    return np.random.default_rng(n_frames).integers(
        0, 256, (n_frames, height, width, 3), dtype=np.uint8
    )


def _count(input_ids, tokenizer, tokens) -> int:
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    return int(np.isin(np.asarray(input_ids), ids).sum())


# --------------------------------------------------------------------------------------------
# LLaVA-OneVision


def test_default_pinpoints_are_the_processors():
    assert LLAVA_OV_GRID_PINPOINTS == tuple(
        tuple(p) for p in LlavaOnevisionImageProcessorPil.image_grid_pinpoints
    )
    assert len(LLAVA_OV_GRID_PINPOINTS) == 36


@pytest.mark.parametrize("width,height", IMAGE_SIZES)
def test_llava_ov_single_image_matches_processor(
    llava_processor, placeholder_tokenizer, width, height
):
    out = llava_processor(
        images=[[_image(width, height)]], text=["<image>\nhi"], return_tensors="np"
    )
    hf_tokens = _count(out["input_ids"], placeholder_tokenizer, ["<image>"])
    hf_tiles = out["pixel_values"].shape[1]  # [batch=1, base + crops, 3, 384, 384]
    ours = sample_vision_shape("llava_ov", [(width, height)])
    assert (ours.n_tiles, ours.vision_tokens) == (hf_tiles, hf_tokens)


def test_llava_ov_multi_image_matches_processor(llava_processor, placeholder_tokenizer):
    sizes = [(20, 20), (3840, 600), (300, 2000)]
    images = [[_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]]
    out = llava_processor(images=images, text=["<image> hi <image>\n<image>"], return_tensors="np")
    hf_tokens = _count(out["input_ids"], placeholder_tokenizer, ["<image>"])
    pixel_values = out["pixel_values"]  # [n_images, tiles per image (1), 3, 384, 384]
    ours = sample_vision_shape("llava_ov", sizes)
    assert (ours.n_tiles, ours.vision_tokens) == (
        pixel_values.shape[0] * pixel_values.shape[1],
        hf_tokens,
    )
    assert ours == VisionShape(3, 3 * 730)


@pytest.mark.parametrize("n_frames", [1, 7, 32])
def test_llava_ov_video_matches_processor(llava_processor, placeholder_tokenizer, n_frames):
    out = llava_processor(videos=[_video(n_frames)], text=["<video>\nhi"], return_tensors="np")
    hf_tokens = _count(out["input_ids"], placeholder_tokenizer, ["<video>"])
    ours = sample_vision_shape("llava_ov", videos=[n_frames], video_frames=32)
    assert ours.vision_tokens == hf_tokens
    assert ours.n_tiles == n_frames
    # The counting API counts videos from transformers 5.24 on (5.17's answers images only: None)
    hf_counted = count_multimodal_tokens(llava_processor, video_sizes=[(n_frames, 48, 64)])
    if hf_counted["num_video_tokens"] is not None:
        assert hf_counted["num_video_tokens"] == [ours.vision_tokens]


def test_llava_ov_dense_size_sweep_matches_processor_counts(llava_processor):
    rng = np.random.default_rng(1)
    sizes = [tuple(int(v) for v in rng.integers(1, 5000, 2)) for _ in range(400)]
    sizes += [(w + d, h) for h, w in LLAVA_OV_GRID_PINPOINTS for d in (-1, 0, 1)]
    sizes += [(w, h + d) for h, w in LLAVA_OV_GRID_PINPOINTS for d in (-1, 0, 1)]
    hf = count_multimodal_tokens(llava_processor, image_sizes=[(h, w) for w, h in sizes])
    ours = [llava_ov_image_shape(w, h).vision_tokens for w, h in sizes]
    mismatches = [(s, o, r) for s, o, r in zip(sizes, ours, hf["num_image_tokens"]) if o != r]
    assert not mismatches


def test_llava_ov_canvas_ties_resolve_as_hf(placeholder_tokenizer):
    # With only a 1x2 and a 2x1 canvas, a square image keeps the same pixels and wastes the same
    # area in both; HF keeps the first, and the two differ in unpadded tokens.
    pinpoints = [[384, 768], [768, 384]]
    processor = _LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessorPil(image_grid_pinpoints=pinpoints),
        tokenizer=placeholder_tokenizer,
        video_processor=_FrameKeepingVideoProcessor(),
        num_image_tokens=729,
        vision_feature_select_strategy="full",
    )
    sizes = [(1000, 1000), (500, 500), (3000, 3000)]
    hf = count_multimodal_tokens(processor, image_sizes=[(h, w) for w, h in sizes])
    ours = [llava_ov_image_shape(w, h, grid_pinpoints=pinpoints).vision_tokens for w, h in sizes]
    assert ours == hf["num_image_tokens"]
    swapped = [
        llava_ov_image_shape(w, h, grid_pinpoints=pinpoints[::-1]).vision_tokens for w, h in sizes
    ]
    assert swapped != ours


def test_llava_ov_closed_forms():
    # 384x384 fits the 384x384 canvas: 1 crop + base; 27x27 features, 27 newlines, 729 base.
    assert llava_ov_image_shape(384, 384) == VisionShape(2, 729 + 27 + 729)
    # 2304x2304: 6x6 crops -> a 162x162 grid, sqrt(162^2 / (9 * 27^2)) = 2 > 1.1 -> 81x81.
    assert llava_ov_image_shape(2304, 2304) == VisionShape(37, 81 * 81 + 81 + 729)
    # anyres_max_36 keeps the whole 162x162 grid.
    assert llava_ov_image_shape(2304, 2304, anyres_max_tiles=36) == VisionShape(
        37, 162 * 162 + 162 + 729
    )
    # 768 wide x 384 high -> canvas 384x768: 1x2 crops, 27x54 grid.
    assert llava_ov_image_shape(768, 384) == VisionShape(3, 27 * 54 + 27 + 729)
    # A video: 196 pooled tokens per frame + one newline.
    assert sample_vision_shape("llava_ov", videos=[10]) == VisionShape(10, 10 * 196 + 1)


# --------------------------------------------------------------------------------------------
# InternVL


@pytest.mark.parametrize("width,height", IMAGE_SIZES)
def test_internvl_image_matches_processor(internvl_processor, placeholder_tokenizer, width, height):
    out = internvl_processor(
        images=[_image(width, height)], text=["<IMG_CONTEXT>\nhi"], return_tensors="np"
    )
    hf_tokens = _count(out["input_ids"], placeholder_tokenizer, INTERNVL_TOKEN_NAMES.values())
    hf_tiles = out["pixel_values"].shape[0]  # [tiles, 3, 448, 448]
    ours = sample_vision_shape("internvl", [(width, height)])
    assert (ours.n_tiles, ours.vision_tokens) == (hf_tiles, hf_tokens)


def test_internvl_multi_image_tiles_each_image(internvl_processor, placeholder_tokenizer):
    sizes = [(20, 20), (3840, 600), (896, 448)]
    images = [_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    out = internvl_processor(
        images=images, text=["<IMG_CONTEXT><IMG_CONTEXT> hi <IMG_CONTEXT>"], return_tensors="np"
    )
    hf_tokens = _count(out["input_ids"], placeholder_tokenizer, INTERNVL_TOKEN_NAMES.values())
    ours = sample_vision_shape("internvl", sizes)
    assert (ours.n_tiles, ours.vision_tokens) == (out["pixel_values"].shape[0], hf_tokens)


@pytest.mark.parametrize("n_frames", [1, 8])
def test_internvl_video_matches_processor(internvl_processor, placeholder_tokenizer, n_frames):
    out = internvl_processor(videos=[_video(n_frames)], text=["<video>\nhi"], return_tensors="pt")
    hf_tokens = _count(out["input_ids"], placeholder_tokenizer, INTERNVL_TOKEN_NAMES.values())
    ours = sample_vision_shape("internvl", videos=[n_frames], video_frames=8)
    assert (ours.n_tiles, ours.vision_tokens) == (n_frames, hf_tokens)


@pytest.mark.parametrize("min_tiles,max_tiles", [(1, 12), (1, 6), (2, 12), (1, 1), (1, 40)])
def test_internvl_dense_size_sweep_matches_processor_counts(
    internvl_processor, min_tiles, max_tiles
):
    rng = np.random.default_rng(2)
    sizes = [tuple(int(v) for v in rng.integers(1, 5000, 2)) for _ in range(300)]
    # Exact ratio ties between grids (1:2 vs 2:4, 1:1 vs 2:2 vs 3:3) on both sides of the
    # half-area rule.
    sizes += [(448 * k, 448 * k) for k in range(1, 5)] + [
        (300, 600),
        (896, 1792),
        (200, 200),
        (700, 700),
    ]
    sizes += [(896, 1008), (1008, 896), (1024, 882)]  # area exactly at the half-area threshold
    kwargs = {"min_patches": min_tiles, "max_patches": max_tiles}
    hf = count_multimodal_tokens(
        internvl_processor, image_sizes=[(h, w) for w, h in sizes], **kwargs
    )
    ours = [internvl_image_shape(w, h, min_tiles=min_tiles, max_tiles=max_tiles) for w, h in sizes]
    assert [s.n_tiles for s in ours] == hf["num_image_patches"]
    assert [s.vision_tokens for s in ours] == hf["num_image_tokens"]


def test_a_count_with_keywords_leaves_later_processors_as_built(placeholder_tokenizer):
    """transformers 5.17 writes the counting API's keywords into the processor class's defaults
    (`count_multimodal_tokens` puts them back): a 40-tile count, then a new processor built for 1..12
    tiles still cuts a 3840x600 image into 6 + thumbnail, not 26 + thumbnail."""
    count_multimodal_tokens(
        make_internvl_processor(placeholder_tokenizer), image_sizes=[(600, 3840)], max_patches=40
    )
    processor = make_internvl_processor(placeholder_tokenizer)
    out = processor(images=[_image(3840, 600)], text=["<IMG_CONTEXT>\nhi"], return_tensors="np")
    assert out["pixel_values"].shape[0] == internvl_image_shape(3840, 600).n_tiles == 7


def test_internvl_closed_forms():
    assert internvl_image_shape(448, 448) == VisionShape(1, 258)
    assert internvl_image_shape(896, 448) == VisionShape(3, 3 * 256 + 2)  # 2x1 + thumbnail
    assert internvl_image_shape(896, 448, use_thumbnail=False) == VisionShape(2, 2 * 256 + 2)
    assert internvl_image_shape(4000, 100) == VisionShape(13, 13 * 256 + 2)  # 12x1 + thumbnail
    assert internvl_tile_grid(4000, 100) == (12, 1)
    assert internvl_image_shape(5000, 5000, max_tiles=1) == VisionShape(1, 258)
    assert sample_vision_shape("internvl", videos=[20], video_frames=8) == VisionShape(8, 8 * 258)


# --------------------------------------------------------------------------------------------
# Frame sampling, entry point, bad input


FRAME_CASES = [(100, 32), (32, 32), (33, 32), (1000, 8), (9, 8), (7, 7), (15, 13)]


def _hf_samples_uniform_floor() -> bool:
    """Whether the installed transformers' default sampler takes i * total // n (5.24 does; 5.17's
    float-step arange takes every 3rd of 100 frames for 32)."""
    hf = default_sample_indices_fn(VideoMetadata(total_num_frames=100, fps=30.0), num_frames=32)
    return hf.tolist()[8] == 25 and len(hf) == 32


@pytest.mark.parametrize("total,wanted", FRAME_CASES)
def test_frame_indices_are_uniform_rounded_down(total, wanted):
    """DFLOP's rule, pinned whatever transformers is installed: frame i of n is i * total // n."""
    n = min(total, wanted)
    expected = [int(np.floor(np.float64(i) * total / n)) for i in range(n)]  # exact for these sizes
    assert sample_frame_indices(total, wanted) == expected
    assert sampled_frame_count(total, wanted) == n


def test_frame_indices_spot_values():
    assert sample_frame_indices(100, 32)[6:12] == [18, 21, 25, 28, 31, 34]
    assert sample_frame_indices(15, 13) == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13]


@pytest.mark.skipif(not _hf_samples_uniform_floor(),
                    reason="this transformers samples frames by a float-step arange (5.17); DFLOP "
                           "follows 5.24's rule (test_frame_indices_are_uniform_rounded_down)")
@pytest.mark.parametrize("total,wanted", FRAME_CASES)
def test_frame_indices_match_hf_sampler(total, wanted):
    hf = default_sample_indices_fn(
        VideoMetadata(total_num_frames=total, fps=30.0), num_frames=wanted
    )
    assert sample_frame_indices(total, wanted) == hf.tolist()
    assert sampled_frame_count(total, wanted) == len(hf)


def test_short_video_uses_all_frames():
    assert sample_frame_indices(5, 32) == [0, 1, 2, 3, 4]
    assert sample_vision_shape("llava_ov", videos=[5]) == VisionShape(5, 5 * 196 + 1)


def test_text_only_sample_has_no_vision():
    assert sample_vision_shape("llava_ov") == VisionShape(0, 0)
    assert sample_vision_shape("internvl", [], []) == VisionShape(0, 0)


def test_batch_version_equals_per_sample():
    images = [[(640, 480)], [], [(20, 20), (3840, 600)], [(448, 896)]]
    videos = [[], [40], [], [3]]
    n_tiles, vision_tokens = sample_vision_shapes("internvl", images, videos, max_tiles=6)
    expected = [sample_vision_shape("internvl", i, v, max_tiles=6) for i, v in zip(images, videos)]
    assert n_tiles.tolist() == [s.n_tiles for s in expected]
    assert vision_tokens.tolist() == [s.vision_tokens for s in expected]


def test_config_blocks_are_accepted():
    # The keys of the config's model.llava_ov / model.internvl blocks.
    sample_vision_shape("llava_ov", [(10, 10)], anyres_max_tiles=9, video_frames=32)
    sample_vision_shape(
        "internvl", [(10, 10)], min_tiles=1, max_tiles=12, use_thumbnail=True, video_frames=8
    )


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: sample_vision_shape("llava", [(10, 10)]), "unknown arch 'llava'"),
        (
            lambda: sample_vision_shape("internvl", [(10, 10)], anyres_max_tiles=9),
            "unknown internvl parameter",
        ),
        (
            lambda: sample_vision_shape("llava_ov", [(0, 10)]),
            "image width must be a positive integer",
        ),
        (
            lambda: sample_vision_shape("internvl", [(10, 2.5)]),
            "image height must be a positive integer",
        ),
        (lambda: sample_vision_shape("llava_ov", [(10, 10), (10, -1)]), "image height"),
        (
            lambda: sample_vision_shape("llava_ov", videos=[0]),
            "total_frames must be a positive integer",
        ),
        (lambda: sampled_frame_count(10, 0), "video_frames must be a positive integer"),
    ],
)
def test_bad_input_is_a_one_line_error(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------
# Whole sequence: text tokens + vision tokens = the processor's input_ids


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from dflop.data.tokenizer import load_tokenizer

    return load_tokenizer("qwen2.5")


@pytest.fixture(scope="module")
def qwen_processor_tokenizer(qwen_tokenizer):
    return hf_reference.qwen_processor_tokenizer(qwen_tokenizer)


SEQUENCE_SAMPLES = [
    # (conversation, image sizes, video frame counts)
    (
        [
            {"from": "human", "value": "<image>\nWhat is shown?"},
            {"from": "gpt", "value": "A red bus."},
        ],
        [(3840, 600)],
        [],
    ),
    (
        [
            {"from": "human", "value": "Compare <image> and <image>, then <image>."},
            {"from": "gpt", "value": "The first is larger.\n\nThe third is blank."},
        ],
        [(20, 20), (640, 480), (300, 2000)],
        [],
    ),
    (
        [
            {"from": "system", "value": "Answer briefly."},
            {"from": "human", "value": "<video>\nWhat happens in this clip?"},
            {"from": "gpt", "value": "Someone opens a door, 3 times."},
            {"from": "human", "value": "Why?"},
            {"from": "gpt", "value": "To check the lock."},
        ],
        [],
        [11],
    ),
    (
        [
            {"from": "human", "value": "Plain text, no media: 12345 tokens?"},
            {"from": "gpt", "value": "No."},
        ],
        [],
        [],
    ),
]


@pytest.mark.parametrize("arch", ["llava_ov", "internvl"])
@pytest.mark.parametrize("conversation,sizes,videos", SEQUENCE_SAMPLES)
def test_text_plus_vision_tokens_is_processor_sequence_length(
    qwen_tokenizer, qwen_processor_tokenizer, arch, conversation, sizes, videos
):
    from dflop.data.tokenizer import (
        count_text_tokens,
        expand_video_placeholders,
        render_conversation,
    )

    frames = [sampled_frame_count(n, 32) for n in videos]
    ours_text = count_text_tokens(
        qwen_tokenizer, expand_video_placeholders(conversation, frames, arch=arch)
    )
    ours_vision = sample_vision_shape(arch, sizes, videos, video_frames=32).vision_tokens

    make = make_llava_ov_processor if arch == "llava_ov" else make_internvl_processor
    processor = make(qwen_processor_tokenizer)
    prompt = render_conversation(qwen_tokenizer, conversation)
    inputs = {}
    if sizes:
        images = [_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
        inputs["images"] = [images] if arch == "llava_ov" else images
    if videos:
        inputs["videos"] = [_video(n) for n in frames]
    if arch == "internvl":
        prompt = prompt.replace("<image>", "<IMG_CONTEXT>")
    out = processor(text=[prompt], return_tensors="pt", **inputs)
    assert ours_text + ours_vision == out["input_ids"].shape[1]
