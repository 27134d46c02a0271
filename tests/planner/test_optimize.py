"""`optimize` and `simulate_plan` end to end: files, keys, the demo default, what-if, one-line errors."""

import json
import re

import pandas as pd
import pytest
import yaml

from dflop.config import Config, deep_merge
from dflop.costmodel.model import CostModel, Provenance
from dflop.models.handle import ModelHandle
from dflop.errors import UserError
from dflop.plan import read_plan
from dflop.planner import optimize, simulate_plan
from dflop.planner.candidates import COLUMNS
from dflop.costmodel.jsonio import save_cost_model
from planner_testlib import toy_cost_model, toy_shapes

DEMO = dict(arch="llava_ov", vision="siglip-tiny", llm="qwen2.5-tiny")
DESIGN_KEYS = {"vision", "llm", "placement", "microbatches", "global_batch_size", "predicted", "baseline", "solver",
               "world_size"}


@pytest.fixture(scope="module")
def tiny_shape():
    from dflop.planner.space import ModelShape

    return ModelShape.from_info(ModelHandle.resolve(_config().model).info)


def _config(**sections) -> Config:
    """The demo model on a 2-process, 4 GB cluster, with `sections` ({"cluster": {...}}) laid over."""
    base = {"model": DEMO, "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_memory_gb": 4},
            "train": {"global_batch_size": 16}}
    return Config.from_dict(deep_merge(base, sections))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("planner_inputs")
    toy_shapes(300, seed=3).to_parquet(d / "shapes.parquet")
    cost = toy_cost_model(tp_degrees=(1,))
    demo = CostModel(cost.modules.values(), Provenance(preset="llava_ov/siglip-tiny/qwen2.5-tiny", device="synthetic",
                                                       dtype="float32"))
    save_cost_model(demo, d / "costmodel.json")
    return d


def _optimize(inputs, out, shape, verbose=False, **sections):
    cfg = _config(**sections)
    return optimize(inputs / "shapes.parquet", inputs / "costmodel.json", out / "plan.yaml", out / "candidates.parquet",
                    model=ModelHandle.resolve(cfg.model), cluster=cfg.cluster, planner=cfg.planner,
                    global_batch_size=cfg.train.global_batch_size, seed=cfg.seed, verbose=verbose, shape=shape)


def _optimize_from(shapes, inputs, out, shape):
    cfg = _config()
    return optimize(shapes, inputs / "costmodel.json", out / "p.yaml", out / "c.parquet",
                    model=ModelHandle.resolve(cfg.model), cluster=cfg.cluster, planner=cfg.planner,
                    global_batch_size=16, seed=0, verbose=False, shape=shape)


def test_demo_default_writes_a_valid_plan(inputs, tmp_path, tiny_shape, capsys):
    result = _optimize(inputs, tmp_path, tiny_shape, verbose=True)
    assert result.stats["wall_s"] < 30  # "a few seconds" on an idle core; generous for a shared machine
    doc = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert DESIGN_KEYS <= set(doc)
    assert doc["world_size"] <= 2 and doc["global_batch_size"] == 16
    for module, layers in (("vision", tiny_shape.vision_layers), ("llm", tiny_shape.llm_layers)):
        schedule = {"schedule", "chunks"} if module == "llm" else set()  # new plans always name the LLM's
        assert set(doc[module]) == {"tp", "pp", "dp", "layers_per_stage", "recompute", "shard_optimizer",
                                    "sequence_parallel"} | schedule  # exactly what the trainer reads
        if module == "llm":  # the default planner.schedules: 1F1B, which the trainer runs
            assert (doc[module]["schedule"], doc[module]["chunks"]) == ("1f1b", 1)
        # the config default (auto) means off until the planner chooses techniques
        assert doc[module]["recompute"] == ["none"] * doc[module]["pp"]
        assert doc[module]["shard_optimizer"] is False and doc[module]["sequence_parallel"] is False
        assert sum(doc[module]["layers_per_stage"]) == layers and len(doc[module]["layers_per_stage"]) == doc[module]["pp"]
    pred = doc["predicted"]
    assert pred["step_s"]["p50"] <= pred["step_s"]["p90"] and pred["step_s"]["mean"] > 0
    assert max(pred["memory_bytes"]["vision"] + pred["memory_bytes"]["llm"]) <= 4e9
    assert doc["baseline"]["predicted"]["step_s"]["mean"] > 0
    assert doc["speedup"] == pytest.approx(doc["baseline"]["predicted"]["step_s"]["mean"] / pred["step_s"]["mean"])
    assert doc["solver"]["status"] in ("optimal", "single_split")
    plan = read_plan(tmp_path / "plan.yaml")
    assert plan.plan == result.chosen.plan
    cand = pd.read_parquet(tmp_path / "candidates.parquet")
    assert tuple(cand.columns) == COLUMNS
    chosen = cand[cand["status"] == "chosen"]
    assert sorted(chosen["kind"]) == ["baseline", "baseline_padded", "plan"]
    padded = doc["padded_baseline"]
    assert padded["policy"] == "padded" and padded["label"] == "HF/LLaVA padded"
    assert doc["speedup_padded"] == pytest.approx(padded["predicted"]["step_s"]["mean"] / pred["step_s"]["mean"])
    assert padded["predicted"]["step_s"]["mean"] == pytest.approx(
        float(chosen.loc[chosen["kind"] == "baseline_padded", "step_mean_s"].iloc[0]), rel=1e-12)
    out = capsys.readouterr().out
    assert "x vs Megatron-style packed data-blind" in out and "x vs HF/LLaVA padded" in out


def test_one_gpu_cluster_gives_a_world_size_one_plan(inputs, tmp_path, tiny_shape):
    result = _optimize(inputs, tmp_path, tiny_shape, cluster={"gpus_per_node": 1})
    assert result.chosen.plan.layout.world_size == 1
    assert result.chosen.plan.layout.placement == "colocated"


def test_what_if_scales_dp_and_draws_the_gantt_chart(inputs, tmp_path, tiny_shape):
    _optimize(inputs, tmp_path, tiny_shape, cluster={"gpus_per_node": 2})
    same = simulate_plan(tmp_path / "plan.yaml", verbose=False, shape=tiny_shape)
    doc = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert same.plan.mean_s == pytest.approx(doc["predicted"]["step_s"]["mean"], rel=1e-12)  # same batches, same answer
    more = simulate_plan(tmp_path / "plan.yaml", gpus=4, out_png=tmp_path / "gantt.png", verbose=False, shape=tiny_shape)
    assert more.plan.plan.layout.world_size <= 4 and more.cluster.world_size == 4
    assert more.plan.plan.llm_layers == same.plan.plan.llm_layers  # only data parallelism changes
    assert (tmp_path / "gantt.png").stat().st_size > 1000
    for factor, name in ((1.2, "longer.parquet"), (3, "much_longer.parquet")):
        longer = toy_shapes(300, seed=3)
        longer["seq_len"] = (longer["seq_len"] * factor).astype(int)
        longer.to_parquet(tmp_path / name)
    other = simulate_plan(tmp_path / "plan.yaml", shapes_path=tmp_path / "longer.parquet", verbose=False,
                          shape=tiny_shape)
    assert other.plan.mean_s > same.plan.mean_s
    with pytest.raises(UserError, match=r"cannot run on .*much_longer\.parquet: memory: sampled batch \d+: sample 's\d+'"):
        simulate_plan(tmp_path / "plan.yaml", shapes_path=tmp_path / "much_longer.parquet", verbose=False,
                      shape=tiny_shape)
    with pytest.raises(UserError, match="not a whole number of 2-GPU nodes"):
        simulate_plan(tmp_path / "plan.yaml", gpus=3, verbose=False, shape=tiny_shape)


def test_cost_model_of_another_model_is_refused(inputs, tmp_path, tiny_shape):
    with pytest.raises(UserError, match="fitted on llava_ov/siglip-tiny/qwen2.5-tiny"):
        _optimize(inputs, tmp_path, tiny_shape, model={"llm": "qwen2.5-7b"})


def test_bad_shapes_file_names_the_file_and_column(inputs, tmp_path, tiny_shape):
    bad = toy_shapes(20).drop(columns=["seq_len"])
    bad.to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(UserError, match=r"bad\.parquet: missing column\(s\) seq_len"):
        _optimize_from(tmp_path / "bad.parquet", inputs, tmp_path, tiny_shape)
    neg = toy_shapes(20)
    neg.loc[3, "n_tiles"] = -1
    neg.to_parquet(tmp_path / "neg.parquet")
    with pytest.raises(UserError, match=r"sample 's3' has invalid n_tiles=-1"):
        _optimize_from(tmp_path / "neg.parquet", inputs, tmp_path, tiny_shape)


def test_plan_file_errors_name_the_key(tmp_path):
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"placement": "disjoint", "microbatches": 2,
                                                         "global_batch_size": 8, "world_size": 2, "vision": {"tp": 1, "pp": 1, "dp": 1},
                                                         "llm": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]}}))
    with pytest.raises(UserError, match=r"vision: missing key\(s\) layers_per_stage"):
        read_plan(tmp_path / "plan.yaml")
    with pytest.raises(UserError, match=r"missing\.yaml: no such file \(run `dflop optimize` first"):
        read_plan(tmp_path / "missing.yaml")


def test_outputs_are_written_atomically(inputs, tmp_path, tiny_shape, monkeypatch):
    """A failure while writing candidates leaves no partial file behind."""
    def broken(self, path, **kw):
        path.write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        _optimize(inputs, tmp_path, tiny_shape)
    assert not (tmp_path / "candidates.parquet").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_what_if_scaling_keeps_layouts_launchable():
    from dflop.pricing.cluster import Cluster
    from dflop.plan import Layout, Plan
    from dflop.planner.whatif import scale_baseline, scale_plan

    # vision tp1 x pp3, LLM tp2: the plain ratio (LLM dp 3, vision dp 3) gives 15 ranks on 2x8 GPUs
    # and 9 vision ranks before TP-2 groups; scaling steps down to a layout torchrun can start.
    plan = Plan(Layout("disjoint", 1, 3, 1, 2, 1, 1, 4), (1, 1, 1), (2,))
    cluster = Cluster(nodes=2, gpus_per_node=8, gpu_memory_bytes=1e9)
    scaled = scale_plan(plan, cluster, global_batch=64).layout
    assert (scaled.dp_v, scaled.dp_l) == (4, 2)
    assert cluster.launchable(scaled.world_size, scaled.tp_v * scaled.pp_v * scaled.dp_v, scaled.tp_l)
    # colocated tp1 x pp3: 5 replicas (15 ranks) is not whole nodes; 2 replicas (6 ranks) fit one node
    colocated = Plan(Layout("colocated", 1, 1, 1, 1, 3, 1, 4), (1,), (1, 1, 1))
    assert scale_plan(colocated, cluster, global_batch=64).layout.dp_l == 2
    assert scale_baseline(colocated, cluster, global_batch=64).layout.dp_l == 2


def _edited_plan(src, dst, change) -> str:
    doc = yaml.safe_load(src.read_text())
    change(doc)
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(dst)


def test_simulate_refuses_a_plan_the_model_or_cluster_cannot_run(inputs, tmp_path, tiny_shape, capsys):
    from dflop.cli import main

    _optimize(inputs, tmp_path, tiny_shape)
    plan = tmp_path / "plan.yaml"

    def three_llm_layers(doc):
        doc["llm"]["layers_per_stage"] = [doc["llm"]["layers_per_stage"][0] + 1] + doc["llm"]["layers_per_stage"][1:]

    cases = {
        "layers": (three_llm_layers, r"llm\.layers_per_stage \[\d+.*\] sums to 3 but the model has 2 llm layers"),
        "world": (lambda d: d.update(world_size=d["world_size"] + 1), r"world_size is \d+ but the layout needs \d+ ranks"),
        "tp": (lambda d: d["llm"].update(tp=3) or d["vision"].update(tp=3) or d.update(world_size=d["world_size"] * 3),
               r"tp is 3, which does not split"),
        "cluster": (lambda d: d["cluster"].update(gpus_per_node=1) or d.update(
            placement="disjoint", world_size=2, vision={"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]},
            llm={"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]}), r"needs 2 GPUs but the cluster has 1"),
    }
    for name, (change, message) in cases.items():
        bad = _edited_plan(plan, tmp_path / f"{name}.yaml", change)
        assert main(["simulate", "--plan", bad]) == 2, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"dflop simulate: {bad}"), err
        assert __import__("re").search(message, err), (name, err)


def test_simulate_on_more_gpus_scales_the_global_batch_and_says_so(inputs, tmp_path, tiny_shape, capsys):
    _optimize(inputs, tmp_path, tiny_shape, cluster={"gpus_per_node": 2})
    doc = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    per_gpu = doc["global_batch_size"] / doc["world_size"]
    big = simulate_plan(tmp_path / "plan.yaml", gpus=64, verbose=True, shape=tiny_shape, sample_batches_k=2)
    out = capsys.readouterr().out
    scaled = round(per_gpu * 64)
    assert f"global batch {doc['global_batch_size']} -> {scaled}" in out and "with replacement" in out
    assert big.plan.plan.layout.world_size == 64  # every GPU asked for gets work
    assert big.plan.plan.layout.dp_l * big.plan.plan.layout.m <= scaled
    fixed = simulate_plan(tmp_path / "plan.yaml", gpus=64, global_batch=16, verbose=True, shape=tiny_shape,
                          sample_batches_k=2)
    out = capsys.readouterr().out
    used = fixed.plan.plan.layout.world_size
    assert fixed.plan.plan.layout.dp_l * fixed.plan.plan.layout.m <= 16 and used < 64  # the batch caps the replicas
    assert "(global batch 16)" in out and f"uses {used} of the 64 GPUs" in out


def test_scaled_batch_keeps_the_baseline_runnable_on_more_gpus():
    """A 16-sample plan on 6 GPUs scaled to 64: samples per GPU would give 171, which no fixed-count
    baseline splits; the batch follows the baseline's microbatches instead, and the baseline scales."""
    from dflop.pricing.cluster import Cluster
    from dflop.plan import Layout, Plan
    from dflop.plan import PlanFile
    from dflop.planner.whatif import scale_baseline, scaled_global_batch

    plan = Plan(Layout("disjoint", 1, 1, 2, 1, 2, 2, 4), (2,), (1, 1))             # 2 + 4 = 6 GPUs
    baseline = Plan(Layout("colocated", 1, 1, 2, 1, 2, 2, 2), (2,), (1, 1))         # 4 GPUs, 2 x 2 bins of 4
    pf = PlanFile(plan, 16, baseline)
    cluster = Cluster(nodes=8, gpus_per_node=8, gpu_memory_bytes=1e9)
    notes = []
    B = scaled_global_batch(pf, cluster, None, notes)
    scaled = scale_baseline(baseline, cluster, B)
    assert scaled is not None and scaled.layout.dp_l == 32 and B == 4 * 2 * 32  # 4 samples per bin, kept
    assert B % (scaled.layout.m * scaled.layout.dp_l) == 0 and "4 samples per microbatch" in notes[0]
    assert scaled_global_batch(PlanFile(plan, 16), cluster, None, []) == round(16 * 64 / 6)
    assert scaled_global_batch(pf, cluster, 100, []) == 100 and scaled_global_batch(pf, None, None, []) == 16


def test_forced_techniques_are_written_and_priced_for_the_plan_and_the_baseline(inputs, tmp_path, tiny_shape):
    """planner.shard_optimizer: true shards both modules of the chosen plan and the baseline, and
    their predicted memory is what the cost model says a sharded rank holds (less than unsharded);
    a forced recompute mode the fitted model cannot price is a one-line error naming the mode."""
    plain = yaml.safe_load(_plan_text(inputs, tmp_path / "plain", tiny_shape))
    sharded = yaml.safe_load(_plan_text(inputs, tmp_path / "sharded", tiny_shape, planner={"shard_optimizer": True}))
    for doc in (sharded, sharded["baseline"]):
        assert doc["vision"]["shard_optimizer"] is True and doc["llm"]["shard_optimizer"] is True
    # memory does not bind here and sharding prices the same traffic, so the same layout wins
    assert (plain["llm"], plain["placement"], plain["microbatches"]) == (
        {**sharded["llm"], "shard_optimizer": False}, sharded["placement"], sharded["microbatches"])
    assert plain["llm"]["dp"] > 1
    assert max(sharded["predicted"]["memory_bytes"]["llm"]) < max(plain["predicted"]["memory_bytes"]["llm"])
    with pytest.raises(UserError, match="no full-recompute costs"):
        _optimize(inputs, tmp_path / "full", tiny_shape, planner={"recompute": "full"})


def _plan_text(inputs, out, shape, **sections) -> str:
    out.mkdir(parents=True, exist_ok=True)
    _optimize(inputs, out, shape, **sections)
    return (out / "plan.yaml").read_text()


def test_simulate_states_its_spread_cost_model_and_measured_error(inputs, tmp_path, tiny_shape, capsys):
    """The what-if names the cost model, gives p10/p50/p90 of the sampled batches, repeats what a
    training run measured against its predictions (the CLI's --metrics, or the workflow's run beside
    it), and gives the speedup over each baseline by name: re-simulated on plan.yaml's batches, both
    are the ones the optimizer wrote."""
    import numpy as np

    from dflop.cli import main

    _optimize(inputs, tmp_path / "plan", tiny_shape)
    plan = tmp_path / "plan" / "plan.yaml"
    result = simulate_plan(plan, verbose=True, shape=tiny_shape, measured="run X: ratio 1.5")
    out = capsys.readouterr().out
    doc = yaml.safe_load(plan.read_text())
    for ev, key, speedup, label in ((result.baseline, "baseline", "speedup", "Megatron-style packed data-blind"),
                                    (result.padded_baseline, "padded_baseline", "speedup_padded", "HF/LLaVA padded")):
        assert ev.mean_s == pytest.approx(doc[key]["predicted"]["step_s"]["mean"], rel=1e-9)
        assert f"predicted speedup over the baseline: {doc[speedup]:.2f}x vs {label}" in out
        assert f"baseline ({label}) {ev.plan.describe()}: step {ev.mean_s:.4g} s mean" in out
    assert f"{doc['speedup']:.2f}" != f"{doc['speedup_padded']:.2f}"  # so the lines cannot be swapped unseen
    steps = np.asarray(result.plan.step_s)
    p10, p50, p90 = np.percentile(steps, [10, 50, 90])
    assert f"step {p10:.4g} / {p50:.4g} / {p90:.4g} s p10 / p50 / p90 over {len(steps)} sampled batches" in out
    assert f"cost model: {inputs / 'costmodel.json'}: fitted on synthetic (llava_ov/siglip-tiny/qwen2.5-tiny" in out
    assert "training run of this plan: run X: ratio 1.5" in out
    # The CLI reads the run of the workflow layout (results/plan, results/train) by default.
    from dflop.cli import _measured_agreement

    assert _measured_agreement(None, plan) is None  # no run yet: nothing claimed
    (tmp_path / "train").mkdir()
    pd.DataFrame({"step": [1, 2, 3, 4], "step_s": [9.0, 3.0, 2.0, 4.0],
                  "predicted_step_s": [1.0, 1.0, 1.0, 2.0]}).to_parquet(tmp_path / "train" / "metrics.parquet")
    said = _measured_agreement(None, plan)
    assert said.startswith(str(tmp_path / "train" / "metrics.parquet")) and "2 median" in said  # steps 3, 4: 2 and 2
    # a run of another plan (its stage columns differ) is not compared with this one
    stages = yaml.safe_load(plan.read_text())
    n_stages = stages["llm"]["pp"] + (0 if stages["placement"] == "colocated" else stages["vision"]["pp"])
    other = pd.read_parquet(tmp_path / "train" / "metrics.parquet").assign(
        **{f"busy_s_llm{j}": 1.0 for j in range(n_stages + 1)})
    other.to_parquet(tmp_path / "other.parquet")
    assert "is from a run of other pipeline stages" in _measured_agreement(tmp_path / "other.parquet", plan)
    for metrics, message in ((tmp_path / "absent.parquet", "absent.parquet: no such file"),
                             (tmp_path / "bad.parquet", "bad.parquet: not a metrics.parquet of dflop train")):
        pd.DataFrame({"step": [1]}).to_parquet(tmp_path / "bad.parquet")
        assert main(["simulate", "--plan", str(plan), "--metrics", str(metrics)]) == 2
        assert message in capsys.readouterr().err


def test_a_baseline_with_its_own_encoder_stage_scales_in_that_form():
    """Megatron-Core's encoder stage (InternViT-6B's 25 heads: vision TP 1 beside LLM TP 4) scaled
    to 64 GPUs stays an encoder stage per LLM replica, and is a layout the planner's own baseline
    search lists for that cluster; turned colocated, its vision TP would become the LLM's 4."""
    from dflop.planner.baseline import baseline_layouts
    from dflop.pricing.cluster import Cluster
    from dflop.planner.screen import SearchSpace
    from dflop.plan import Layout, Plan
    from dflop.planner.whatif import scale_baseline

    baseline = Plan(Layout("disjoint", 1, 1, 1, 4, 1, 1, 2), (4,), (8,))  # 1 + 4 = 5 GPUs
    cluster = Cluster(nodes=8, gpus_per_node=8, gpu_memory_bytes=80e9)
    scaled = scale_baseline(baseline, cluster, global_batch=128)
    lay = scaled.layout
    assert (lay.placement, lay.tp_v, lay.pp_v, lay.tp_l, lay.pp_l, lay.m) == ("disjoint", 1, 1, 4, 1, 2)
    # 12 replicas (60 GPUs) would not fill whole nodes; 8 replicas of 1 + 4 (40 GPUs, 5 nodes) do,
    # and 128 samples split into 8 x 2 fixed-count bins
    assert lay.dp_v == lay.dp_l == 8 and lay.world_size == 40
    space = SearchSpace(vision_tp=(1,), llm_tp=(4,), colocated_tp=(), shared_tp=(4,), microbatches=(2,),
                        placements=("disjoint",), vision_layers=4, llm_layers=8, global_batch=128, mean_tiles=1.0)
    layouts, _ = baseline_layouts(space, cluster)
    assert lay in [l for l in layouts if not l.colocated]


def test_simulate_refuses_non_finite_inputs_in_one_line(inputs, tmp_path, tiny_shape, capsys):
    """Issue 34: a NaN act_bytes in costmodel.json made `dflop simulate` print "step nan ... speedup
    nanx", exit 0 and draw the Gantt chart; an Infinity one printed "memory per stage nan"."""
    from dflop.cli import main

    _optimize(inputs, tmp_path, tiny_shape)
    text = (inputs / "costmodel.json").read_text()
    doc = json.loads(text)
    layer = next(i for i, m in enumerate(doc["modules"]) if m["module"] == "llm_layer")
    shapes = toy_shapes(300, seed=3)
    shapes["seq_len"] = shapes["seq_len"].astype(float)
    shapes.loc[7, "seq_len"] = float("inf")
    shapes.to_parquet(tmp_path / "inf.parquet")
    cases = []
    for literal in ("NaN", "Infinity"):
        doc["modules"][layer]["coef"]["act_bytes"][0] = 12345.678
        path = tmp_path / f"{literal}.json"
        path.write_text(json.dumps(doc).replace("12345.678", literal))
        cases.append((["--costmodel", str(path)], str(path),
                      rf"modules\[{layer}\]\.coef\.act_bytes\[0\]: (nan|inf) is not a finite number"))
    cases.append((["--shapes", str(tmp_path / "inf.parquet")], str(tmp_path / "inf.parquet"),
                  r"sample 's7' has invalid seq_len=inf"))
    bad_plan = _edited_plan(tmp_path / "plan.yaml", tmp_path / "nan_plan.yaml",
                            lambda d: d["cluster"].update(gpu_memory_gb=float("nan")))
    cases.append(([], bad_plan, r"cluster\.gpu_memory_gb: nan is not a finite number"))
    for key, value, message in (("seed", "x", r"evaluation\.seed: expected an integer >= 0, got 'x'"),
                                ("scheduler", {"budget_s": "fast"}, r"evaluation\.scheduler\.budget_s is 'fast', "
                                                                    r"expected a finite number > 0"),
                                ("sample_batches", 2.5, r"evaluation\.sample_batches: expected an integer >= 1")):
        edited = _edited_plan(tmp_path / "plan.yaml", tmp_path / f"{key}.yaml",
                              lambda d, key=key, value=value: d["evaluation"].update({key: value}))
        cases.append(([], edited, message))  # wrong types: were ValueError tracebacks or a float seed
    for args, culprit, message in cases:
        plan = culprit if culprit.endswith(".yaml") else str(tmp_path / "plan.yaml")
        gantt = tmp_path / "gantt.png"
        assert main(["simulate", "--plan", plan, "--gantt", str(gantt), *args]) == 2, culprit
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"dflop simulate: {culprit}: "), err
        assert re.search(message, err), err
        assert "nan" not in captured.out and not gantt.exists()
