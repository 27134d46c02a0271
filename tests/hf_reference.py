"""Reference processors from transformers, built offline, for tests in every layer.

LlavaOnevisionProcessor and InternVLProcessor with the PIL image processors (the torchvision ones
cannot be imported here). HF's video processors need torchvision too; without it a stand-in that
hands the frames through unchanged replaces them (HF's keep every frame when
do_sample_frames=False), so the token expansion is still HF's. Importable from any test because
pytest puts tests/ (the conftest's folder) on sys.path.
"""

from __future__ import annotations

import copy

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import InternVLProcessor, LlavaOnevisionProcessor, PreTrainedTokenizerFast
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)
from transformers.utils import is_torchvision_available

INTERNVL_TOKEN_NAMES = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
}


def _placeholder_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer that knows the multimodal tokens: we only count those."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        extra_special_tokens={
            "image_token": "<image>",
            "video_token": "<video>",
            **INTERNVL_TOKEN_NAMES,
        },
    )


class _FrameKeepingVideoProcessor:
    """Stand-in for HF's video processors when torchvision is missing: frames pass unchanged."""

    def __call__(self, videos, **kwargs):
        return {"pixel_values_videos": torch.stack([torch.zeros(len(v), 3, 2, 2) for v in videos])}


def _video_processor(hf_class_name: str):
    if is_torchvision_available():
        import transformers

        return getattr(transformers, hf_class_name)(do_sample_frames=False)
    return _FrameKeepingVideoProcessor()


class _LlavaOnevisionProcessor(LlavaOnevisionProcessor):
    # HF checks sub-processors against `VideoProcessorMixin` looked up by name, which fails
    # without torchvision; skip only that check.
    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor":
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)


class _InternVLProcessor(InternVLProcessor):
    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor":
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)


def make_llava_ov_processor(tokenizer) -> LlavaOnevisionProcessor:
    """As llava-onevision-qwen2-7b-ov-hf: SigLIP 384/14 (729 tokens), anyres_max_9."""
    return _LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessorPil(),
        tokenizer=tokenizer,
        video_processor=_video_processor("LlavaOnevisionVideoProcessor"),
        num_image_tokens=729,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
    )


def make_internvl_processor(tokenizer) -> InternVLProcessor:
    """As InternVL3-*-hf: 448 px tiles, 1..12 tiles + thumbnail, 256 tokens per tile."""
    return _InternVLProcessor(
        image_processor=GotOcr2ImageProcessorPil(
            size={"height": 448, "width": 448}, min_patches=1, max_patches=12
        ),
        tokenizer=tokenizer,
        video_processor=_video_processor("InternVLVideoProcessor"),
        image_seq_length=256,
    )


def count_multimodal_tokens(processor, **kwargs) -> dict:
    """``processor._get_num_multimodal_tokens(**kwargs)`` (HF's counting API, what vLLM calls), leaving
    the processor class's keyword defaults as they were: transformers 5.17 updates them in place
    with the call's keywords (``InternVLProcessorKwargs._defaults["images_kwargs"]``), so a count
    with ``max_patches=40`` made every later InternVL processor in the process tile up to 40;
    5.24 merges into a copy."""
    defaults = getattr(processor.valid_processor_kwargs, "_defaults", None)
    kept = copy.deepcopy(defaults)
    try:
        return processor._get_num_multimodal_tokens(**kwargs)
    finally:
        if defaults is not None:
            defaults.clear()
            defaults.update(kept)


def qwen_processor_tokenizer(qwen_tokenizer) -> PreTrainedTokenizerFast:
    """A separate copy of the Qwen2.5 tokenizer that also knows InternVL's image tokens."""
    backend = Tokenizer.from_str(qwen_tokenizer.backend_tokenizer.to_str())
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>", **INTERNVL_TOKEN_NAMES},
    )
