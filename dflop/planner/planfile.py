"""plan.yaml: the chosen plan, what it is predicted to do, and the data-blind baseline (DESIGN §4).

Top-level keys::

    version: 1
    placement: disjoint | colocated
    world_size: GPUs (processes) the plan uses
    global_batch_size, microbatches
    vision: {tp, pp, dp, layers_per_stage}
    llm:    {tp, pp, dp, layers_per_stage}
    rank_order: how ranks map to (module, stage, replica, tp rank) (as dflop.runtime.topology)
    predicted: {step_s: {mean, p50, p90}, mean_shape_step_s, utilisation, samples_per_s,
                memory_bytes: {vision: [per stage], llm: [per stage]}, memory_limit_bytes}
    baseline: {placement, world_size, global_batch_size, microbatches, vision, llm, micro_batch_size,
               policy, predicted} or null (itself a complete plan mapping)
    speedup: baseline mean step / plan mean step (null without a baseline)
    solver: {name, status, time_s, milps, statuses, top_k_proven, layouts, feasible, wall_s}
    evaluation: {sample_batches, seed, racing, scheduler: {policy, budget_s, ilp}}
    cluster: the cluster section it was planned for (config units)
    model: {arch, vision, llm, weights, dtype}
    inputs: {shapes, costmodel}

In the colocated placement the vision tower runs on the first LLM stage's ranks: ``vision.pp`` is
1, ``vision.dp``/``vision.tp`` equal the LLM's, and ``predicted.memory_bytes.vision`` is empty
(its memory is inside LLM stage 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import yaml

from dflop.errors import UserError
from dflop.io import read_yaml, write_text_atomic
from dflop.planner.cluster import Cluster
from dflop.planner.expected import Evaluation
from dflop.planner.layout import PLACEMENTS, Layout, Plan
from dflop.planner.space import ModelShape

RANK_ORDER = ("vision ranks first, then llm ranks; inside a module rank = first_rank + (stage * dp + replica) * tp "
              "+ tp_rank; colocated: the vision tower runs on llm stage 0's ranks")


def module_section(plan: Plan, module: str) -> dict:
    """``{tp, pp, dp, layers_per_stage}`` of one module (exactly the keys the trainer accepts)."""
    lay = plan.layout
    if module == "vision":
        return {"tp": lay.tp_v, "pp": lay.pp_v, "dp": lay.dp_v, "layers_per_stage": list(plan.vision_layers)}
    return {"tp": lay.tp_l, "pp": lay.pp_l, "dp": lay.dp_l, "layers_per_stage": list(plan.llm_layers)}


def predicted_section(ev: Evaluation, *, global_batch: int, memory_limit_bytes: float,
                      mean_shape_step_s: float | None) -> dict:
    n_v = ev.plan.layout.n_vision_stages
    mem = [int(round(x)) for x in ev.memory_bytes]
    return {
        "step_s": {"mean": ev.mean_s, "p50": ev.p50_s, "p90": ev.p90_s},
        "mean_shape_step_s": mean_shape_step_s,
        "utilisation": ev.mean_utilisation,
        "samples_per_s": global_batch / ev.mean_s,
        "memory_bytes": {"vision": mem[:n_v], "llm": mem[n_v:]},
        "memory_limit_bytes": int(round(memory_limit_bytes)),
        "batches": len(ev.step_s),
    }


def plan_document(*, chosen: Evaluation, mean_shape_step_s: float, baseline: Evaluation | None,
                  baseline_mean_shape_s: float | None, global_batch: int, cluster: Cluster, solver: dict,
                  evaluation: dict, model: dict, inputs: dict) -> dict:
    """The plan.yaml mapping (module docstring)."""
    plan, lay = chosen.plan, chosen.plan.layout
    doc: dict[str, Any] = {
        "version": 1,
        "placement": lay.placement,
        "world_size": lay.world_size,
        "global_batch_size": int(global_batch),
        "microbatches": lay.m,
        "vision": module_section(plan, "vision"),
        "llm": module_section(plan, "llm"),
        "rank_order": RANK_ORDER,
        "predicted": predicted_section(chosen, global_batch=global_batch, memory_limit_bytes=cluster.gpu_memory_bytes,
                                       mean_shape_step_s=mean_shape_step_s),
        "baseline": None,
        "speedup": None,
    }
    if baseline is not None:
        b = baseline.plan.layout
        doc["baseline"] = {
            "placement": b.placement, "world_size": b.world_size, "global_batch_size": int(global_batch),
            "microbatches": b.m, "vision": module_section(baseline.plan, "vision"),
            "llm": module_section(baseline.plan, "llm"), "micro_batch_size": global_batch // (b.m * b.dp_l),
            "policy": baseline.policy,
            "predicted": predicted_section(baseline, global_batch=global_batch,
                                           memory_limit_bytes=cluster.gpu_memory_bytes,
                                           mean_shape_step_s=baseline_mean_shape_s),
        }
        doc["speedup"] = baseline.mean_s / chosen.mean_s
    doc.update({"solver": solver, "evaluation": evaluation, "cluster": cluster.to_config(), "model": model,
                "inputs": inputs})
    return _plain(doc)


def write_plan(doc: Mapping, path: str | Path) -> None:
    """Write plan.yaml atomically (keys in document order)."""
    header = "# DFLOP plan (dflop optimize); keys: DESIGN.md section 4 and dflop/planner/planfile.py\n"
    write_text_atomic(path, header + yaml.safe_dump(dict(doc), sort_keys=False, default_flow_style=None, width=110))


@dataclass(frozen=True)
class PlanFile:
    """A plan.yaml read back: the plan, its baseline plan (or None), and the raw mapping."""

    plan: Plan
    baseline: Plan | None
    global_batch: int
    doc: Mapping[str, Any]


def read_plan(path: str | Path) -> PlanFile:
    """Read and check plan.yaml; a bad file raises a one-line UserError naming the key."""
    path = Path(path)
    doc = read_yaml(path, missing_hint="run `dflop optimize` first")
    if not isinstance(doc, dict):
        raise UserError(f"{path}: expected a mapping of plan keys")
    plan = _plan_from(doc, path, "")
    baseline = _plan_from(doc["baseline"], path, "baseline.") if doc.get("baseline") else None
    return PlanFile(plan, baseline, _int(doc, "global_batch_size", path, ""), doc)


def _plan_from(d: Mapping, path: Path, prefix: str) -> Plan:
    if not isinstance(d, Mapping):
        raise UserError(f"{path}: {prefix.rstrip('.')} must be a mapping")
    placement = d.get("placement")
    if placement not in PLACEMENTS:
        raise UserError(f"{path}: {prefix}placement must be one of {list(PLACEMENTS)}, got {placement!r}")
    sections = {}
    for module in ("vision", "llm"):
        sec = d.get(module)
        if not isinstance(sec, Mapping):
            raise UserError(f"{path}: {prefix}{module} must be a mapping with tp, pp, dp, layers_per_stage")
        vals = {k: _int(sec, k, path, f"{prefix}{module}.") for k in ("tp", "pp", "dp")}
        layers = sec.get("layers_per_stage")
        if not isinstance(layers, list) or not all(isinstance(x, int) and x >= 0 for x in layers):
            raise UserError(f"{path}: {prefix}{module}.layers_per_stage must be a list of whole numbers, got {layers!r}")
        sections[module] = (vals, tuple(layers))
    (v, v_layers), (l, l_layers) = sections["vision"], sections["llm"]
    try:
        layout = Layout(placement, v["tp"], v["pp"], v["dp"], l["tp"], l["pp"], l["dp"],
                        _int(d, "microbatches", path, prefix))
        plan = Plan(layout, v_layers, l_layers)
    except ValueError as exc:
        raise UserError(f"{path}: {prefix.rstrip('.') or 'plan'}: {exc}") from None
    world = _int(d, "world_size", path, prefix)
    if world != layout.world_size:
        how = (f"llm tp*pp*dp = {l['tp']}*{l['pp']}*{l['dp']}" if layout.colocated else
               f"vision tp*pp*dp + llm tp*pp*dp = {v['tp']}*{v['pp']}*{v['dp']} + {l['tp']}*{l['pp']}*{l['dp']}")
        raise UserError(f"{path}: {prefix}world_size is {world} but the layout needs {layout.world_size} ranks ({how})")
    return plan


def check_plan_runs(plan: Plan, shape: ModelShape, cluster: Cluster, where: str) -> None:
    """One-line UserError unless `plan` can run `shape`'s model on `cluster`: layer splits that
    cover the model's layers, TP degrees that split its heads and widths, and a rank layout that
    fits the cluster and that the launcher can start (`Cluster.launchable`)."""
    lay = plan.layout
    for module, layers, n, tp, ok in (("vision", plan.vision_layers, shape.vision_layers, lay.tp_v, shape.vision_tp_ok),
                                      ("llm", plan.llm_layers, shape.llm_layers, lay.tp_l, shape.llm_tp_ok)):
        if sum(layers) != n:
            raise UserError(f"{where}: {module}.layers_per_stage {list(layers)} sums to {sum(layers)} but the model "
                            f"has {n} {module} layers")
        if tp not in ok:
            raise UserError(f"{where}: {module}.tp is {tp}, which does not split the {module} model's heads and widths "
                            f"evenly (possible: {', '.join(map(str, ok))})")
    if lay.world_size > cluster.world_size:
        raise UserError(f"{where}: the plan needs {lay.world_size} GPUs but the cluster has {cluster.world_size} "
                        f"({cluster.nodes} node(s) x {cluster.gpus_per_node})")
    if not bool(cluster.launchable(lay.world_size, lay.vision_gpus, lay.tp_l)):
        raise UserError(f"{where}: {lay.describe()} cannot be launched on {cluster.gpus_per_node}-GPU nodes: the "
                        f"{lay.world_size} ranks must fill one node or whole nodes, and the {lay.vision_gpus} vision "
                        f"ranks must be a multiple of llm tp={lay.tp_l} so no LLM TP group spans two nodes")


def _int(d: Mapping, key: str, path: Path, prefix: str) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{path}: {prefix}{key} must be a whole number >= 1, got {value!r}")
    return value


def _plain(x):
    """numpy scalars/arrays -> Python types, so yaml.safe_dump can write them."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_plain(v) for v in x]
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return x
