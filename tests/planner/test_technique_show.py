"""Users see a plan's memory techniques and their price: plan.yaml's ``techniques`` record (written
by `dflop optimize`, read back intact, absent from older files without harm) and the per-stage
table `dflop simulate` prints. The numbers themselves are checked against closed forms in
test_technique_costs.py; here: where they show up, and that they survive the file."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import yaml

from dflop.config import Config, deep_merge
from dflop.costmodel.analytic import analytic_cost_model
from dflop.costmodel.jsonio import save_cost_model
from dflop.costmodel.model import BytesLine, CostModel, StepCosts
from dflop.models.handle import ModelHandle
from dflop.plan import read_plan
from dflop.planner import optimize
from dflop.planner.techniques import technique_costs, techniques_record
from dflop.planner.whatif import load_plan_context
from planner_testlib import toy_shapes

DEMO = dict(arch="llava_ov", vision="siglip-tiny", llm="qwen2.5-tiny")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("technique_inputs")
    toy_shapes(200, seed=3).to_parquet(d / "shapes.parquet")
    model = ModelHandle.resolve(Config.from_dict({"model": DEMO}).model)
    cost = analytic_cost_model(model.config, tp_degrees=[1], dtype="float32", preset="llava_ov/siglip-tiny/qwen2.5-tiny")
    # A measured optimizer step gives sharding a time price (a sharded rank steps 1/dp of the
    # parameters); without one its reduce-scatter + all-gather cost exactly the all-reduce, 0 extra.
    # Measured on "cpu", so it holds on the tests' CPU cluster (`step_costs_on`).
    cost = CostModel(cost.modules.values(), replace(cost.provenance, device="cpu"),
                     StepCosts(optimizer=BytesLine(1e-4, 1e-9)))
    save_cost_model(cost, d / "costmodel.json")
    return d


def _optimize(inputs, out, **planner):
    cfg = Config.from_dict(deep_merge({"model": DEMO, "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_memory_gb": 4},
                                       "train": {"global_batch_size": 16}}, {"planner": planner}))
    out.mkdir(parents=True, exist_ok=True)
    optimize(inputs / "shapes.parquet", inputs / "costmodel.json", out / "plan.yaml", out / "candidates.parquet",
             model=ModelHandle.resolve(cfg.model), cluster=cfg.cluster, planner=cfg.planner,
             global_batch_size=16, seed=cfg.seed, verbose=False)
    return out / "plan.yaml"


@pytest.fixture(scope="module")
def full_plan(inputs, tmp_path_factory):
    return _optimize(inputs, tmp_path_factory.mktemp("full"), recompute="full", shard_optimizer=True)


def test_plan_yaml_records_the_techniques_and_reads_back(full_plan):
    pf = read_plan(full_plan)
    record = pf.doc["techniques"]
    n_stages = pf.plan.layout.n_stages + (1 if pf.plan.colocated else 0)  # colocated stage 0: two rows
    assert len(record) == n_stages
    assert [r["recompute"] for r in record] == ["full"] * n_stages
    assert all(r["shard_optimizer"] for r in record)
    assert all(r["activation_saved_bytes"] > 0 and r["recompute_extra_s"] > 0 for r in record)
    # what was written is what the plan read back prices to, with the inputs it records
    ctx = load_plan_context(full_plan)
    again = techniques_record(technique_costs(pf.plan, ctx.cost, ctx.pool, ctx.cluster, ctx.sizes,
                                              global_batch=pf.global_batch_size))
    assert again == record
    # compact: one flow mapping per stage, and the trainer's keys are untouched
    text = full_plan.read_text()
    assert re.search(r"^- \{stage: 0, name: ", text, re.M)
    assert pf.doc["llm"]["recompute"] == ["full"] * pf.plan.layout.pp_l


def test_simulate_prints_the_technique_table(full_plan, capsys):
    from dflop.cli import main

    assert main(["simulate", "--plan", str(full_plan), "--batches", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "memory techniques (at the mean microbatch)" in line)
    header, rows = lines[start + 1], lines[start + 2:]
    assert re.split(r"\s{2,}", header.strip()) == ["stage", "recompute", "shard opt", "seq par", "+bwd ms/mb",
                                                   "shard ms/step", "act saved GB", "state saved GB", "SP saved GB",
                                                   "peak GB"]
    record = read_plan(full_plan).doc["techniques"]
    assert all(rec["shard_comm_extra_s"] < 0 for rec in record)  # dp 2 halves the optimizer step: a saving
    for row, rec in zip(rows, record):
        mode, shard, sp, bwd_ms, shard_ms, act, state, sp_saved, peak = row.split()[-9:]
        assert (mode, shard, sp, sp_saved) == ("full", "yes", "no", "0")
        assert bwd_ms == f"{rec['recompute_extra_s'] * 1e3:.3g}"
        # sharding's price per step, as the record has it (seconds there, milliseconds here)
        assert shard_ms == f"{rec['shard_comm_extra_s'] * 1e3:.3g}"
        assert (act, state, peak) == tuple(f"{rec[k] / 1e9:.3g}" for k in ("activation_saved_bytes",
                                                                          "state_saved_bytes", "peak_bytes"))


def test_an_older_plan_without_the_record_still_simulates_and_says_none(inputs, tmp_path, capsys):
    from dflop.cli import main

    path = _optimize(inputs, tmp_path / "plain")
    doc = yaml.safe_load(path.read_text())
    assert all(r["recompute"] == "none" for r in doc["techniques"])
    for module in ("vision", "llm"):  # as written before the technique keys existed
        for key in ("recompute", "shard_optimizer", "sequence_parallel"):
            doc[module].pop(key)
        doc["baseline"] and [doc["baseline"][module].pop(k, None) for k in ("recompute", "shard_optimizer",
                                                                            "sequence_parallel")]
    del doc["techniques"]
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert "techniques" not in read_plan(old).doc
    assert main(["simulate", "--plan", str(old), "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "  memory techniques: none" in out.splitlines()
