"""plan.yaml, the one plan contract: the DESIGN keys into frozen dataclasses, the derived questions,
one-line errors naming the key, and what the optimizer writes read back as the trainer reads it."""

from __future__ import annotations

import pytest
import yaml

from dflop.errors import UserError
from dflop.plan import (Layout, ModuleLayout, Plan, PlanFile, Prediction, Techniques, baseline_plan_doc, in_flight_1f1b,
                        plan_from_dict, read_plan, write_plan)


def raw(**changes) -> dict:
    base = {"vision": {"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2]},
            "llm": {"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [1, 1]},
            "placement": "disjoint", "microbatches": 4, "global_batch_size": 16, "world_size": 6,
            "predicted": {"step_s": {"mean": 1.0}}}
    base.update(changes)
    return base


def test_valid_plan_loads_into_dataclasses(tmp_path):
    path = tmp_path / "plan.yaml"
    write_plan(raw(), path)
    pf = read_plan(path)
    plan = pf.plan
    assert plan.vision == ModuleLayout(1, 1, 2, (2,)) and plan.llm == ModuleLayout(2, 2, 1, (1, 1), schedule="1f1b")
    assert plan.placement == "disjoint" and not plan.colocated
    assert (plan.microbatches, pf.global_batch_size, plan.world_size, plan.n_vision_ranks) == (4, 16, 6, 2)
    assert plan.llm.layer_ranges() == [(0, 1), (1, 2)]
    assert plan.layout == Layout("disjoint", 1, 1, 2, 2, 2, 1, 4) and pf.baseline is None
    assert pf.doc["predicted"] == {"step_s": {"mean": 1.0}}  # the optimizer's keys, kept as written
    assert plan_from_dict(plan.to_dict(16)).plan == plan   # the writer's keys read back


def test_derived_questions_of_a_layout():
    disjoint = Layout("disjoint", tp_v=1, pp_v=2, dp_v=3, tp_l=2, pp_l=3, dp_l=2, m=8)
    assert (disjoint.vision_gpus, disjoint.llm_gpus, disjoint.world_size) == (6, 12, 18)
    assert (disjoint.n_stages, disjoint.vision_replicas, disjoint.n_bins) == (5, 3, 16)
    assert disjoint.in_flight() == [5, 4, 3, 2, 1]
    colocated = Layout("colocated", 2, 1, 4, 2, 2, 4, 1)
    assert (colocated.vision_gpus, colocated.world_size, colocated.n_stages) == (0, 16, 2)
    assert colocated.vision_replicas == 1  # each LLM replica encodes its own bin's images
    assert colocated.in_flight() == [1, 1]
    assert in_flight_1f1b(4, 8) == [4, 3, 2, 1]
    plan = Plan(disjoint, (10, 17), (9, 9, 10))
    assert [plan.stage_name(s) for s in (1, 2)] == ["vision stage 1", "llm stage 0"]
    assert Plan(colocated, (27,), (14, 14)).stage_name(0) == "llm stage 0 (with the vision tower)"


def test_colocated_plan_counts_only_llm_ranks():
    plan = plan_from_dict(raw(placement="colocated", vision={"tp": 2, "pp": 1, "dp": 1, "layers_per_stage": [2]},
                              world_size=4)).plan
    assert plan.colocated and plan.n_vision_ranks == 0


def test_uniform_layer_split_for_the_baseline():
    plan = plan_from_dict(raw(llm={"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [3, 1]})).plan
    assert plan.with_uniform_layers(2, 4).llm.layers_per_stage == (2, 2)
    assert Plan.uniform(Layout("disjoint", 1, 2, 1, 1, 4, 1, 4), 27, 30).vision_layers == (14, 13)
    assert Plan.uniform(Layout("disjoint", 1, 2, 1, 1, 4, 1, 4), 27, 30).llm_layers == (8, 8, 7, 7)


def test_the_baseline_section_is_read_as_a_plan():
    baseline = raw(placement="colocated", vision={"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2]},
                   llm={"tp": 1, "pp": 2, "dp": 2, "layers_per_stage": [1, 1]}, world_size=4, policy="megatron")
    pf = plan_from_dict(raw(baseline=baseline))
    assert pf.baseline == Plan(Layout("colocated", 1, 1, 2, 1, 2, 2, 4), (2,), (1, 1))
    with pytest.raises(UserError, match=r"p\.yaml: baseline\.world_size is 5 but the layout needs 4"):
        plan_from_dict(raw(baseline={**baseline, "world_size": 5}), "p.yaml")


def test_the_baseline_as_a_plan_of_its_own(tmp_path):
    """What `dflop train --baseline` trains: the baseline's layout (not the plan's), with the file's
    cluster and model records (the trainer prices on the cluster the plan was made for)."""
    baseline = raw(placement="colocated", vision={"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2],
                                                  "recompute": ["full"]},
                   llm={"tp": 1, "pp": 2, "dp": 2, "layers_per_stage": [1, 1]}, world_size=4)
    doc = baseline_plan_doc(raw(baseline=baseline, cluster={"device": "cpu"}, model={"llm": "x"}))
    write_plan(doc, tmp_path / "b.yaml")
    pf = read_plan(tmp_path / "b.yaml")
    assert pf.plan.layout == Layout("colocated", 1, 1, 2, 1, 2, 2, 4) and pf.baseline is None
    assert pf.plan.vision_techniques.recompute == ("full",)
    assert pf.doc["cluster"] == {"device": "cpu"} and pf.doc["model"] == {"llm": "x"}
    with pytest.raises(UserError, match=r"p\.yaml: baseline: missing"):
        baseline_plan_doc(raw(), "p.yaml")


def test_the_padded_baseline_as_a_plan_of_its_own(tmp_path):
    """What `dflop train --baseline --pad` trains: the padded baseline's own layout (padding needs more
    microbatches for the same memory), not the packed baseline's."""
    packed = raw(placement="colocated", vision={"tp": 1, "pp": 1, "dp": 4, "layers_per_stage": [2]},
                 llm={"tp": 1, "pp": 1, "dp": 4, "layers_per_stage": [2]}, world_size=4, microbatches=2)
    padded = {**packed, "microbatches": 4}
    doc = baseline_plan_doc(raw(baseline=packed, padded_baseline=padded), padded=True)
    write_plan(doc, tmp_path / "b.yaml")
    assert read_plan(tmp_path / "b.yaml").plan.layout.m == 4
    assert baseline_plan_doc(raw(baseline=packed, padded_baseline=padded))["microbatches"] == 2
    with pytest.raises(UserError, match=r"p\.yaml: padded_baseline: missing"):
        baseline_plan_doc(raw(baseline=packed), "p.yaml", padded=True)


def test_the_padded_baseline_section_is_optional_and_checked():
    """Files written before the HF/LLaVA padded baseline read as before; a written one is checked."""
    padded = raw(placement="colocated", vision={"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2]},
                 llm={"tp": 1, "pp": 2, "dp": 2, "layers_per_stage": [1, 1]}, world_size=4, policy="padded")
    assert plan_from_dict(raw(padded_baseline=padded)).plan == plan_from_dict(raw()).plan
    with pytest.raises(UserError, match=r"p\.yaml: padded_baseline\.world_size is 5 but the layout needs 4"):
        plan_from_dict(raw(padded_baseline={**padded, "world_size": 5}), "p.yaml")


@pytest.mark.parametrize("changes,message", [
    (dict(world_size=4), r"world_size is 4 but the layout needs 6 ranks \(vision tp\*pp\*dp \+ llm"),
    (dict(placement="mixed"), "placement: expected disjoint or colocated, got 'mixed'"),
    (dict(microbatches=0), r"microbatches: expected an integer >= 1, got 0"),
    (dict(global_batch_size=3), r"global_batch_size 3 cannot fill microbatches \* llm.dp = 4 \* 1 = 4 bins"),
    (dict(llm={"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [2]}),
     r"llm.layers_per_stage: expected a list of 2 layer counts"),
    (dict(llm={"tp": 2, "pp": 2, "dp": 1}), "llm: missing key\\(s\\) layers_per_stage"),
    (dict(vision={"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2], "sp": 2}), r"vision.sp: unknown key"),
    (dict(vision={"tp": 1, "pp": 1, "dp": True, "layers_per_stage": [2]}), r"vision.dp: expected an integer"),
    (dict(placement="colocated", world_size=4), "vision dp/tp equal to the LLM's"),
    (dict(llm={"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [1, 1], "recompute": ["full"]}),
     r"llm.recompute: expected a list of 2 modes"),
    (dict(llm={"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [1, 1], "recompute": ["full", "some"]}),
     r"llm.recompute\[1\]: expected one of none, selective, full, got 'some'"),
    (dict(llm={"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [1, 1], "shard_optimizer": "yes"}),
     r"llm.shard_optimizer: expected true or false, got 'yes'"),
    (dict(vision={"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2], "sequence_parallel": True}),
     r"vision.sequence_parallel: needs tensor parallelism \(tp > 1\), but tp is 1"),
    (dict(llm={"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [1, 1], "shard_optimizer": True}),
     r"llm.shard_optimizer: needs data-parallel replicas to shard over \(dp > 1\), but dp is 1"),
])
def test_bad_plans_are_one_line_errors(changes, message):
    with pytest.raises(UserError, match=message) as info:
        plan_from_dict(raw(**changes), "p.yaml")
    assert "\n" not in str(info.value) and str(info.value).startswith("p.yaml")


def test_colocated_needs_one_vision_stage():
    bad = raw(placement="colocated", vision={"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [1, 1]}, world_size=4)
    with pytest.raises(UserError, match="vision.pp is 2 but colocated placement"):
        plan_from_dict(bad)


def test_missing_keys_and_files(tmp_path):
    with pytest.raises(UserError, match="missing key\\(s\\) world_size"):
        plan_from_dict({k: v for k, v in raw().items() if k != "world_size"})
    with pytest.raises(UserError, match=r"nope\.yaml: no such file \(run `dflop optimize` first"):
        read_plan(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("vision: [1, 2\n")
    with pytest.raises(UserError, match="bad.yaml:2: not valid YAML"):
        read_plan(bad)


def test_writer_refuses_what_the_reader_would(tmp_path):
    with pytest.raises(UserError, match="world_size is 5"):
        write_plan(raw(world_size=5), tmp_path / "plan.yaml")
    assert not (tmp_path / "plan.yaml").exists()
    write_plan(raw(), tmp_path / "plan.yaml")
    assert yaml.safe_load((tmp_path / "plan.yaml").read_text())["world_size"] == 6


def _model(**changes):
    """A model the plan of `raw()` fits (2 vision, 2 LLM layers; any TP degree up to 8), with `changes`."""
    from types import SimpleNamespace

    return SimpleNamespace(**{"vision_layers": 2, "llm_layers": 2, "vision_tp_degrees": (1, 2, 4, 8),
                              "llm_tp_degrees": (1, 2, 4, 8), **changes})


def test_world_size_model_and_batch_checks_name_both_numbers():
    pf = plan_from_dict(raw(), "p.yaml")
    with pytest.raises(UserError, match="world_size is 6 but 4 processes were launched"):
        pf.plan.check_world_size(4)
    with pytest.raises(UserError, match=r"llm.layers_per_stage \[1, 1\] sums to 2 but the model has 24 llm layers"):
        pf.plan.check(_model(llm_layers=24))
    with pytest.raises(UserError, match=r"vision.tp is 1, which does not split .* \(possible: 2, 4\)"):
        pf.plan.check(_model(vision_tp_degrees=(2, 4)))
    with pytest.raises(UserError, match="train.global_batch_size is 8 but p.yaml was planned for 16"):
        pf.check_batch(8)
    assert isinstance(pf, PlanFile)


def test_memory_techniques_are_read_per_module_and_default_to_off():
    llm = {"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [1, 1], "recompute": ["full", "selective"],
           "sequence_parallel": True}
    vision = {"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2], "shard_optimizer": True}
    plan = plan_from_dict(raw(llm=llm, vision=vision)).plan
    assert plan.llm.techniques == Techniques(("full", "selective"), sequence_parallel=True)
    assert plan.vision.techniques == Techniques(("none",), shard_optimizer=True)
    assert not plan_from_dict(raw()).plan.vision.techniques.any
    assert plan_from_dict(plan.to_dict(16)).plan == plan   # written and read back, techniques included
    assert "vision: sharded optimizer; llm: recompute full/selective, sequence parallel" in plan.describe()
    # the baseline split keeps the techniques; equality sees them
    assert plan.with_uniform_layers(2, 2).llm_techniques == plan.llm_techniques
    assert plan != plan.with_techniques(Techniques.off(1), Techniques.off(2))


@pytest.mark.parametrize("literal", [".nan", ".inf", "-.inf", "1.0e+999"])
def test_non_finite_numbers_anywhere_are_refused_naming_the_key(tmp_path, literal):
    """YAML's .nan/.inf used to pass: a NaN prediction printed "step nan" and a NaN cluster memory let
    every stage "fit" (nan > limit is false)."""
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(raw(predicted={"step_s": {"mean": 12345.5}})).replace("12345.5", literal))
    with pytest.raises(UserError, match=r"^\S*plan\.yaml: predicted\.step_s\.mean: -?(nan|inf) is not a finite "
                                        r"number$"):
        read_plan(path)
    with pytest.raises(UserError, match=r"^p\.yaml: cluster\.gpu_memory_gb: nan is not a finite number$"):
        plan_from_dict(raw(cluster={"gpu_memory_gb": float("nan")}), "p.yaml")


# -- the predicted record (dflop.plan.Prediction) ------------------------------------------------

def test_prediction_writes_the_documented_record_and_reads_it_back(tmp_path):
    """The record as the optimizer wrote it before `Prediction` existed (planfile.predicted_section,
    by hand), in the file's key order; and read back from plan.yaml as every reader reads it."""
    pred = Prediction(0.5, 0.4, 0.9, 0.45, 0.7, 32.0, (10,), (20, 30), 80, 4)
    expected = {"step_s": {"mean": 0.5, "p50": 0.4, "p90": 0.9}, "mean_shape_step_s": 0.45, "utilisation": 0.7,
                "samples_per_s": 32.0, "memory_bytes": {"vision": [10], "llm": [20, 30]},
                "memory_limit_bytes": 80, "batches": 4}
    assert pred.to_dict() == expected and list(pred.to_dict()) == list(expected)
    path = tmp_path / "plan.yaml"
    write_plan(raw(predicted=pred.to_dict(), baseline=raw(predicted={"step_s": {"mean": 2.0}})), path)
    pf = read_plan(path)
    assert pf.prediction() == pred
    assert pf.prediction("baseline") == Prediction(step_mean_s=2.0)
    assert pf.prediction("padded_baseline") is None


@pytest.mark.parametrize("doc,message", [
    ({"predicted": {"step_s": {"mean": "0.2"}}}, "predicted.step_s.mean is '0.2', expected a finite number > 0"),
    ({"baseline": {"predicted": {"step_s": {"p90": 0}}}}, "baseline.predicted.step_s.p90 is 0, expected"),
    ({"predicted": [1.0]}, r"predicted: expected a mapping, got \[1.0\]"),
    ({"predicted": {"step_s": 0.2}}, "predicted.step_s: expected a mapping, got 0.2"),
])
def test_prediction_errors_name_the_file_and_key(doc, message):
    section = "baseline" if "baseline" in doc else None
    with pytest.raises(UserError, match=f"^p.yaml: {message}"):
        Prediction.read(doc, section, "p.yaml")


def test_the_one_plan_check_names_the_key_for_the_model_the_vision_tower_and_the_cluster():
    """`Plan.check` against the model (above) and its two other parts: no sequence parallelism for
    the vision tower, and the cluster's own check (`Cluster.check_runs`, which names the file)."""
    from dflop.pricing.cluster import Cluster

    pf = plan_from_dict(raw(), "p.yaml")
    pf.plan.check(_model())  # fits; no cluster: the rank layout is not checked
    vision = {"tp": 2, "pp": 1, "dp": 1, "layers_per_stage": [2], "sequence_parallel": True}
    sp = plan_from_dict(raw(vision=vision, world_size=6), "p.yaml")
    with pytest.raises(UserError, match=r"^p.yaml: vision.sequence_parallel: .*LLM only"):
        sp.plan.check(_model())
    pf.plan.check(_model(), Cluster(nodes=1, gpus_per_node=8))
    with pytest.raises(UserError, match=r"^p.yaml: the plan needs 6 GPUs but the cluster has 4"):
        pf.plan.check(_model(), Cluster(nodes=1, gpus_per_node=4))


def test_an_interleaved_llm_has_one_layer_count_and_recompute_mode_per_chunk():
    """Chunk c is layer range c of the model (on rank c mod pp), each with its own recompute mode,
    written back as read. (Reader errors: tests/test_plan_schedule.py.)"""
    llm = {"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [0, 1, 1, 0], "recompute": ["none", "full", "none", "selective"],
           "schedule": "interleaved", "chunks": 2}
    plan = plan_from_dict(raw(llm=llm)).plan
    assert (plan.layout.schedule, plan.layout.chunks, plan.layout.n_llm_chunks) == ("interleaved", 2, 4)
    assert plan.llm.layer_ranges() == [(0, 0), (0, 1), (1, 2), (2, 2)]
    assert plan.llm_techniques.recompute == ("none", "full", "none", "selective")
    assert plan.to_dict(16)["llm"]["schedule"] == "interleaved" and plan.to_dict(16)["llm"]["chunks"] == 2
    assert plan_from_dict(plan.to_dict(16)).plan == plan
    assert "interleaved 1F1B x2 chunks" in plan.describe()
