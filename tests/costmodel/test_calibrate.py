"""`calibrated`: a one-GPU fit carried to other TP degrees and models, against hand-built models."""

import numpy as np
import pytest

from dflop.costmodel.analytic import analytic_cost_model
from dflop.costmodel.calibrate import applicable_modules, calibrated
from dflop.costmodel.model import CostModel, ModuleCosts, Provenance
from dflop.models.builder import model_config

PRESET = "llava_ov/siglip-tiny/qwen2.5-tiny"


def test_which_modules_a_fit_covers():
    assert applicable_modules(PRESET, PRESET) == ("vision_embed", "vision_layer", "projector", "llm_embed",
                                                  "llm_layer", "llm_attention", "llm_head")
    assert applicable_modules(PRESET, "llava_ov/siglip-tiny/llama3-tiny") == ("vision_embed", "vision_layer")
    assert applicable_modules(PRESET, "internvl/internvit-tiny/qwen2.5-tiny") == (
        "llm_embed", "llm_layer", "llm_attention", "llm_head")
    assert applicable_modules(PRESET, "internvl/internvit-tiny/llama3-tiny") == ()


def _fitted_tp1(analytic: CostModel, factor: float) -> CostModel:
    """A stand-in 'measurement' at TP 1: the analytic times x factor (memory as analytic)."""
    modules = []
    for (name, tp), m in analytic.modules.items():
        if tp == 1:
            coef = {t: tuple(c * factor for c in v) if t.startswith(("fwd_ms", "bwd_ms")) else v
                    for t, v in m.coef.items()}
            modules.append(ModuleCosts(m.module, 1, m.features, coef, m.param_bytes, 5, (1, 8), (16, 512)))
    return CostModel(modules, Provenance(preset=PRESET, device="NVIDIA H200", dtype="bfloat16", profile="p.parquet"))


def test_measured_degrees_are_the_fit_and_the_others_scale_by_its_ratio():
    analytic = analytic_cost_model(model_config("llava_ov", "siglip-tiny", "qwen2.5-tiny"), tp_degrees=(1, 2))
    fitted = _fitted_tp1(analytic, 3.0)
    model = calibrated(analytic, fitted, ("vision_layer", "llm_layer"))
    assert model.module("vision_layer", 1) is fitted.module("vision_layer", 1)
    for name in ("vision_layer", "llm_layer"):  # TP 2: analytic shape, x3 like the measured TP 1
        for target in ("fwd_ms", "bwd_ms", "bwd_ms:full"):
            np.testing.assert_allclose(model.module(name, 2).coefficients(target),
                                       3.0 * analytic.module(name, 2).coefficients(target), rtol=1e-12)
        np.testing.assert_array_equal(model.module(name, 2).coefficients("act_bytes"),
                                      analytic.module(name, 2).coefficients("act_bytes"))
    assert model.module("llm_head", 2) is analytic.module("llm_head", 2)  # not covered: analytic
    assert "NVIDIA H200 fit" in model.provenance.device and "vision_layer, llm_layer at TP 1" in model.provenance.device


def test_nothing_applies_leaves_the_analytic_model():
    analytic = analytic_cost_model(model_config("llava_ov", "siglip-tiny", "qwen2.5-tiny"), tp_degrees=(1, 2))
    model = calibrated(analytic, _fitted_tp1(analytic, 2.0), ())
    assert model.modules == analytic.modules and model.provenance.device == analytic.provenance.device
