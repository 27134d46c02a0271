"""What each pipeline stage pays after its last backward: gradient sync, optimizer step, extras.

`dflop.pricing.stage.stage_tails` composes them for every stage of a layout, which `Pricing`
charges at a plan's split and the planner's stage model evaluates at 0 and 1 layers per stage.
Seconds throughout; bytes per rank.
"""

from __future__ import annotations

import numpy as np

from dflop.costmodel.model import StepCosts
from dflop.plan import Layout
from dflop.pricing.cluster import Cluster, Links


def stage_tail_s(grad_bytes, param_bytes, dp, intra, *, sharded: bool, cluster: Cluster,
                 measured: StepCosts, modules=1, optimizer_s=np.nan) -> np.ndarray:
    """Seconds a stage spends after its last backward: its data-parallel gradient synchronisation,
    then its optimizer step when `measured` has one. The sync
    is the measured all-reduce line for `dp` inside a node, its constant paid once for each of the
    stage's `modules` modules (`stage_modules`: the trainer buckets each module's gradients apart),
    or for a sharded module once for its reduce-scatter and once for its all-gather, which together
    move the same bytes; else the cluster's ring formula over the whole gradient. The optimizer
    step is the measured call plus the stages' `optimizer_s` where every stage of the call has
    them (none NaN) and the module is not sharded, else the measured bytes line on the rank's
    parameter bytes (also for a sharded module: the bytes line / dp, which leaves out the
    per-tensor cost each rank still pays for its shards, so sharding's optimizer is priced low on
    CPU, `benchmarks/bench_optimizer_pricing.py`). Affine in the bytes and `optimizer_s` (the
    planner splits it into a per-stage and a per-layer part). `measured`: `CostModel.step_costs_on`."""
    sharded = sharded and int(dp) > 1  # state sharded over one replica is all of it
    line = measured.allreduce.get(int(dp))  # (looked up first: without measured lines, no np.all per call)
    if line is not None and not bool(np.all(intra)):
        line = None
    if line is not None:  # sharded: one reduce-scatter and one all-gather per module (one FSDP group each)
        calls = np.asarray(modules, dtype=np.float64) * (2.0 if sharded else 1.0)
        sync = line.const_s * calls + line.per_byte_s * np.asarray(grad_bytes, dtype=np.float64)
    elif sharded:
        sync = cluster.reduce_scatter_s(grad_bytes, dp, intra) + cluster.reduce_scatter_s(param_bytes, dp, intra)
    else:
        sync = cluster.allreduce_s(grad_bytes, dp, intra)
    optimizer_s = np.asarray(optimizer_s, dtype=np.float64)
    if measured.optimizer_call_s is not None and not sharded and not np.isnan(optimizer_s).any():
        sync = sync + measured.optimizer_call_s + optimizer_s
    elif measured.optimizer is not None:
        sync = sync + measured.optimizer(np.asarray(param_bytes, dtype=np.float64) / (dp if sharded else 1))
    return np.asarray(sync, dtype=np.float64)


def stage_tails_s(layout: Layout, grad_bytes, param_bytes, optimizer_s, *, shard: tuple, tied_grad_bytes: float,
                  link: Links, cluster: Cluster, measured: StepCosts) -> np.ndarray:
    """[P] seconds every stage of `layout` (vision stages first) spends after its last backward on
    its own gradient sync and optimizer step: `stage_tail_s` per module, on the module's stages
    [P] `grad_bytes`, `param_bytes` and `optimizer_s` (NaN: unmeasured, then that module's every
    stage is on the bytes line), with the gradient buckets of `stage_modules`. `shard`: (vision,
    llm) whether each module's state is sharded over its replicas (colocated: the LLM's counts).
    The step's extras (`step_extras_s`) are not included.

    Called through `dflop.pricing.stage.stage_tails` (with the extras), for `Pricing` and the
    planner's stage model alike, so a new cost of the tail is added here once."""
    n_v = layout.n_vision_stages
    modules = stage_modules(layout, tied_bucket=tied_grad_bytes > 0 and not shard[1])
    grad_bytes, param_bytes = np.asarray(grad_bytes, dtype=np.float64), np.asarray(param_bytes, dtype=np.float64)
    optimizer_s = np.asarray(optimizer_s, dtype=np.float64)
    sides = [(slice(n_v, None), layout.dp_l, link.llm_allreduce_intra, shard[1])]
    if n_v:  # colocated: no vision stage of its own
        sides.insert(0, (slice(0, n_v), layout.dp_v, link.vision_allreduce_intra, shard[0]))
    return np.concatenate([stage_tail_s(grad_bytes[sl], param_bytes[sl], dp, intra, sharded=sharded, cluster=cluster,
                                        measured=measured, modules=modules[sl], optimizer_s=optimizer_s[sl])
                           for sl, dp, intra, sharded in sides])


def stage_modules(layout: Layout, tied_bucket: bool = False) -> np.ndarray:
    """[P] gradient buckets each stage syncs at least (vision stages first): one per module it
    holds, 2 on a colocated layout's first LLM stage (the vision tower and the LLM are bucketed
    apart, `dflop.runtime.optim.GradientSync`), and with `tied_bucket` (a tied embedding held on two
    LLM stages, pp_l > 1, not sharded) one more on each of those two for the table's own bucket.

    A module's gradients larger than one bucket (~25 MB; tensors larger than that alone) sync in
    several all-reduces: the pricing charges the constant of one (a lower bound; the count depends
    on the tensors' sizes, which the cost model does not hold)."""
    modules = np.ones(layout.n_vision_stages + layout.pp_l)
    if layout.colocated:
        modules[0] = 2.0
    if tied_bucket and layout.pp_l > 1:
        modules[layout.n_vision_stages] += 1.0
        modules[-1] += 1.0
    return modules


def step_extras_s(layout: Layout, tied_grad_bytes: float, *, cluster: Cluster, measured: StepCosts) -> np.ndarray:
    """[P] seconds each stage's tail pays besides its own gradient sync and optimizer step:

    - the step's two world all-reduces of a few numbers (the loss and answer-token totals, the
      global gradient norm; `dflop.runtime.trainer`), at the measured all-reduce constant of the
      world's size where the whole world sits in one node (not charged elsewhere: a ring formula
      would charge a few-byte message ~2 x world latencies);
    - on the first and the last LLM stage of a pipeline (pp_l > 1) with tied embeddings, the sum
      of the table's gradient over those two ranks (`tied_grad_bytes` per rank): the measured
      two-rank line inside a node, else the cluster's ring formula. With the LLM's state sharded
      each rank sums only its shard; priced whole all the same, so that sharding never shortens the
      step here (`dflop.planner.technique_choice.settle` switches a technique off wherever the
      split fits without it, taking techniques to cost time).
    """
    extras = np.zeros(layout.n_vision_stages + layout.pp_l)
    world = measured.allreduce.get(int(layout.world_size))
    if world is not None and bool(cluster.in_one_node(0, layout.world_size)):
        extras += 2.0 * world.const_s
    if tied_grad_bytes > 0 and layout.pp_l > 1:
        intra = bool(cluster.in_one_node(layout.vision_gpus, layout.llm_gpus))
        pair = measured.allreduce.get(2)
        tied = pair(tied_grad_bytes) if pair is not None and intra else cluster.allreduce_s(tied_grad_bytes, 2, intra)
        extras[layout.n_vision_stages] += float(tied)
        extras[-1] += float(tied)
    return extras
