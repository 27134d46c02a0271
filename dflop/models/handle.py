"""The model a run profiles, plans and trains, resolved once from the config's ``model`` section.

`ModelHandle.resolve` turns the section's names (presets, or a local weights directory) into the
transformers config once; everything downstream asks the handle: its structure (`info`, layer
counts, tied embeddings), how samples become its inputs (`sample_rules`), which parts learn (the
freeze flags), and the model itself: `build` (whole), or `build_on_meta` + `materializer` (a rank's part).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedConfig

from dflop.config import ModelSpec
from dflop.data.training import SampleRules
from dflop.errors import UserError
from dflop.models.architectures import architecture_of
from dflop.models.builder import build_from_config, build_on_meta, model_config, open_weights, ties_embeddings
from dflop.models.info import ModelInfo, SplitLimits, info_of, split_limits
from dflop.models.presets import tower_arch_params

# The model classes come with `build*` and `info` (dflop.models.builder imports them there): the
# launcher's plan check and `dflop check-config` resolve a handle without them.
if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from dflop.models.materialize import Materializer

# Presets with a 2048-token vocabulary: real tokenizer ids are folded into it (SampleRules).
TEST_PRESET_SUFFIXES = ("-tiny", "-small")


@dataclass(frozen=True)
class ModelHandle:
    """The config's model section and the transformers config it names (see module docstring)."""

    spec: ModelSpec
    config: PreTrainedConfig = field(compare=False, repr=False)

    @classmethod
    def resolve(cls, spec: ModelSpec) -> "ModelHandle":
        return cls(spec, model_config(spec.arch, spec.vision, spec.llm, weights_dir=spec.weights))

    # -- structure ---------------------------------------------------------------------------------

    @cached_property
    def info(self) -> ModelInfo:
        """Layers, heads, widths, parameter counts and the TP degrees that split it evenly (builds
        the model on the meta device to count)."""
        return info_of(self.config)

    @cached_property
    def split_limits(self) -> SplitLimits:
        """Layer counts and the TP degrees that split it evenly, from the config alone (what
        `Plan.check` asks; the same values as `info`'s, without building the model)."""
        return split_limits(self.config)

    @property
    def n_vision_layers(self) -> int:
        """Vision layers the image features depend on (what vision stages split)."""
        return architecture_of(self.config).n_feature_layers(self.config)

    @property
    def n_llm_layers(self) -> int:
        return int(self.config.get_text_config().num_hidden_layers)

    @property
    def tied_embeddings(self) -> bool:
        return ties_embeddings(self.config)

    # -- inputs ------------------------------------------------------------------------------------

    def sample_rules(self) -> SampleRules:
        """Token and pixel rules of this model (what the data profiler's shapes were computed with)."""
        s, config = self.spec, self.config
        text = config.get_text_config()
        video_id = getattr(config, "video_token_index", None) or getattr(config, "video_token_id", None)
        image_id = getattr(config, "image_token_index", None) or config.image_token_id
        return SampleRules(s.arch, tower_arch_params(s.arch, s.vision, s.arch_params), image_token_id=int(image_id),
                           video_token_id=int(video_id if video_id is not None else image_id),
                           vocab_size=int(text.vocab_size), tokenizer=s.tokenizer,
                           remap_text_ids=s.weights is None and s.llm.endswith(TEST_PRESET_SUFFIXES))

    # -- what learns -------------------------------------------------------------------------------

    @property
    def vision_side_trainable(self) -> bool:
        """Whether anything before the LLM (tower or projector) learns: feature gradients flow back."""
        return not (self.spec.freeze_vision and self.spec.freeze_projector)

    def check_trainable(self) -> None:
        s = self.spec
        if s.freeze_vision and s.freeze_projector and s.freeze_llm:
            raise UserError("model.freeze: vision, projector and llm are all frozen; nothing to train")

    def vision_stage_backward(self, stage: int, n_stages: int) -> bool:
        """Whether vision stage `stage` runs backward (a frozen tower needs it only for the projector)."""
        return not self.spec.freeze_vision or (not self.spec.freeze_projector and stage == n_stages - 1)

    def vision_sends_input_grad(self) -> bool:
        """Whether a vision stage sends its input gradient to the previous vision stage."""
        return not self.spec.freeze_vision

    # -- the model ---------------------------------------------------------------------------------

    def build(self, *, seed: int | None = None, device: torch.device | str = "cpu", dtype: str = "float32",
              llm_attention: str | None = None) -> PreTrainedModel:
        """The whole transformers model: random weights seeded with `seed`, or `spec.weights`."""
        return build_from_config(self.config, weights_dir=self.spec.weights, dtype=dtype, device=device, seed=seed,
                                 llm_attention=llm_attention)

    def build_on_meta(self, *, dtype: str = "float32", llm_attention: str | None = None) -> PreTrainedModel:
        """The model on the meta device (no memory): take a rank's views of it, then fill them (`materializer`)."""
        return build_on_meta(self.config, dtype=dtype, llm_attention=llm_attention)

    def materializer(self, model: PreTrainedModel, *, seed: int, device: torch.device | str) -> Materializer:
        """What fills the tensors a rank keeps of `model` (from `build_on_meta`) on `device`: random by
        name from `seed`, or read from `spec.weights`."""
        from dflop.models.materialize import Materializer

        return Materializer(model, device=device, seed=seed, weights=open_weights(self.spec.weights, model))
