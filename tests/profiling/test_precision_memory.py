"""Under the one precision contract (`dflop.models.precision`) the fitted memory of a layer is what
a pipeline stage keeps."""

from __future__ import annotations

import pytest
import torch

from dflop.costmodel.fit import fit
from dflop.costmodel.jsonio import load_cost_model
from dflop.models.builder import build_model
from dflop.models.packing import PackedSequence
from dflop.models.precision import Precision
from dflop.models.stages import build_llm_stage
from dflop.profiling._memory import saved_tensor_bytes
from profiling_testlib import SMALL_GRID, profile


def test_fitted_layer_memory_is_what_a_stage_keeps(tmp_path):
    """A cost model fitted from a profile of the tiny model predicts, for one LLM layer and a packed
    microbatch it never saw, the bytes a real pipeline stage (built from the full model, as the trainer
    builds it) keeps for backward under bf16 autocast (its weight copies included); and the stage's
    training state."""
    dtype = "bfloat16"
    profile("llava_ov", "siglip-tiny", "qwen2.5-tiny", tmp_path / "profile.parquet", model={"dtype": dtype},
            **SMALL_GRID)
    fit(tmp_path / "profile.parquet", tmp_path / "cost.json", tmp_path / "validation.parquet")
    cost = load_cost_model(tmp_path / "cost.json")

    precision = Precision.of(dtype)
    model = build_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", seed=0)
    stage = build_llm_stage(model, 1, 3, (0, 1))  # one decoder layer, neither first nor last
    lengths = [45, 70, 13]
    packed = PackedSequence.from_lengths(lengths)
    hidden = torch.randn(1, sum(lengths), model.config.text_config.hidden_size, requires_grad=True)
    params = list(stage.parameters())
    with saved_tensor_bytes(exclude=params) as saved, precision.autocast("cpu"):
        stage(hidden, packed)
    predicted = cost.llm_stage_memory(lengths, n_layers=1, first=False, last=False, tp=1, in_flight=1)
    assert predicted.activation_bytes == pytest.approx(saved.bytes, rel=0.05)
    n = sum(p.numel() for p in params)
    assert predicted.param_bytes + predicted.grad_bytes + predicted.optimizer_bytes == pytest.approx(16 * n, rel=1e-6)
