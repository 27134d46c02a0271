"""What a plan's memory techniques cost: per pipeline stage, the price and the saving of each.

A plan (`dflop.plan.Techniques`) may recompute activations, shard the optimizer state over a
module's data-parallel replicas and run the LLM sequence-parallel. Users should see what each
choice buys on each stage and what it costs, so `technique_costs` prices every stage with its
techniques and with each one switched off (the others kept as planned), through the cost model's
own stage terms (`CostModel.*_stage_terms`, `recompute=` / `shard_over=`) and the one pricing
path's all-reduce (`dflop.pricing.pricing.Pricing.allreduce_s`); no cost formula lives here.

Figures are at the plan's MEAN microbatch, as the planner's stage model takes it
(`dflop.planner.stages.build_stage_model`): ``global_batch / (m * dp)`` mean samples of the pool
per microbatch of a stage (the module's dp; the colocated vision tower rides on LLM stage 0 with
the LLM's samples), ``const + nu * mean per-sample term`` (`dflop.planner.means.PartMeans`).

Rows: one per pipeline stage, vision stages first, named as `Plan.stage_name` names them. In the
colocated placement LLM stage 0 carries the whole vision tower, priced with the vision module's
one recompute mode and sharding flag: that stage has two rows, the vision tower's and the LLM's;
the stage-level columns (``peak_bytes``, ``shard_comm_extra_s``) repeat on both.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from dflop.costmodel.model import CostModel
from dflop.plan import Plan
from dflop.pricing.cluster import Cluster
from dflop.planner.means import PartMeans
from dflop.pricing.pool import Pool, TransferSizes
from dflop.pricing.pricing import Pricing

COLUMNS = ("stage", "name", "module", "layers", "recompute", "shard_optimizer", "sequence_parallel",
           "recompute_extra_s", "activation_saved_bytes", "state_saved_bytes", "sp_saved_bytes",
           "shard_comm_extra_s", "peak_bytes")
"""stage: pipeline stage index; recompute_extra_s: backward seconds per microbatch the recompute
mode adds; activation_saved_bytes: in-flight microbatches x activation bytes it saves;
state_saved_bytes: training-state bytes a rank does not hold with the optimizer sharded;
sp_saved_bytes: activation bytes sequence parallelism saves; shard_comm_extra_s: seconds per step sharded synchronisation costs over the all-reduce;
peak_bytes: the stage's peak per rank under the plan's schedule at the mean microbatch (an LLM
rank's chunks summed), with its techniques (its state,
in-flight activations and largest transient)."""


def technique_costs(plan: Plan, cost: CostModel, pool: Pool, cluster: Cluster, sizes: TransferSizes, *,
                    global_batch: int) -> pd.DataFrame:
    """Per stage of `plan`: its techniques and what each costs and saves (module docstring)."""
    lay = plan.layout
    in_flight = lay.in_flight()
    n_v = lay.n_vision_stages
    vision, llm = plan.vision_techniques, plan.llm_techniques
    nu_l = global_batch / (lay.m * lay.dp_l)
    nu_v = nu_l if lay.colocated else global_batch / (lay.m * lay.dp_v)

    def vision_terms(k: int, mode: str, shard: bool, sp: bool):
        del sp  # the trainer has no SP for the vision tower
        return cost.vision_stage_terms(pool.n_tiles, n_layers=plan.vision_layers[k], first=k == 0,
                                       last=k == lay.pp_v - 1, tp=lay.tp_v, recompute=mode,
                                       shard_over=lay.dp_v if shard else 1)

    def llm_terms(j: int, mode: str, shard: bool, sp: bool):
        return cost.llm_stage_terms(pool.seq_len, n_layers=rank_layers[j], first=j == 0,
                                    last=j == lay.pp_l - 1, tp=lay.tp_l, recompute=mode,
                                    shard_over=lay.dp_l if shard else 1,
                                    sequence_parallel_hidden=sizes.llm_hidden if sp else 0)

    rank_layers, rank_modes = plan.llm_rank_layers, plan.llm_rank_recompute()  # per LLM rank, chunks summed
    parts = []  # (pipeline stage, module, layers, its terms, index in the module, techniques, mode, nu)
    for k in range(lay.pp_v):
        stage = k if not lay.colocated else 0
        parts.append((stage, "vision", plan.vision_layers[k], vision_terms, k, vision, vision.recompute[k], nu_v))
    for j in range(lay.pp_l):
        parts.append((n_v + j, "llm", rank_layers[j], llm_terms, j, llm, rank_modes[j], nu_l))

    shard_extra = _shard_comm_extra_s(plan, cost, cluster, sizes)
    rows = []
    for stage, module, layers, terms, index, tech, mode, nu in parts:
        sp = tech.sequence_parallel
        at = lambda **change: PartMeans.from_terms(terms(index, **{"mode": mode, "shard": tech.shard_optimizer,
                                                                   "sp": sp, **change}))
        planned, no_rc, no_shard = at(), at(mode="none"), at(shard=False)
        f = in_flight[stage]
        sp_saved = f * (at(sp=False).act_mean(nu) - planned.act_mean(nu)) if sp else 0.0
        rows.append({
            "stage": stage, "name": plan.stage_name(stage), "module": module, "layers": int(layers),
            "recompute": mode, "shard_optimizer": tech.shard_optimizer, "sequence_parallel": sp,
            "recompute_extra_s": planned.bwd_s(nu) - no_rc.bwd_s(nu),
            "activation_saved_bytes": f * (no_rc.act_mean(nu) - planned.act_mean(nu)),
            "state_saved_bytes": no_shard.static_bytes - planned.static_bytes,
            "sp_saved_bytes": sp_saved,
            "shard_comm_extra_s": float(shard_extra[stage]),
            "peak_bytes": planned.static_bytes + f * planned.act_mean(nu),
            "transient": planned.transient_mean(nu),
        })
    table = pd.DataFrame(rows, columns=[*COLUMNS, "transient"])
    by_stage = table.groupby("stage")  # colocated: both parts' state and activations, the larger transient
    table["peak_bytes"] = by_stage["peak_bytes"].transform("sum") + by_stage["transient"].transform("max")
    return table.drop(columns="transient")


def _shard_comm_extra_s(plan: Plan, cost: CostModel, cluster: Cluster, sizes: TransferSizes) -> np.ndarray:
    """[P] seconds per step each stage's sharding changes in its tail: the sharded synchronisation
    over the plain all-reduce, less the optimizer step it shrinks when the cost model measured one
    (`stage_tail_s`; so it can be negative)."""
    unsharded = plan.with_techniques(replace(plan.vision_techniques, shard_optimizer=False),
                                     replace(plan.llm_techniques, shard_optimizer=False))
    return Pricing(plan, cost, cluster, sizes).allreduce_s - Pricing(unsharded, cost, cluster, sizes).allreduce_s


def techniques_record(table: pd.DataFrame) -> list[dict]:
    """plan.yaml's ``techniques`` record: one compact mapping per row of `technique_costs`
    (bytes as integers, seconds to 6 significant digits)."""
    seconds = lambda x: float(f"{x:.6g}")
    out = []
    for row in table.itertuples(index=False):
        out.append({"stage": int(row.stage), "name": row.name, "module": row.module, "layers": int(row.layers),
                    "recompute": row.recompute, "shard_optimizer": bool(row.shard_optimizer),
                    "sequence_parallel": bool(row.sequence_parallel),
                    "recompute_extra_s": seconds(row.recompute_extra_s),
                    "activation_saved_bytes": int(round(row.activation_saved_bytes)),
                    "state_saved_bytes": int(round(row.state_saved_bytes)),
                    "sp_saved_bytes": int(round(row.sp_saved_bytes)),
                    "shard_comm_extra_s": seconds(row.shard_comm_extra_s),
                    "peak_bytes": int(round(row.peak_bytes))})
    return out


def format_techniques(table: pd.DataFrame) -> str:
    """The per-stage technique table as aligned text (what `dflop simulate` prints and the report
    shows), or one line when no technique is on. Both prices are shown: recomputation's per
    microbatch (+bwd ms/mb) and sharding's per step (shard ms/step, `shard_comm_extra_s`; negative
    when the smaller optimizer step outweighs the extra synchronisation)."""
    on = (table["recompute"] != "none") | table["shard_optimizer"] | table["sequence_parallel"]
    if not on.any():
        return "memory techniques: none"
    gb = lambda x: f"{x / 1e9:.3g}"
    shared = table["stage"].duplicated(keep=False)  # colocated LLM stage 0: vision tower and LLM rows
    header = ("stage", "recompute", "shard opt", "seq par", "+bwd ms/mb", "shard ms/step", "act saved GB",
              "state saved GB", "SP saved GB", "peak GB")
    body = [(f"llm stage 0: {r.module}" if two else r.name, r.recompute, "yes" if r.shard_optimizer else "no",
             "yes" if r.sequence_parallel else "no", f"{r.recompute_extra_s * 1e3:.3g}",
             f"{r.shard_comm_extra_s * 1e3:.3g}", gb(r.activation_saved_bytes), gb(r.state_saved_bytes),
             gb(r.sp_saved_bytes), gb(r.peak_bytes))
            for r, two in zip(table.itertuples(index=False), shared)]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join(["memory techniques (at the mean microbatch):", fmt(header), *map(fmt, body)])
