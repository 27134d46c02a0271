import pandas as pd
import pytest

from dflop.errors import UserError
from synthetic_costs import AnalyticCostModel, StageLayout, batch_costs_from_shapes
from synthetic_mix import llava_ov_mix


def test_analytic_model_closed_form():
    shapes = pd.DataFrame({"sample_id": ["a", "b"], "n_tiles": [5, 0], "seq_len": [4000, 700]})
    model = AnalyticCostModel()
    layout = StageLayout(vision_layer_share=(0.25, 0.75), llm_layer_share=(0.5, 0.3, 0.2))
    c = batch_costs_from_shapes(shapes, layout, model)
    llm_a = model.llm_fwd_s_per_token * 4000 + model.llm_fwd_s_per_token_sq * 4000**2
    assert c.llm_fwd[1, 0] == pytest.approx(0.3 * llm_a)
    assert c.llm_bwd[2, 0] == pytest.approx(0.2 * 2 * llm_a)
    assert c.vision_fwd[1, 0] == pytest.approx(0.75 * 5 * model.vision_fwd_s_per_tile)
    assert c.vision_fwd[:, 1].tolist() == [0.0, 0.0]  # text-only sample: no vision work
    assert c.llm_total()[0] == pytest.approx(3 * llm_a)


def test_bad_shapes_and_bad_costs_fn_are_named():
    shapes = pd.DataFrame({"sample_id": ["a", "b"], "n_tiles": [1, -2], "seq_len": [10, 20]})
    with pytest.raises(UserError, match=r"sample 'b' has invalid n_tiles"):
        batch_costs_from_shapes(shapes, StageLayout(), AnalyticCostModel())
    with pytest.raises(UserError, match="missing column"):
        batch_costs_from_shapes(shapes.drop(columns="seq_len"), StageLayout(), AnalyticCostModel())
    ok = shapes.assign(n_tiles=[1, 2])
    wrong_stages = lambda s, lay: AnalyticCostModel()(s, StageLayout(llm_layer_share=(1.0,)))  # noqa: E731
    with pytest.raises(ValueError, match=r"BatchCosts.llm_fwd of shape \(1, 2\), expected \(3, 2\)"):
        batch_costs_from_shapes(ok, StageLayout(), wrong_stages)
    with pytest.raises(ValueError, match="sum to 1"):
        StageLayout(llm_layer_share=(0.5, 0.4))


def test_llava_ov_mix_matches_its_spec():
    df = llava_ov_mix(20000, seed=3)
    frac = df.modality.value_counts(normalize=True)
    for kind, want in (("text", 0.10), ("image", 0.65), ("multi_image", 0.15), ("video", 0.10)):
        assert abs(frac[kind] - want) < 0.015
    img = df[df.modality == "image"]
    assert img.n_tiles.between(2, 10).all() and img.vision_tokens.max() <= 7400
    vid = df[df.modality == "video"]
    assert (vid.n_tiles == 32).all() and (vid.vision_tokens == 32 * 196 + 1).all()
    assert (df.seq_len == df.vision_tokens + df.text_tokens).all()
    assert (df[df.modality == "text"].n_tiles == 0).all()
    assert df.text_tokens.quantile(0.99) > 5 * df.text_tokens.median()  # long tail
    assert df.sample_id.is_unique and (df.status == "ok").all()
