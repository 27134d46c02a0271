"""Defaults live in the schema: the typed sections have none of their own, and every library default
that stands for a config key equals the schema's (what the library does when the key is absent).

A default copied into code drifts from the schema (``profile.tp_degrees`` was ``[1]`` in the schema
and ``(1, 2)`` in `profile_model`); each row below would catch such a copy changing.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from dflop import cli
from dflop.config import (
    ClusterSection,
    Config,
    DataSection,
    DemoSection,
    PlannerSection,
    ProfileSection,
    RunSection,
    SchedulerSection,
    TrainSection,
    load_schema,
)

SECTIONS = {"run": RunSection, "profile": ProfileSection, "scheduler": SchedulerSection, "cluster": ClusterSection,
            "planner": PlannerSection, "train": TrainSection, "data": DataSection}


def _schema_default(key: str):
    node = load_schema()
    for part in key.split("."):
        node = node["properties"][part]
    return node["default"]


def _default(function, name: str):
    return inspect.signature(function).parameters[name].default


@pytest.mark.parametrize("section, cls", sorted(SECTIONS.items()))
def test_each_section_holds_exactly_the_schema_keys_and_no_default(section, cls):
    fields = dataclasses.fields(cls)
    assert {f.name for f in fields} == set(load_schema()["properties"][section]["properties"])
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields)
    assert {f.name for f in dataclasses.fields(DemoSection)} == set(
        load_schema()["properties"]["data"]["properties"]["demo"]["properties"])


def test_an_empty_config_gets_every_schema_default_in_its_sections():
    cfg = Config.from_dict({})
    for section in SECTIONS:
        typed = getattr(cfg, section)
        for f in dataclasses.fields(typed):
            if f.name in ("datasets", "demo"):
                continue
            want = _schema_default(f"{section}.{f.name}")
            got = getattr(typed, f.name)
            assert (list(got) if isinstance(got, tuple) else got) == want, f"{section}.{f.name}"


def _library_defaults():
    """(config key, what the library does when the key is absent)."""
    from dflop.data.demo import make_demo_data
    from dflop.pricing.cluster import GB, Cluster
    from dflop.planner.search import SearchSettings
    from dflop.profiling.data_profiler import profile_data
    from dflop.profiling.model_profiler import ProfileSettings
    from dflop.scheduler.online import StepPlanner
    from dflop.runtime.loading import StepLoader
    from dflop.runtime.optim import GradientSync
    from dflop.runtime.schedule import PipelineExecutor

    cluster, profile, search = Cluster(), ProfileSettings(), SearchSettings()
    parser = cli.build_parser()
    demo_args = parser.parse_args(["make-demo-data", "--out-dir", "x"])
    data_args = parser.parse_args(["profile-data", "--shapes", "s", "--histograms", "h"])
    return [
        ("cluster.nodes", cluster.nodes), ("cluster.gpus_per_node", cluster.gpus_per_node),
        ("cluster.gpu_memory_gb", cluster.gpu_memory_bytes / GB),
        ("cluster.intra_node_gbps", cluster.intra_node_bytes_per_s / GB),
        ("cluster.inter_node_gbps", cluster.inter_node_bytes_per_s / GB),
        ("cluster.p2p_latency_us", round(cluster.p2p_latency_s * 1e6, 9)), ("cluster.device", cluster.device),
        *((f"profile.{k}", getattr(profile, k)) for k in ("max_tiles", "max_seq_len", "repeats", "warmup",
                                                          "min_measure_ms", "max_repeats", "time_budget_s")),
        ("scheduler.policy", _default(StepPlanner, "policy")),
        ("scheduler.budget_ms", _default(StepPlanner, "budget_s") * 1e3),
        ("scheduler.prefetch", _default(StepPlanner, "prefetch")),
        ("scheduler.ilp", _default(StepPlanner, "ilp")),
        *((f"planner.{k}", list(v) if isinstance(v, tuple) else v) for k, v in
          ((k, getattr(search, k)) for k in ("placements", "microbatches", "sample_batches", "top_k",
                                              "time_limit_s", "rel_gap", "schedules"))),
        ("train.global_batch_size", search.global_batch), ("run.seed", search.seed),
        ("scheduler.pad_to_longest", _default(PipelineExecutor, "pad_to_longest")),
        ("train.schedule", _default(PipelineExecutor, "schedule")),
        ("train.loader_workers", _default(StepLoader, "workers")),
        ("train.overlap_grad_sync", _default(GradientSync, "overlap")),
        ("data.demo.n_samples", _default(make_demo_data, "n_samples")), ("data.demo.n_samples", demo_args.n_samples),
        ("data.demo.seed", _default(make_demo_data, "seed")), ("data.demo.seed", demo_args.seed),
        ("data.workers", _default(profile_data, "workers")),
        ("data.workers", Config.from_dict({}).data.workers if data_args.workers is None else data_args.workers),
    ]


@pytest.mark.parametrize("key, library", _library_defaults(), ids=lambda x: x if isinstance(x, str) else "")
def test_library_defaults_that_stand_for_a_config_key_equal_the_schema(key, library):
    assert library == pytest.approx(_schema_default(key)) if isinstance(library, float) else \
        library == _schema_default(key), key
