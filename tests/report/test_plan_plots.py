"""Plan vs baseline plots: the re-simulation reproduces what the optimizer wrote into plan.yaml, and
the load bars are the device busy times of the simulated step."""

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

from dflop.config import Config
from dflop.costmodel.fit import fit_profile
from dflop.costmodel.profile_table import summarize_profile
from dflop.costmodel.synthetic import synthetic_profile
from dflop.errors import UserError
from dflop.models.handle import ModelHandle
from dflop.planner import optimize
from dflop.report.plan_plots import compare_plan, draw_plan_comparison, plot_plan
from dflop.costmodel.jsonio import save_cost_model

DEMO = dict(arch="llava_ov", vision="siglip-tiny", llm="qwen2.5-tiny")


def _shapes(n: int = 240, seed: int = 0) -> pd.DataFrame:
    """Skewed mix: text only, images of 1-10 tiles, 16-frame videos (seq_len in tokens)."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=n, p=[0.3, 0.6, 0.1])
    tiles = np.where(kind == 0, 0, np.where(kind == 1, rng.integers(1, 11, n), 16))
    text = rng.integers(20, 600, n)
    return pd.DataFrame({
        "sample_id": [f"s{i}" for i in range(n)], "dataset": "toy", "modality": np.array(["text", "image", "video"])[kind],
        "n_images": (kind == 1).astype(int), "n_frames": np.where(kind == 2, 16, 0), "n_tiles": tiles,
        "vision_tokens": tiles * 64, "text_tokens": text, "seq_len": tiles * 64 + text, "status": "ok",
    })


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """plan.yaml of a 4-GPU disjoint plan (vision and LLM stages, data-parallel replicas) on toy costs."""
    d = tmp_path_factory.mktemp("plan_plots")
    _shapes().to_parquet(d / "shapes.parquet")
    profile = synthetic_profile(patches_per_tile=729, preset="llava_ov/siglip-tiny/qwen2.5-tiny")
    model, _ = fit_profile(summarize_profile(profile))
    save_cost_model(model, d / "costmodel.json")
    # 24 GB (8 before the LM head's transient was priced: the padded baseline's bins of the synthetic
    # head's 150k vocabulary need more)
    cfg = Config.from_dict({"model": DEMO, "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_memory_gb": 24},
                            "planner": {"placements": ["disjoint"], "microbatches": [4], "sample_batches": 6}})
    optimize(d / "shapes.parquet", d / "costmodel.json", d / "plan.yaml", d / "candidates.parquet",
             model=ModelHandle.resolve(cfg.model), cluster=cfg.cluster, planner=cfg.planner, global_batch_size=32,
             seed=0, verbose=False)
    return d


@pytest.fixture(scope="module")
def comparison(planned):
    return compare_plan(planned / "plan.yaml")


def test_resimulation_reproduces_the_predictions_in_plan_yaml(planned, comparison):
    doc = yaml.safe_load((planned / "plan.yaml").read_text())
    assert comparison.plan.plan.layout.placement == "disjoint" and comparison.plan.plan.layout.world_size == 4
    for step, section in ((comparison.plan, doc), (comparison.baseline, doc["baseline"])):
        ev, pred = step.evaluation, section["predicted"]
        assert len(ev.step_s) == pred["batches"] == 6
        assert ev.mean_s == pytest.approx(pred["step_s"]["mean"], rel=1e-9)
        assert ev.p50_s == pytest.approx(pred["step_s"]["p50"], rel=1e-9)
        assert ev.p90_s == pytest.approx(pred["step_s"]["p90"], rel=1e-9)
        memory = pred["memory_bytes"]["vision"] + pred["memory_bytes"]["llm"]
        np.testing.assert_allclose(ev.memory_bytes, memory, rtol=1e-9)
        assert len(step.stages) == len(memory)
    assert comparison.memory_limit_bytes == doc["predicted"]["memory_limit_bytes"]
    padded = doc["padded_baseline"]["predicted"]["step_s"]
    assert comparison.padded_baseline.mean_s == pytest.approx(padded["mean"], rel=1e-9)
    assert comparison.padded_baseline.p90_s == pytest.approx(padded["p90"], rel=1e-9)
    plan_steps = comparison.plan.evaluation.step_s
    assert plan_steps[comparison.median_batch] == sorted(plan_steps)[len(plan_steps) // 2]


def test_load_bars_are_the_devices_busy_time_of_the_median_step(comparison):
    fig = draw_plan_comparison(comparison)
    step_ax, memory_ax, plan_ax, base_ax = fig.axes[:4]
    for ax, step in ((plan_ax, comparison.plan), (base_ax, comparison.baseline)):
        t = step.median_step
        busy = ((t.fwd_end - t.fwd_start) + (t.bwd_end - t.bwd_start)).sum(axis=1)  # seconds per device row
        order = np.lexsort((t.row_replica, t.row_stage))
        np.testing.assert_allclose([p.get_height() for p in ax.patches], busy[order], rtol=1e-12)
        dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
        assert dashed[0].get_ydata()[0] == pytest.approx(t.step_s)
        assert max(busy) <= t.step_s + 1e-12
        rows = step.stage_busy_s()
        np.testing.assert_allclose(rows[t.row_stage, t.row_replica], busy, rtol=1e-12)
    means = [p.get_height() for p in step_ax.patches]
    assert means == pytest.approx([comparison.plan.evaluation.mean_s, comparison.baseline.evaluation.mean_s])
    memory = np.r_[comparison.plan.evaluation.memory_bytes, comparison.baseline.evaluation.memory_bytes] / 1e9
    np.testing.assert_allclose([p.get_height() for p in memory_ax.patches], memory, rtol=1e-12)
    plt.close(fig)


def test_the_title_gives_the_speedup_over_both_baselines_by_name(planned, comparison):
    """Issue 20: every speedup is reported against both data-blind trainers, each named; the
    numbers are the ones the optimizer wrote into plan.yaml."""
    doc = yaml.safe_load((planned / "plan.yaml").read_text())
    fig = draw_plan_comparison(comparison)
    title = fig.get_suptitle()
    plt.close(fig)
    assert f"{doc['speedup']:.2f}x vs Megatron-style packed data-blind" in title
    assert f"{doc['speedup_padded']:.2f}x vs HF/LLaVA padded" in title
    assert f"{doc['speedup']:.2f}" != f"{doc['speedup_padded']:.2f}"  # so swapped numbers would show


def test_plot_plan_writes_the_comparison_and_both_gantt_charts(planned, tmp_path):
    paths = plot_plan(plan=planned / "plan.yaml", shapes=planned / "shapes.parquet", costmodel=planned / "costmodel.json",
                      out_png=tmp_path / "cmp.png", gantt_plan_png=tmp_path / "g_plan.png",
                      gantt_baseline_png=tmp_path / "g_base.png")
    assert paths == [tmp_path / "cmp.png", tmp_path / "g_plan.png", tmp_path / "g_base.png"]
    for path in paths:
        with Image.open(path) as img:
            assert img.format == "PNG" and img.width > 400


def test_plan_without_baseline(planned, tmp_path):
    doc = yaml.safe_load((planned / "plan.yaml").read_text())
    doc["baseline"] = None
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    cmp = compare_plan(tmp_path / "plan.yaml", shapes=planned / "shapes.parquet", costmodel=planned / "costmodel.json")
    assert cmp.baseline is None
    assert list(cmp.speedups()) == ["HF/LLaVA padded"]  # the padded one is still reported
    plot_plan(plan=tmp_path / "plan.yaml", shapes=planned / "shapes.parquet", costmodel=planned / "costmodel.json",
              out_png=tmp_path / "cmp.png", gantt_plan_png=tmp_path / "g_plan.png",
              gantt_baseline_png=tmp_path / "g_base.png")
    assert (tmp_path / "g_base.png").stat().st_size > 0


def test_bad_plans_are_one_line_errors(planned, tmp_path):
    doc = yaml.safe_load((planned / "plan.yaml").read_text())
    doc.pop("inputs")
    (tmp_path / "no_inputs.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(UserError, match=r"no_inputs\.yaml: inputs\.shapes / inputs\.costmodel missing"):
        compare_plan(tmp_path / "no_inputs.yaml")
    doc = yaml.safe_load((planned / "plan.yaml").read_text())
    doc["llm"]["pp"] = "two"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(UserError, match=r"bad\.yaml: llm\.pp: expected an integer >= 1, got 'two'"):
        compare_plan(tmp_path / "bad.yaml", shapes=planned / "shapes.parquet", costmodel=planned / "costmodel.json")
    with pytest.raises(UserError, match=r"missing\.yaml: no such file \(run `dflop optimize` first"):
        compare_plan(tmp_path / "missing.yaml")


def test_the_comparison_shows_the_plan_technique_table(planned, comparison):
    """The figure carries the same per-stage technique table `dflop simulate` prints: "none" for
    this plan, and every row of a sharded plan's table (one per stage) when techniques are on."""
    from dataclasses import replace

    from dflop.planner.techniques import format_techniques, technique_costs
    from dflop.planner.whatif import load_plan_context

    def texts(cmp):
        fig = draw_plan_comparison(cmp)
        out = [t.get_text() for ax in fig.axes for t in ax.texts]
        plt.close(fig)
        return out

    assert "memory techniques: none" in texts(comparison)
    ctx = load_plan_context(planned / "plan.yaml")
    sharded = comparison.plan.plan.with_forced_techniques(shard_optimizer=True)
    table = technique_costs(sharded, ctx.cost, ctx.pool, ctx.cluster, ctx.sizes, global_batch=32)
    shown = [t for t in texts(replace(comparison, techniques=table)) if t.startswith("memory techniques")]
    assert len(shown) == 1 and shown[0] == format_techniques(table)
    rows = shown[0].splitlines()[2:]
    assert [r.split("  ")[0] for r in rows] == [sharded.stage_name(s) for s in range(sharded.layout.n_stages)]
    assert all(" yes " in r for r in rows)
