"""What the optimizer writes into plan.yaml (DESIGN §4), and the checks a plan must pass to run.

The file's type, reader, writer and validator are `dflop.plan`; this module assembles the
optimizer's mapping (`plan_document`).

Top-level keys::

    version: 1
    placement: disjoint | colocated
    world_size: GPUs (processes) the plan uses
    global_batch_size, microbatches
    vision: {tp, pp, dp, layers_per_stage, recompute, shard_optimizer, sequence_parallel}
    llm:    {tp, pp, dp, layers_per_stage, recompute, shard_optimizer, sequence_parallel}
    rank_order: how ranks map to (module, stage, replica, tp rank) (as dflop.runtime.topology)
    predicted: {step_s: {mean, p50, p90}, mean_shape_step_s, utilisation, samples_per_s,
                memory_bytes: {vision: [per stage], llm: [per stage]}, memory_limit_bytes}
               (memory: each stage's peak over the sampled batches, state + in-flight activations +
               the largest transient, `dflop.planner.expected.peak_memory`)
    techniques: [per pipeline stage: {stage, name, module, layers, recompute, shard_optimizer,
                 sequence_parallel, recompute_extra_s, activation_saved_bytes, state_saved_bytes,
                 sp_saved_bytes, shard_comm_extra_s, peak_bytes}] what the plan's memory techniques
                 cost and save at the mean microbatch (`dflop.planner.techniques`); informative
                 only (the trainer reads vision/llm), absent in plans written before it existed
    baseline: {placement, world_size, global_batch_size, microbatches, vision, llm, micro_batch_size,
               policy, label, predicted} or null (itself a complete plan mapping): the Megatron-style
               packed data-blind trainer
    speedup: baseline mean step / plan mean step (null without a baseline)
    vision_heads_padded: {tp, heads, padded_heads} when the plan's vision TP degree pads the tower's
               heads with zero heads (e.g. InternViT-6B at tp 8: 25 -> 32; informative, the trainer
               pads by the same rule, `dflop.models.info.padded_vision_heads`); absent otherwise, and
               likewise inside baseline / padded_baseline
    padded_baseline: the same record for the HF/LLaVA trainer (microbatches padded to their longest
               sample, policy "padded"; its predicted.mean_shape_step_s is null: the mean-shape step
               packs), or null; absent from files written before it existed
    speedup_padded: padded_baseline mean step / plan mean step (null without one)
    solver: {name, status, time_s, milps, statuses, top_k_proven, layouts, feasible, time_limit_s, rel_gap,
             wall_s}: status is the chosen plan's MILP status; milps counts the layouts that reached the
             MILP step (solved, single split, or pruned by the cutoff proof: status "cutoff"), statuses
             them by status (summing to milps), time_s their solver seconds
    evaluation: {sample_batches, seed, racing, scheduler: {policy, budget_s, ilp}}
    cluster: the cluster section it was planned for (config units)
    model: {arch, vision, llm, weights, dtype}
    inputs: {shapes, costmodel}

In the colocated placement the vision tower runs on the first LLM stage's ranks: ``vision.pp`` is
1, ``vision.dp``/``vision.tp`` equal the LLM's, and ``predicted.memory_bytes.vision`` is empty
(its memory is inside LLM stage 0).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dflop.errors import UserError
from dflop.plan import RANK_ORDER, Plan, Prediction
from dflop.pricing.cluster import Cluster
from dflop.planner.expected import Evaluation
from dflop.planner.space import ModelShape
from dflop.scheduler.policy import Policy


def predicted_section(ev: Evaluation, *, global_batch: int, memory_limit_bytes: float,
                      mean_shape_step_s: float | None) -> dict:
    """`ev`'s plan.yaml ``predicted`` record (`dflop.plan.Prediction`)."""
    n_v = ev.plan.layout.n_vision_stages
    mem = tuple(int(round(x)) for x in ev.memory_bytes)
    return Prediction(ev.mean_s, ev.p50_s, ev.p90_s, mean_shape_step_s, ev.mean_utilisation,
                      global_batch / ev.mean_s, mem[:n_v], mem[n_v:], int(round(memory_limit_bytes)),
                      len(ev.step_s)).to_dict()


BASELINE_LABELS = {Policy.MEGATRON: "Megatron-style packed data-blind", Policy.PADDED: "HF/LLaVA padded"}


def vision_padding_record(plan: Plan, shape: ModelShape | None) -> dict:
    """``{"vision_heads_padded": {tp, heads, padded_heads}}`` when `plan`'s vision TP pads heads, else {}."""
    if shape is None or not shape.vision_padding(plan.layout.tp_v):
        return {}
    tp = plan.layout.tp_v
    return {"vision_heads_padded": {"tp": tp, "heads": shape.vision_heads, "padded_heads": shape.vision_heads_at(tp)}}


def plan_document(*, chosen: Evaluation, mean_shape_step_s: float, baseline: Evaluation | None,
                  baseline_mean_shape_s: float | None, global_batch: int, cluster: Cluster, solver: dict,
                  evaluation: dict, model: dict, inputs: dict, padded_baseline: Evaluation | None = None,
                  techniques: list[dict] | None = None, shape: ModelShape | None = None) -> dict:
    """The plan.yaml mapping (module docstring): `Plan.to_dict` keys first, then what was predicted;
    techniques: the chosen plan's `dflop.planner.techniques.techniques_record` (None: left out);
    shape: the model structure, to record vision head padding (None: not recorded)."""
    plan = chosen.plan
    doc: dict[str, Any] = {"version": 1, **plan.to_dict(global_batch), **vision_padding_record(plan, shape),
                           "rank_order": RANK_ORDER,
                           "predicted": predicted_section(chosen, global_batch=global_batch,
                                                          memory_limit_bytes=cluster.gpu_memory_bytes,
                                                          mean_shape_step_s=mean_shape_step_s)}
    if techniques is not None:
        doc["techniques"] = techniques
    doc.update({"baseline": None, "speedup": None, "padded_baseline": None, "speedup_padded": None})
    for key, speedup, ev, mean_shape_s in (("baseline", "speedup", baseline, baseline_mean_shape_s),
                                           ("padded_baseline", "speedup_padded", padded_baseline, None)):
        if ev is None:
            continue
        doc[key] = {
            **ev.plan.to_dict(global_batch), **vision_padding_record(ev.plan, shape),
            "micro_batch_size": global_batch // ev.plan.layout.n_bins,
            "policy": ev.policy, "label": BASELINE_LABELS[ev.policy],
            "predicted": predicted_section(ev, global_batch=global_batch, memory_limit_bytes=cluster.gpu_memory_bytes,
                                           mean_shape_step_s=mean_shape_s),
        }
        doc[speedup] = ev.mean_s / chosen.mean_s
    doc.update({"solver": solver, "evaluation": evaluation, "cluster": cluster.to_config(), "model": model,
                "inputs": inputs})
    return _plain(doc)


def _plain(x):
    """numpy scalars/arrays -> Python types, so yaml.safe_dump can write them."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_plain(v) for v in x]
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, str):  # a Policy: its name
        return str(x)
    return x
