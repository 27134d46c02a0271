"""Build a multimodal model from presets (random init) or from a local Hugging Face directory.

The result is the transformers model itself (`LlavaOnevisionForConditionalGeneration` or
`InternVLForConditionalGeneration`); pipeline stages (`dflop.models.stages`) are views of it.
The LLM attention is ``dflop_packed`` (packed-row aware, plain SDPA otherwise) unless asked
otherwise; vision towers use SDPA.

Every build starts on the meta device (`build_on_meta`); a trainer rank then materialises only its
own stages' tensors (`dflop.models.materialize`, `dflop.runtime.model`), and `build_from_config`
all of them: with the same values, since a tensor's random init depends only on the seed and its
name, and weights are read tensor by tensor from the directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, PreTrainedConfig

from dflop.errors import UserError
from dflop.models.architectures import Architecture, architecture, architecture_of, check_compatible
from dflop.models.presets import llm_preset, vision_preset

# What builds a model (transformers' model classes, packed attention, the weights reader) is
# imported by the functions that build one: `model_config` alone serves the commands that only
# read the model's structure (the launcher's plan check, `dflop check-config`).
if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from dflop.models.weights_dir import WeightsDirectory

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """torch dtype for "float32" | "bfloat16" | "float16" (or a torch.dtype, returned as is)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise UserError(f"model.dtype: unknown dtype {name!r}; known: {', '.join(_DTYPES)}") from None


def model_config(arch: str, vision: str, llm: str, *, weights_dir: str | Path | None = None) -> PreTrainedConfig:
    """The transformers config of (arch, vision preset, LLM preset), or the one in `weights_dir`."""
    spec = architecture(arch)
    if weights_dir is not None:
        config = AutoConfig.from_pretrained(_weights_path(weights_dir), local_files_only=True)
        _check_arch(spec, config, weights_dir)
        return config
    vision_p = vision_preset(vision)
    check_compatible(spec, vision_p)
    return spec.make_config(vision_p, llm_preset(llm))


def ties_embeddings(config: PreTrainedConfig) -> bool:
    """Whether the model's LM head is its token embedding (one tensor where a stage holds both)."""
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False)
                or getattr(config, "tie_word_embeddings", False))


def build_model(arch: str, vision: str, llm: str, *, weights_dir: str | Path | None = None,
                **options) -> PreTrainedModel:
    """The model of (arch, vision preset, LLM preset), or the one in `weights_dir`: `build_from_config`
    (`options`: its dtype, device, seed, llm_attention) of `model_config`. A run resolves its model
    once instead (`dflop.models.handle`)."""
    return build_from_config(model_config(arch, vision, llm, weights_dir=weights_dir), weights_dir=weights_dir,
                             **options)


def build_from_config(
    config: PreTrainedConfig,
    *,
    weights_dir: str | Path | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    seed: int | None = None,
    llm_attention: str | None = None,
) -> PreTrainedModel:
    """The whole model of `config` (from `model_config`) on `device`: `build_on_meta`, then every
    tensor materialised (`dflop.models.materialize`), so it holds exactly the values a rank's
    stages get under any layout.

    weights_dir: a local Hugging Face model directory (config.json + *.safetensors); nothing is
        downloaded and pickled checkpoints are refused. The presets then only name the model.
    seed: seeds the random init, per tensor by its name (`dflop.models.init_by_name`); None draws
        one from torch's global generator. The global RNG state is left as it was otherwise.
    llm_attention: attention of the LLM layers; keep ``dflop_packed`` (None: the default; or a
        flash-attention implementation) for packed pipeline stages. The vision tower always uses SDPA.
    """
    from dflop.models.materialize import materialize

    model = build_on_meta(config, dtype=dtype, llm_attention=llm_attention)
    materialize(model, device=device, seed=seed, weights=open_weights(weights_dir, model))
    return model


def build_on_meta(config: PreTrainedConfig, *, dtype: str | torch.dtype = "float32",
                  llm_attention: str | None = None) -> PreTrainedModel:
    """The model of `config` on the meta device: every name, shape and dtype, no memory and no
    init (a 7B model in well under a second). `materialize` fills the tensors a rank keeps.
    llm_attention: None is ``dflop_packed`` (`dflop.models.packing.PACKED_ATTENTION`)."""
    from dflop.models.packing import PACKED_ATTENTION  # also registers it with transformers

    llm_attention = PACKED_ATTENTION if llm_attention is None else llm_attention
    attn = {"text_config": llm_attention, "vision_config": "sdpa", "": "sdpa"}
    with torch.device("meta"):
        return architecture_of(config).model_class._from_config(config, attn_implementation=attn,
                                                                dtype=resolve_dtype(dtype))


def open_weights(weights_dir: str | Path | None, model: PreTrainedModel) -> WeightsDirectory | None:
    """The weights directory of `model` (on the meta device), checked, or None without one."""
    from dflop.models.weights_dir import WeightsDirectory

    return None if weights_dir is None else WeightsDirectory(_weights_path(weights_dir), model)


def _weights_path(weights_dir: str | Path) -> Path:
    path = Path(weights_dir)
    if not (path / "config.json").is_file():
        raise UserError(f"model.weights: {path} is not a Hugging Face model directory (no config.json)")
    return path


def _check_arch(spec: Architecture, config: PreTrainedConfig, weights_dir: str | Path) -> None:
    found = architecture_of(config)
    if found is not spec:
        raise UserError(f"model.weights: {weights_dir} holds a {found.name!r} model but model.arch is {spec.name!r}")
