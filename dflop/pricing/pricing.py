"""The one pricing path: plan + cost model + samples -> what the 1F1B simulator takes.

Every prediction of a step goes through `Pricing`: the planner's expected step (plan.yaml), the
online scheduler's partitions and the trainer's ``predicted_step_s`` (metrics.parquet), the
what-if of `dflop simulate` and the benchmarks. For one global batch it gives every sample's cost
on every stage of the plan (`CostModel.batch_costs`) with the transfers added to the receiving
stages per sample (vision features into LLM stage 0 and their gradients back, hidden states
between stages; bandwidths from `dflop.pricing.cluster`), and, per plan, the per-stage gradient
all-reduce seconds and the pipeline send latency that the simulation charges.

Where the cost model carries measured step costs (`dflop.costmodel.model.StepCosts`, from the
profiler's ranks on the same kind of device), they replace the cluster's declared numbers inside a
node: the all-reduce line for the group size, the P2P line for hops and its constant as the send
latency; and each stage's tail also pays its optimizer step. On a CPU cluster a measured per-sample
load line (`LoadLine`) is charged too, to the forward of the stage that decodes the sample (the
trainer's loader shares those cores); on GPUs the loader hides behind the step and is not charged.

Interleaved 1F1B (``llm.chunks`` = v > 1): every LLM model chunk is also priced as a stage of its
own (its layers and recompute mode, the embedding on chunk 0, the head on the last, a hop into
every chunk but the first) and the batch's costs carry them (`BatchCosts.llm_chunks`: what every
simulation times, `dflop.scheduler.evaluate.simulate_times`). The LLM rows stay one per pipeline
rank: their times the sums of the rank's chunks (what the scheduler balances), their memory the
rank's own (its layers under the schedule's in-flight count, `Layout.in_flight`: what the memory
guard and the planner check), and the all-reduce and optimizer tails per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from dflop.costmodel.batch import batch_costs
from dflop.costmodel.model import CostModel, StepCosts, charged_load_line
from dflop.costmodel.types import BatchCosts, LLMChunkCosts
from dflop.errors import UserError
from dflop.models.handle import ModelHandle
from dflop.plan import RECOMPUTE_MODES, Plan
from dflop.pricing.cluster import Cluster, links
from dflop.pricing.pool import Pool, TransferSizes
from dflop.pricing.stage import StageState, cost_state_of, stage_state, stage_tails


def stage_transfers(layout, *, vision_hop=0.0, vision_features=0.0, llm_hop=0.0, llm_features=0.0) -> tuple[list, list]:
    """([P] forward, [P] backward) transfer seconds charged to each stage of `layout` (vision
    stages first): the receiving stage pays, in its forward for activations and in its backward
    for their gradients. Each entry is one of the arguments (seconds, a float or [B] per sample) or 0.0.

    vision_hop / llm_hop: hidden states between two stages of a module; vision_features: the
    features the last vision stage sends (its backward receives their gradient); llm_features: the
    same features as LLM stage 0 receives them (none when colocated: the tower is on that stage).
    The two features arguments differ where a vision microbatch and an LLM bin hold different
    samples (the planner's mean shapes); `Pricing.batch` passes the same per-sample seconds.
    The one placement of the transfers: `Pricing.batch` per sample, the planner's stage model
    (`dflop.planner.stages`) per mean microbatch."""
    n_v, pp_l = layout.n_vision_stages, layout.pp_l
    fwd = [vision_hop if k > 0 else 0.0 for k in range(n_v)]
    bwd = [vision_hop if k < n_v - 1 else vision_features for k in range(n_v)]
    fwd += [llm_hop if j > 0 else (0.0 if layout.colocated else llm_features) for j in range(pp_l)]
    bwd += [llm_hop if j < pp_l - 1 else 0.0 for j in range(pp_l)]
    return fwd, bwd


@dataclass(frozen=True)
class PlanCosts:
    """One global batch on one plan: costs with transfers (what the scheduler sees), the per-stage
    all-reduce seconds [P], and the busy GPU-seconds of its compute."""

    costs: BatchCosts
    allreduce_s: np.ndarray
    busy_gpu_s: float


@dataclass(frozen=True)
class Pricing:
    """How `plan` prices a batch on `cluster` with `cost` (module docstring)."""

    plan: Plan
    cost: CostModel = field(repr=False)
    cluster: Cluster
    sizes: TransferSizes

    @classmethod
    def of(cls, plan: Plan, cost: CostModel, model: ModelHandle, cluster: Cluster) -> "Pricing":
        """`plan`'s pricing, the transfer sizes taken from `model` in the cost model's dtype."""
        info = model.info
        sizes = TransferSizes.for_model(llm_hidden=info.llm_hidden, vision_hidden=info.vision_hidden,
                                        vision_tokens_per_tile=info.vision_tokens_per_tile,
                                        dtype=cost.provenance.dtype)
        return cls(plan, cost, cluster, sizes)

    @cached_property
    def _measured(self) -> StepCosts:
        """The cost model's measured step costs where they hold on this cluster (`step_costs_on`)."""
        return self.cost.step_costs_on(self.cluster.device)

    @property
    def p2p_s(self) -> float:
        """Latency of one pipeline send (seconds), charged by the simulation per hop: the measured
        message's constant inside a node where the profile has it, else the cluster's (`links`)."""
        return float(self._links.p2p_latency_s)

    @cached_property
    def allreduce_s(self) -> np.ndarray:
        """[P] seconds each stage spends after its last backward (vision stages first): its
        data-parallel gradient synchronisation, then its optimizer step when the cost model measured
        one, and the step's world all-reduces and tied-embedding sum (`dflop.pricing.stage.stage_tails`,
        which the planner's stage model evaluates at 0 and 1 layers per stage).

        A module with ``shard_optimizer`` (`dflop.runtime.sharding`) instead all-gathers its
        parameters once per step and reduce-scatters its gradients once: both priced here, as
        one fixed cost per step, like the all-reduce (the simulation charges it after the stage's
        last backward; the all-gather really runs before its first forward, neither overlaps)."""
        lay = self.plan.layout
        # colocated: plan.llm's flags (no vision stage)
        shard = (self.plan.vision.techniques.shard_optimizer, self.plan.llm.techniques.shard_optimizer)
        tied_bytes = self.cost.tied_llm_state(lay.tp_l).grad_bytes
        return stage_tails(lay, self.states, shard=shard, tied_grad_bytes=tied_bytes,
                           link=self._links, cluster=self.cluster, measured=self._measured)

    @cached_property
    def states(self) -> StageState:
        """[P] training state and optimizer seconds of every stage, one rank, unsharded
        (`dflop.pricing.stage.stage_state`, which the planner's stage model evaluates at 0 and 1 layers)."""
        lay = self.plan.layout
        return stage_state(lay, cost_state_of(self.cost, lay.tp_v, lay.tp_l), self.plan.vision_layers,
                           self.plan.llm_rank_layers)

    @property
    def sp_hidden(self) -> int:
        """The LLM hidden size SP's activation saving is priced from, 0 when the plan has no LLM SP."""
        if not self.plan.llm_techniques.sequence_parallel:
            return 0
        if not self.sizes.llm_hidden:
            raise UserError("pricing a sequence-parallel plan needs the LLM hidden size (TransferSizes.for_model)")
        return self.sizes.llm_hidden

    @cached_property
    def _links(self):
        lay = self.plan.layout
        return links(self.cluster, colocated=lay.colocated, tp_v=lay.tp_v, pp_v=lay.pp_v, dp_v=lay.dp_v,
                     tp_l=lay.tp_l, pp_l=lay.pp_l, dp_l=lay.dp_l, p2p=self._measured.p2p)

    def batch(self, batch: Pool) -> PlanCosts:
        """Per-sample costs of the samples of `batch` (in batch order) on the plan."""
        plan, lay, sizes, link = self.plan, self.plan.layout, self.sizes, self._links
        vision, llm = plan.vision_techniques, plan.llm_techniques
        # per LLM rank (its chunks' layers together): the memory the guard checks
        base = batch_costs(self.cost, batch.n_tiles, batch.seq_len, vision_layers_per_stage=list(plan.vision_layers),
                           llm_layers_per_stage=list(plan.llm_rank_layers), tp_v=lay.tp_v, tp_l=lay.tp_l,
                           mem_limit_bytes=self.cluster.gpu_memory_bytes,
                           in_flight_per_stage=lay.in_flight(), colocated=lay.colocated,
                           vision_recompute=vision.recompute, llm_recompute=self._llm_rank_recompute(),
                           vision_shard_over=lay.dp_v if vision.shard_optimizer else 1,
                           llm_shard_over=lay.dp_l if llm.shard_optimizer else 1,
                           llm_sequence_parallel_hidden=self.sp_hidden)
        llm_fwd, llm_bwd = base.llm_fwd.copy(), base.llm_bwd.copy()
        vis_fwd, vis_bwd = base.vision_fwd.copy(), base.vision_bwd.copy()
        hop = batch.seq_len * sizes.llm_token_bytes / float(link.llm_hop_bps)
        features = vhop = 0.0
        if not lay.colocated:
            features = batch.vision_tokens * sizes.llm_token_bytes / float(link.vision_to_llm_bps)
            vhop = batch.n_tiles * sizes.vision_tile_bytes / float(link.vision_hop_bps)
        fwd, bwd = stage_transfers(lay, vision_hop=vhop, vision_features=features, llm_hop=hop, llm_features=features)
        n_v = lay.n_vision_stages
        for k in range(n_v):
            vis_fwd[k] += fwd[k]
            vis_bwd[k] += bwd[k]
        for j in range(lay.pp_l):
            llm_fwd[j] += fwd[n_v + j]
            llm_bwd[j] += bwd[n_v + j]
        load = self.load_s(batch)
        if load is not None and (lay.colocated or not len(vis_fwd)):  # one stage decodes everything
            llm_fwd[0] += load
        elif load is not None:  # pixels where the vision tower starts, text-only samples where the LLM does
            vis_fwd[0] += np.where(batch.n_tiles > 0, load, 0.0)
            llm_fwd[0] += np.where(batch.n_tiles > 0, 0.0, load)
        costs = replace(base, llm_fwd=llm_fwd, llm_bwd=llm_bwd, vision_fwd=vis_fwd, vision_bwd=vis_bwd)
        compute = base
        if lay.chunks > 1:  # the chunks' own times; a rank's time rows are their sums
            compute, chunks = self._chunk_costs(batch, load)
            costs = replace(costs, llm_fwd=chunks.rank_sum(chunks.fwd), llm_bwd=chunks.rank_sum(chunks.bwd),
                            llm_fwd_const=chunks.rank_sum(chunks.fwd_const),
                            llm_bwd_const=chunks.rank_sum(chunks.bwd_const), llm_chunks=chunks)
        busy = lay.tp_l * float((compute.llm_fwd + compute.llm_bwd).sum()
                                + lay.n_bins * (compute.llm_fwd_const + compute.llm_bwd_const).sum())
        busy += lay.tp_v * float((base.vision_fwd + base.vision_bwd).sum()
                                 + lay.m * lay.dp_v * (base.vision_fwd_const + base.vision_bwd_const).sum())
        return PlanCosts(costs, self.allreduce_s, busy)

    def _llm_rank_recompute(self) -> tuple[str, ...]:
        """[pp_l] the recompute mode each LLM rank's memory is priced in: its chunks' mode or, where
        a hand-written plan gives a rank's chunks different modes, the one of them that saves the
        least (`RECOMPUTE_MODES` order): an upper bound on its activations. Times are the chunks' own."""
        modes, p = self.plan.llm_techniques.recompute, self.plan.layout.pp_l
        return tuple(min(modes[r::p], key=RECOMPUTE_MODES.index) for r in range(p))

    def _chunk_costs(self, batch: Pool, load: np.ndarray | None) -> tuple[BatchCosts, LLMChunkCosts]:
        """(compute, with transfers) of `batch` on every LLM model chunk of an interleaved plan
        ([pp_l x chunks] rows in chunk order): an LLM hop into every chunk after the first (chunk
        c + 1 runs on the next rank, the wrap from the last rank to rank 0 included), the
        first/last extras (embeddings, head) on the first/last chunk and the host's `load` where
        `batch` charges it (chunk 0 is on LLM rank 0). Only the times are used (memory is the ranks')."""
        plan, lay, sizes, link = self.plan, self.plan.layout, self.sizes, self._links
        n_chunks, n_v = lay.n_llm_chunks, lay.n_vision_stages
        base = batch_costs(self.cost, batch.n_tiles, batch.seq_len, vision_layers_per_stage=list(plan.vision_layers),
                           llm_layers_per_stage=list(plan.llm_layers), tp_v=lay.tp_v, tp_l=lay.tp_l,
                           mem_limit_bytes=float("inf"), in_flight_per_stage=[1] * (n_v + n_chunks),
                           colocated=lay.colocated, vision_recompute=plan.vision_techniques.recompute,
                           llm_recompute=plan.llm_techniques.recompute, vision_shard_over=1, llm_shard_over=1,
                           llm_sequence_parallel_hidden=self.sp_hidden)
        flat = replace(lay, pp_l=n_chunks, schedule="1f1b", chunks=1)
        hop = batch.seq_len * sizes.llm_token_bytes / float(link.llm_hop_bps)
        features = 0.0 if lay.colocated else batch.vision_tokens * sizes.llm_token_bytes / float(link.vision_to_llm_bps)
        fwd, bwd = stage_transfers(flat, llm_hop=hop, llm_features=features)
        llm_fwd, llm_bwd = base.llm_fwd.copy(), base.llm_bwd.copy()
        for c in range(n_chunks):
            llm_fwd[c] += fwd[n_v + c]
            llm_bwd[c] += bwd[n_v + c]
        if load is not None:
            llm_fwd[0] += np.where(batch.n_tiles > 0, 0.0, load) if n_v else load
        return base, LLMChunkCosts(llm_fwd, llm_bwd, base.llm_fwd_const, base.llm_bwd_const, lay.chunks)

    def wgrad_frac(self, batch: Pool) -> float:
        """Share of the LLM's backward that computes weight gradients (ZB-H1's W), from FLOP counts:
        a layer's linear weights P (per TP rank: its parameter bytes over the dtype's bytes) cost
        ``2 P L`` forward FLOPs on L tokens, their backward ``2 P L`` for dX and ``2 P L`` for dW;
        the causal attention core costs ``2 (h / tp) L^2`` forward and twice that backward, with no
        weights. W's share is ``sum 2 P L / sum (4 P L + 4 (h / tp) L^2)`` over the batch's samples.
        An analytic first step: the profiler has no split-backward target yet; embeddings, head and
        recomputation (which adds a forward to the backward) are left out."""
        lay = self.plan.layout
        if not self.sizes.llm_hidden:
            return 0.5  # no model shape: the simulator's default (linear layers only)
        terms = self.cost.llm_stage_terms(np.array([1]), n_layers=1, first=False, last=False, tp=lay.tp_l)
        nbytes = self.sizes.llm_token_bytes / self.sizes.llm_hidden
        params = terms.static.param_bytes / nbytes
        L = np.asarray(batch.seq_len, dtype=np.float64)
        h = self.sizes.llm_hidden / lay.tp_l
        linear = 2.0 * params * L
        return float(linear.sum() / (2.0 * linear + 4.0 * h * L * L).sum())

    def load_s(self, batch: Pool) -> np.ndarray | None:
        """[B] seconds the host takes to load each sample of `batch`, where that load shares the
        cores with compute (a CPU cluster, the cost model having a measured `LoadLine`); None on
        GPUs, where the loader decodes the next step's samples behind the current step."""
        line = charged_load_line(self._measured, self.cluster.device)
        return None if line is None else line(batch.load_features)
