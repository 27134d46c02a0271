"""candidates.parquet: every layout the optimizer looked at, and what became of it.

One row per (columns in this order; missing values are null):

- ``kind``: "plan" (the data-aware search), "baseline" (the data-blind layouts, Megatron-style
  packed) or "baseline_padded" (the same layouts run as the HF/LLaVA trainer, padded);
- ``level``: "degree" (a TP degree or m rejected for every layout), "group" (all layouts of one
  placement, tp_v, pp_v, tp_l, pp_l, m, i.e. all their dp splits: ``n_layouts`` of them, with
  the dp split of the best feasible one; groups some of whose layouts reached the MILP appear as
  their layout rows instead), or "layout" (one layout, with its layer split);
- ``placement``, ``tp_v``, ``pp_v``, ``dp_v``, ``tp_l``, ``pp_l``, ``dp_l``, ``m``, ``world_size``;
- ``status``: "rejected", "pruned" (feasible, but its lower bound could not beat the plans kept,
  its LPT-simulated step lost the prescreen, or it lost the race), "solved" (MILP solved, not
  simulated), "simulated", "chosen", "admitted" (a degree row: a vision TP degree kept by padding
  the tower's heads with zero heads, reason vision_heads_padded);
- ``reason``: why rejected or pruned: tp_not_dividing_heads, tp_not_profiled, tp_not_within_node,
  divisibility, memory, bound (a group's screen bound), milp_bound (a kept layout's MILP lower
  bound, `dflop.planner.milp.objective_bound_s`, or HiGHS's proof that no split reaches it
  (milp_status "cutoff"), >= the objective of the plans kept; detail names both), max_milps (left
  unsolved when the MILP budget ran out), prescreen, racing, milp_<status>;
  ``detail``: the same in words;
- ``n_layouts`` (a group row counts only the layouts not listed on layout rows of their own); ``bound_s`` (lower bound of the mean-shape step); ``mean_shape_step_s`` (MILP
  objective: the 1F1B step under mean shapes); ``milp_status`` (null on layouts that never
  reached the MILP step; plan.yaml's solver.milps counts the plan rows with one); ``milp_solve_s``;
- ``vision_layers``, ``llm_layers``: layers per stage; ``vision_recompute``, ``llm_recompute``: the
  recompute mode of each stage; ``shard_vision``, ``shard_llm``: optimizer state sharded over the
  module's replicas; ``sequence_parallel`` (the LLM's);
- ``step_mean_s``, ``step_p50_s``, ``step_p90_s``, ``utilisation``, ``peak_memory_gb`` (over the
  sampled batches), ``batches`` (how many were simulated);
- ``schedule``, ``chunks``: the LLM's pipeline schedule of a layout row with a split (1f1b, or the
  one `planner.schedules` let the planner pick for it; ``llm_layers`` then lists chunks).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from dflop.io import atomic_path
from dflop.plan import Plan
from dflop.planner.expected import Evaluation

STRING_COLUMNS = ("kind", "level", "placement", "status", "reason", "detail", "milp_status", "schedule")
BOOL_COLUMNS = ("shard_vision", "shard_llm", "sequence_parallel")
INT_COLUMNS = ("tp_v", "pp_v", "dp_v", "tp_l", "pp_l", "dp_l", "m", "world_size", "n_layouts", "batches", "chunks")
FLOAT_COLUMNS = ("bound_s", "mean_shape_step_s", "milp_solve_s", "step_mean_s", "step_p50_s", "step_p90_s",
                 "utilisation", "peak_memory_gb")
LIST_COLUMNS = ("vision_layers", "llm_layers")
MODE_COLUMNS = ("vision_recompute", "llm_recompute")
COLUMNS = ("kind", "level", "placement", "tp_v", "pp_v", "dp_v", "tp_l", "pp_l", "dp_l", "m", "world_size",
           "status", "reason", "detail", "n_layouts", "bound_s", "mean_shape_step_s", "milp_status", "milp_solve_s",
           "vision_layers", "llm_layers", "vision_recompute", "llm_recompute", "shard_vision", "shard_llm",
           "sequence_parallel", "step_mean_s", "step_p50_s", "step_p90_s", "utilisation",
           "peak_memory_gb", "batches", "schedule", "chunks")


def plan_columns(plan: Plan) -> dict:
    """The layout and split columns of a plan."""
    lay = plan.layout
    return {"placement": lay.placement, "tp_v": lay.tp_v, "pp_v": lay.pp_v, "dp_v": lay.dp_v, "tp_l": lay.tp_l,
            "pp_l": lay.pp_l, "dp_l": lay.dp_l, "m": lay.m, "world_size": lay.world_size,
            "vision_layers": list(plan.vision_layers), "llm_layers": list(plan.llm_layers),
            "vision_recompute": list(plan.vision_techniques.recompute),
            "llm_recompute": list(plan.llm_techniques.recompute),
            "shard_vision": plan.vision_techniques.shard_optimizer, "shard_llm": plan.llm_techniques.shard_optimizer,
            "sequence_parallel": plan.llm_techniques.sequence_parallel, "schedule": lay.schedule,
            "chunks": lay.chunks}


def evaluation_columns(ev: Evaluation) -> dict:
    """The simulated columns of an evaluation (only `batches`=0 when it failed)."""
    if not ev.ok:
        return {"batches": 0}
    return {"step_mean_s": ev.mean_s, "step_p50_s": ev.p50_s, "step_p90_s": ev.p90_s,
            "utilisation": ev.mean_utilisation, "peak_memory_gb": float(np.max(ev.memory_bytes)) / 1e9,
            "batches": len(ev.step_s)}


_NO_FIT = np.array(["no layer split fits in GPU memory on the " + side + " for any dp split"
                    for side in ("vision stages", "llm stages", "llm and vision stages")], dtype=object)


def group_rows(groups: pd.DataFrame) -> pd.DataFrame:
    """Candidate rows of the screen's group summaries (`dflop.planner.screen.ScreenResult.groups`),
    typed as `candidates_frame` types them. The screen has hundreds of thousands of groups at 1024
    GPUs, so every text column is taken from a few constants by index, not built per row."""
    if groups.empty:
        return _typed(pd.DataFrame(columns=list(COLUMNS)))
    g = groups
    no_fit = g["n_fit"].to_numpy() == 0
    side = (~g["llm_fits"].to_numpy(dtype=bool)).astype(np.int64) + 2 * (~g["vision_fits"].to_numpy(dtype=bool))
    side = np.choose(side, [0, 1, 0, 2])  # vision only / llm only / (unused) / both
    detail = np.where(no_fit, _NO_FIT[side], "lower bound above the plans kept")
    colocated = g["colocated"].to_numpy(dtype=bool)
    world = np.where(colocated, 0, g["tp_v"] * g["pp_v"] * g["dp_v"]) + g["tp_l"] * g["pp_l"] * g["dp_l"]
    has = g["dp_l"].to_numpy() >= 1
    out = pd.DataFrame({
        "kind": "plan", "level": "group", "placement": np.where(colocated, "colocated", "disjoint").astype(object),
        "tp_v": g["tp_v"], "pp_v": g["pp_v"], "dp_v": np.where(has, g["dp_v"], -1), "tp_l": g["tp_l"],
        "pp_l": g["pp_l"], "dp_l": np.where(has, g["dp_l"], -1), "m": g["m"], "world_size": np.where(has, world, -1),
        "status": np.where(no_fit, "rejected", "pruned").astype(object),
        "reason": np.where(no_fit, "memory", "bound").astype(object),
        "detail": detail.astype(object), "n_layouts": g["n_layouts"], "bound_s": g["bound_s"],
    })
    for col in ("dp_v", "dp_l", "world_size"):
        out[col] = out[col].astype("Int64").mask(out[col] < 1)
    return _typed(out)


def _typed(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with every documented column, in order, of its documented type (absent ones null, made
    null of that type directly: converting hundreds of thousands of Nones cost more than the rest)."""
    given = set(df.columns)
    kinds = {**dict.fromkeys(STRING_COLUMNS, "string"), **dict.fromkeys(INT_COLUMNS, "Int64"),
             **dict.fromkeys(FLOAT_COLUMNS, "float64"), **dict.fromkeys(BOOL_COLUMNS, "boolean")}
    out = {}
    for col in COLUMNS:
        kind = kinds.get(col)
        if col not in given:
            if kind is None:  # a list column: None per row (an empty one has always read as float64)
                out[col] = pd.Series(np.full(len(df), None, dtype=object) if len(df) else [], index=df.index,
                                     dtype=object if len(df) else np.float64)
            else:
                out[col] = pd.Series(np.nan if kind == "float64" else pd.NA, index=df.index, dtype=kind)
        elif kind in ("string", "boolean"):
            out[col] = df[col].astype(kind)
        elif kind is not None:
            out[col] = pd.to_numeric(df[col], errors="coerce").astype(kind)
        else:
            kind_of = int if col in LIST_COLUMNS else str
            out[col] = pd.Series([list(map(kind_of, v)) if isinstance(v, (list, tuple, np.ndarray)) else None
                                  for v in df[col]], index=df.index, dtype=object)
    return pd.DataFrame(out, index=df.index)


def candidates_frame(rows: list[dict], groups: pd.DataFrame | None = None) -> pd.DataFrame:
    """All rows in the documented column order and types (`rows`: dicts; `groups`: the screen's group
    summaries, `group_rows`)."""
    frames = [_typed(pd.DataFrame(rows))] if rows else []
    if groups is not None and len(groups):
        frames.append(group_rows(groups))
    if not frames:
        return _typed(pd.DataFrame())
    return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]


def write_candidates(df: pd.DataFrame, path: str | Path) -> None:
    """Write candidates.parquet atomically."""
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False)
