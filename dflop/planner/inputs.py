"""The optimizer's inputs beside shapes.parquet (`dflop.shapes`) and plan.yaml (`dflop.plan`): the
cost model, checked against the model it is used for."""

from __future__ import annotations

from dflop.config import ModelSpec
from dflop.costmodel.model import CostModel
from dflop.errors import UserError


def check_cost_model_matches(cost: CostModel, model: ModelSpec, path) -> None:
    """The cost model must have been fitted on this model (profiles record ``arch/vision/llm``)."""
    have = cost.provenance.preset
    if have and "/" in have and have != model.preset:
        raise UserError(f"{path}: cost model was fitted on {have}, but the config's model is {model.preset}; "
                        f"re-run `dflop profile-model` and `dflop fit`")
