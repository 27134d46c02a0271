"""Seeded fuzzing of every artifact reader (issue 34): one field of a valid artifact perturbed (NaN,
±inf, negative, a string, missing, an extra one), then read the way dflop reads it and used the way
the next stage uses it. Each case must end in a one-line UserError naming the file, or in numbers
that are all finite (a documented default included): never a number computed from garbage.
NaN and infinities in a JSON or YAML document are always refused.

A failure lists the seeds, fields and perturbations that broke the rule.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from dflop.costmodel.batch import batch_costs
from dflop.costmodel.features import MODULE_FEATURES
from dflop.costmodel.fit import fit_load_line
from dflop.costmodel.jsonio import cost_model_to_dict, load_cost_model
from dflop.costmodel.model import (LOAD_FEATURES, TARGETS, BytesLine, CostModel, LoadLine, ModuleCosts, Provenance,
                                  StepCosts)
from dflop.costmodel.profile_table import read_profile
from dflop.costmodel.synthetic import synthetic_profile
from dflop.errors import UserError
from dflop.io import read_parquet
from dflop.plan import read_plan
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool
from dflop.runtime.comparison import compare_runs, planned_steps, read_metrics
from dflop.runtime.metrics import prediction_agreement
from dflop.shapes import read_shapes

KINDS = ("nan", "inf", "-inf", "negative", "string", "missing", "extra")
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
CASES = 42  # per artifact: six of each kind, on seeded random fields


# -- perturbing ------------------------------------------------------------------------------------


def _leaves(doc, path=()):
    """Every (path, value) of a nested document, containers included (so a whole section can go)."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield path + (key,), value
        yield from _leaves(value, path + (key,))


def _perturb_doc(doc: dict, rng, kind: str) -> tuple[dict, str]:
    doc = copy.deepcopy(doc)
    paths = [p for p, _ in _leaves(doc)]
    path = paths[rng.integers(len(paths))]
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    if kind in NON_FINITE:
        parent[key] = NON_FINITE[kind]
    elif kind == "negative":
        parent[key] = -abs(value) - 1 if isinstance(value, (int, float)) and not isinstance(value, bool) else -1
    elif kind == "string":
        parent[key] = str(value)
    elif kind == "missing":
        del parent[key]
    elif isinstance(parent, dict):  # extra: a key the format does not have, beside this one
        parent["fuzz_extra"] = 1.5
    else:  # extra: one more list item
        parent.append(copy.deepcopy(value))
    return doc, ".".join(map(str, path))


def _perturb_table(table: pd.DataFrame, rng, kind: str) -> tuple[pd.DataFrame, str]:
    table = table.copy()
    column = table.columns[rng.integers(len(table.columns))]
    row = int(rng.integers(len(table)))
    numeric = pd.api.types.is_numeric_dtype(table[column]) and not pd.api.types.is_bool_dtype(table[column])
    if kind in NON_FINITE or kind == "negative":
        if numeric:
            table[column] = table[column].astype(np.float64)
            value = table[column].iloc[row]
            table.loc[row, column] = NON_FINITE[kind] if kind in NON_FINITE else -abs(value) - 1
        else:
            table.loc[row, column] = None  # a text column's "not a number": a null
    elif kind == "string":
        table[column] = table[column].astype(str)
    elif kind == "missing":
        table = table.drop(columns=[column])
    else:
        table["fuzz_extra"] = rng.normal(size=len(table))
    return table, f"{column}[{row}]"


def _finite(*values) -> bool:
    arrays = [np.asarray(v, dtype=np.float64).ravel() for v in values if v is not None]
    return all(np.isfinite(a).all() for a in arrays)


# -- the artifacts: a valid one, how it is written, and what reads and uses it ---------------------


def _cost_model() -> dict:
    modules = [ModuleCosts(name, 1, feats, {t: tuple(0.5 + 0.1 * i for i in range(len(feats))) for t in TARGETS},
                           1e6, 4, (1, 8), (16, 512)) for name, (_, feats) in MODULE_FEATURES.items()]
    steps = StepCosts(optimizer=BytesLine(1e-3, 1e-10), allreduce={2: BytesLine(2e-4, 1e-9)}, p2p=BytesLine(5e-5, 1e-9),
                      optimizer_call_s=2e-4, loading=LoadLine((1e-3, 2e-4, 1e-3, 1e-3, 1e-6, 1e-8), n_samples=16))
    model = CostModel(modules, Provenance(preset="fuzz", device="cpu", dtype="float32"), steps)
    return cost_model_to_dict(model)


def _use_cost_model(path: Path) -> bool:
    model = load_cost_model(path)
    c = batch_costs(model, [0, 3, 7, 1], [40, 900, 300, 2000], vision_layers_per_stage=[2], llm_layers_per_stage=[1, 1],
                    tp_v=1, tp_l=1, mem_limit_bytes=40e9, in_flight_per_stage=[3, 2, 1])
    lines = [model.step_costs.optimizer, model.step_costs.p2p, *model.step_costs.allreduce.values()]
    loading = model.step_costs.loading
    return (_finite(*(getattr(c, f) for f in c.__dataclass_fields__ if isinstance(getattr(c, f), np.ndarray)))
            and _finite(*[(line.const_s, line.per_byte_s) for line in lines if line is not None])
            and _finite(model.step_costs.optimizer_call_s, loading.coef if loading else None))


def _plan_doc() -> dict:
    keys = {"vision": {"tp": 1, "pp": 1, "dp": 2, "layers_per_stage": [2], "recompute": ["none"],
                       "shard_optimizer": True, "sequence_parallel": False},
            "llm": {"tp": 2, "pp": 2, "dp": 1, "layers_per_stage": [1, 1], "recompute": ["none", "full"],
                    "shard_optimizer": False, "sequence_parallel": True},
            "placement": "disjoint", "microbatches": 4, "global_batch_size": 16, "world_size": 6}
    predicted = {"step_s": {"mean": 1.5, "p50": 1.4, "p90": 1.9}, "utilisation": 0.6, "samples_per_s": 10.7,
                 "memory_bytes": {"vision": [2_000_000_000], "llm": [3_000_000_000, 2_500_000_000]},
                 "memory_limit_bytes": 80_000_000_000}
    return {"version": 1, **keys, "predicted": predicted, "baseline": {**copy.deepcopy(keys), "predicted": predicted},
            "speedup": 1.3, "cluster": Cluster(nodes=1, gpus_per_node=8, gpu_memory_bytes=80e9).to_config(),
            "evaluation": {"sample_batches": 8, "seed": 0}, "inputs": {"shapes": "s.parquet", "costmodel": "c.json"}}


def _use_plan(path: Path) -> bool:
    pf = read_plan(path)
    cluster = Cluster.from_record(pf.doc.get("cluster"), str(path))
    return _finite(planned_steps(pf.doc, str(path)), cluster.gpu_memory_bytes, cluster.intra_node_bytes_per_s,
                   cluster.inter_node_bytes_per_s, cluster.p2p_latency_s)


def _shapes() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    n = 12
    tiles = rng.integers(0, 6, n).astype(np.int32)
    text = rng.integers(10, 400, n)
    return pd.DataFrame({"sample_id": [f"s{i}" for i in range(n)], "dataset": "d", "modality": "image",
                         "n_images": (tiles > 0).astype(np.int32), "n_frames": np.zeros(n, np.int32), "n_tiles": tiles,
                         "vision_tokens": tiles * 64, "text_tokens": text, "seq_len": tiles * 64 + text,
                         "media_pixels": tiles * 150_000, "status": "ok"})


def _use_shapes(path: Path) -> bool:
    shapes = read_shapes(path)
    pool = Pool.from_shapes(shapes, where=str(path))
    return _finite(shapes.select_dtypes("number"), pool.n_tiles, pool.seq_len, pool.vision_tokens)


def _profile() -> pd.DataFrame:
    return synthetic_profile(modules=("llm_head", "llm_layer"), llm_batches=(1, 2), llm_seq_lens=(64, 256), repeats=2)


def _use_profile(path: Path) -> bool:
    summary = read_profile(path)
    steps = summary.step_costs
    return _finite(summary.shapes[[*TARGETS, "param_bytes", "tied_bytes", "tp", "batch", "seq_len"]],
                   None if steps is None else steps[["ranks", "bytes", "ms"]])


def _load_profile() -> pd.DataFrame:
    shapes = _shapes()
    line = np.array([1e-3, 2e-4, 1e-3, 1e-3, 1e-6, 1e-8])
    features = np.column_stack([np.ones(len(shapes))] + [shapes[c] for c in LOAD_FEATURES[1:]])
    return shapes[["dataset", "sample_id", "modality", *LOAD_FEATURES[1:]]].assign(load_s=features @ line)


def _use_load_profile(path: Path) -> bool:
    return _finite(fit_load_line(read_parquet(path, missing_hint="fuzz"), where=str(path)).coef)


def _metrics() -> pd.DataFrame:
    steps = np.arange(1, 9)
    return pd.DataFrame({"step": steps, "loss": np.linspace(3, 2, 8), "step_s": 0.5 + 0.01 * steps,
                         "idle_frac": np.full(8, 0.2), "predicted_step_s": np.full(8, 0.45),
                         "corrected_step_s": [np.nan] * 2 + [0.5] * 6, "busy_s_llm0": np.full(8, 0.3)})


def _use_metrics(path: Path) -> bool:
    comparison = compare_runs(read_metrics(path, missing_hint="fuzz"), _metrics(), (0.45, 0.6))  # compare-runs
    agreement = prediction_agreement(read_metrics(path, missing_hint="fuzz",  # simulate --metrics
                                                  columns=("step", "step_s", "predicted_step_s")))
    numbers = [] if comparison is None else [comparison.plan_step_s, comparison.measured_speedup,
                                             comparison.plan_idle_frac, comparison.trained_predicted_speedup]
    if agreement is not None:
        numbers += [agreement.ratio_p10, agreement.ratio_p50, agreement.ratio_p90, agreement.corrected_p50]
    return _finite(*numbers)


def _write_json(doc, path):
    path.write_text(json.dumps(doc))  # NaN and Infinity as the JSON literals json.loads takes


def _write_yaml(doc, path):
    path.write_text(yaml.safe_dump(doc, sort_keys=False))  # .nan and .inf


def _write_parquet(table, path):
    table.to_parquet(path)


ARTIFACTS = {  # name: (file name, valid artifact, perturb, write, read and use)
    "costmodel": ("costmodel.json", _cost_model, _perturb_doc, _write_json, _use_cost_model),
    "plan": ("plan.yaml", _plan_doc, _perturb_doc, _write_yaml, _use_plan),
    "shapes": ("shapes.parquet", _shapes, _perturb_table, _write_parquet, _use_shapes),
    "profile": ("model_profile.parquet", _profile, _perturb_table, _write_parquet, _use_profile),
    "load_profile": ("load_profile.parquet", _load_profile, _perturb_table, _write_parquet, _use_load_profile),
    "metrics": ("metrics.parquet", _metrics, _perturb_table, _write_parquet, _use_metrics),
}


@pytest.mark.parametrize("name", list(ARTIFACTS))
def test_a_perturbed_artifact_is_refused_in_one_line_or_gives_finite_numbers(name, tmp_path):
    filename, valid, perturb, write, use = ARTIFACTS[name]
    good = valid()
    write(good, tmp_path / filename)
    assert use(tmp_path / filename), "the unperturbed artifact must read and give finite numbers"
    broken, refused = [], 0
    for seed in range(CASES):
        rng = np.random.default_rng([34, seed])
        kind = KINDS[seed % len(KINDS)]
        artifact, field = perturb(good, rng, kind)
        path = tmp_path / f"{seed}" / filename
        path.parent.mkdir()
        write(artifact, path)
        case = f"seed {seed}: {field} {kind}"
        try:
            ok = use(path)
        except UserError as exc:
            refused += 1
            message = str(exc)
            if "\n" in message or str(path) not in message:
                broken.append(f"{case}: the error is not one line naming the file: {message!r}")
            continue
        except Exception as exc:  # noqa: BLE001 - a traceback is what the test is for
            broken.append(f"{case}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        if not ok:
            broken.append(f"{case}: read without an error, and gave a non-finite number")
        elif kind in NON_FINITE and perturb is _perturb_doc:
            broken.append(f"{case}: a non-finite number in a JSON/YAML document was accepted")
    assert not broken, f"{len(broken)} of {CASES} cases broke the rule:\n" + "\n".join(broken)
    assert refused >= CASES // 4, f"only {refused} of {CASES} perturbations were refused: is the fuzzer perturbing?"
