"""JSON round trip gives identical predictions; a damaged file is a one-line error naming the key."""

import json

import numpy as np
import pytest

from dflop.costmodel.batch import batch_costs
from dflop.costmodel.fit import fit_profile
from dflop.costmodel.jsonio import cost_model_to_dict, load_cost_model, save_cost_model
from dflop.costmodel.profile_table import summarize_profile
from dflop.costmodel.synthetic import synthetic_profile
from dflop.errors import UserError


@pytest.fixture(scope="module")
def model():
    return fit_profile(summarize_profile(synthetic_profile(tp_degrees=(1, 2), noise=0.05, seed=11)))[0]


def test_round_trip_predicts_identically(model, tmp_path):
    path = tmp_path / "costmodel.json"
    save_cost_model(model, path)
    loaded = load_cost_model(path)
    assert loaded.provenance == model.provenance
    rng = np.random.default_rng(2)
    tiles, lens = rng.integers(0, 20, 30), rng.integers(1, 5000, 30)
    kw = dict(vision_layers_per_stage=[14, 13], llm_layers_per_stage=[10, 10, 8], tp_v=2, tp_l=1,
              mem_limit_bytes=40e9, in_flight_per_stage=[5, 4, 3, 2, 1])
    before, after = batch_costs(model, tiles, lens, **kw), batch_costs(loaded, tiles, lens, **kw)
    for name in before.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(before, name), getattr(after, name), err_msg=name)
    assert model.llm_stage_memory(lens, n_layers=3, first=True, last=True, tp=1, in_flight=2) == \
        loaded.llm_stage_memory(lens, n_layers=3, first=True, last=True, tp=1, in_flight=2)
    # and saving the loaded model writes the same bytes
    save_cost_model(loaded, tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == path.read_text()


def _write(tmp_path, data):
    path = tmp_path / "costmodel.json"
    path.write_text(json.dumps(data))
    return path


def test_damaged_files_name_the_problem(model, tmp_path):
    good = cost_model_to_dict(model)

    bad = json.loads(json.dumps(good))
    bad["modules"][2]["coef"]["fwd_ms"][0] = -1.0
    with pytest.raises(UserError, match=r"costmodel.json: invalid cost model at modules/2/coef/fwd_ms/0: -1.0 is less than the minimum of 0"):
        load_cost_model(_write(tmp_path, bad))

    bad = json.loads(json.dumps(good))
    bad["modules"][0]["coef"]["bwd_ms"].pop()
    with pytest.raises(UserError, match=r"modules/0/coef/bwd_ms has 3 coefficients for 4 features"):
        load_cost_model(_write(tmp_path, bad))

    bad = json.loads(json.dumps(good))
    bad["version"] = 99
    with pytest.raises(UserError, match=r"format version 99 is not supported \(this dflop reads version 1\)"):
        load_cost_model(_write(tmp_path, bad))

    bad = json.loads(json.dumps(good))
    del bad["provenance"]["dtype"]
    with pytest.raises(UserError, match=r"invalid cost model at provenance: 'dtype' is a required property"):
        load_cost_model(_write(tmp_path, bad))

    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(UserError, match=r"broken.json: not valid JSON"):
        load_cost_model(tmp_path / "broken.json")
    with pytest.raises(UserError, match=r"cost model not found"):
        load_cost_model(tmp_path / "missing.json")


def test_file_is_plain_json_with_the_feature_spec(model, tmp_path):
    path = tmp_path / "m.json"
    save_cost_model(model, path)
    data = json.loads(path.read_text())
    layer = next(m for m in data["modules"] if m["module"] == "llm_layer" and m["tp"] == 1)
    assert layer["features"] == ["tokens", "tokens_pow1.5", "sq_tokens", "const"]
    assert set(layer["coef"]) == {"fwd_ms", "bwd_ms", "act_bytes", "transient_bytes"}


def test_recompute_costs_survive_the_round_trip(tmp_path):
    from dflop.costmodel.analytic import analytic_cost_model
    from dflop.models.builder import model_config

    model = analytic_cost_model(model_config("llava_ov", "siglip-tiny", "qwen2.5-tiny"), tp_degrees=(1,))
    save_cost_model(model, tmp_path / "analytic.json")
    loaded = load_cost_model(tmp_path / "analytic.json")
    for mode in ("none", "selective", "full"):
        kw = dict(n_layers=2, first=False, last=False, tp=1, recompute=mode)
        assert loaded.llm_stage_time([30, 7], **kw) == model.llm_stage_time([30, 7], **kw)
        assert loaded.vision_stage_memory([3], in_flight=2, **kw) == model.vision_stage_memory([3], in_flight=2, **kw)


def test_a_tied_heads_bytes_survive_the_round_trip_and_older_files_have_none(model, tmp_path):
    """`tied_param_bytes` is written where set and read back (the stage holding both LLM ends
    prices it once); a file without the key (older fits) loads with 0."""
    from dataclasses import replace

    from dflop.costmodel.model import CostModel

    tied = CostModel([replace(m, tied_param_bytes=m.param_bytes) if m.module == "llm_head" else m
                      for m in model.modules.values()], model.provenance, model.step_costs)
    path = tmp_path / "tied.json"
    save_cost_model(tied, path)
    loaded = load_cost_model(path)
    assert loaded.module("llm_head", 1).tied_param_bytes == model.module("llm_head", 1).param_bytes
    both = dict(seq_lens=[100], n_layers=2, first=True, last=True, tp=1, in_flight=1)
    assert loaded.llm_stage_memory(**both) == tied.llm_stage_memory(**both) != model.llm_stage_memory(**both)
    data = cost_model_to_dict(model)
    assert all("tied_param_bytes" not in m for m in data["modules"])
    assert load_cost_model(_write(tmp_path, data)).module("llm_head", 1).tied_param_bytes == 0.0


def test_measured_optimizer_steps_survive_the_round_trip_and_a_misplaced_tie_is_refused(model, tmp_path):
    """Per-module `optimizer_s` and `step_costs.optimizer_call_s` are read back exactly (the stage's
    optimizer price depends on both); a ``tied_param_bytes`` off the LM head or above its bytes is a
    one-line error naming the entry."""
    from dataclasses import replace

    from dflop.costmodel.model import CostModel

    stepped = CostModel([replace(m, optimizer_s=1e-4 * (i + 1)) for i, m in enumerate(model.modules.values())],
                        model.provenance, replace(model.step_costs, optimizer_call_s=3e-4))
    path = tmp_path / "stepped.json"
    save_cost_model(stepped, path)
    loaded = load_cost_model(path)
    assert loaded.step_costs.optimizer_call_s == 3e-4
    assert {k: m.optimizer_s for k, m in loaded.modules.items()} == {k: m.optimizer_s for k, m in stepped.modules.items()}
    data = cost_model_to_dict(model)
    layer = next(i for i, m in enumerate(data["modules"]) if m["module"] == "llm_layer")
    data["modules"][layer]["tied_param_bytes"] = 1.0
    with pytest.raises(UserError, match=rf"modules/{layer}/tied_param_bytes .* llm_layer has it"):
        load_cost_model(_write(tmp_path, data))


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_refused_naming_the_key(model, tmp_path, literal):
    """json.loads takes NaN/Infinity literals (and 1e999 as inf), and the schema's minimum: 0 passes
    NaN: a NaN act_bytes used to load and print "memory per stage nan"."""
    data = cost_model_to_dict(model)
    data["modules"][1]["coef"]["act_bytes"][0] = 12345.678  # a marker the literal replaces
    path = tmp_path / "costmodel.json"
    path.write_text(json.dumps(data).replace("12345.678", literal))
    with pytest.raises(UserError, match=r"^\S*costmodel.json: modules\[1\]\.coef\.act_bytes\[0\]: -?(nan|inf) is not "
                                        r"a finite number$"):
        load_cost_model(path)
