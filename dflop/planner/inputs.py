"""The optimizer's inputs beside shapes.parquet (`dflop.shapes`): the model structure, checked against the cost model."""

from __future__ import annotations

from dflop.costmodel.model import CostModel
from dflop.errors import UserError
from dflop.planner.space import ModelShape


def load_model_shape(arch: str, vision: str, llm: str, weights: str | None = None) -> ModelShape:
    """Layers, heads and widths of the model (built on the meta device, no weights loaded)."""
    from dflop.models.info import model_info  # imports torch/transformers: only when needed

    return ModelShape.from_info(model_info(arch, vision, llm, weights_dir=weights))


def check_cost_model_matches(cost: CostModel, arch: str, vision: str, llm: str, path) -> None:
    """The cost model must have been fitted on this model (profiles record ``arch/vision/llm``)."""
    want = f"{arch}/{vision}/{llm}"
    have = cost.provenance.preset
    if have and "/" in have and have != want:
        raise UserError(f"{path}: cost model was fitted on {have}, but the config's model is {want}; "
                        f"re-run `dflop profile-model` and `dflop fit`")
