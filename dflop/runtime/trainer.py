"""One rank of a training run: its modules, optimizer and data path, one global batch at a time.

The loop (`dflop.runtime.run`) begins a step (`begin_step`), takes its batch from a
`dflop.runtime.step_source.StepSource` (rank 0's `StepPlanner` partitioned it, priced by the one
pricing path; every rank loaded its share, and the ranks agree that it loaded) and hands it to
`train_step`:

1. `PipelineExecutor.run`: 1F1B over vision then LLM stages; the loss is the SUM of answer-token
   losses per bin (on CPU computed while the ranks still agree on the loads: `gradients`);
2. one world all-reduce of (loss sum, answer tokens); gradients: tied-embedding sum, data-parallel
   sum (a ``shard_optimizer`` module's by FSDP2's reduce-scatter, `dflop.runtime.sharding`),
   divided by the global answer-token count (the exact mean over the global batch);
3. global-norm clipping, AdamW, LR schedule (warm-up + cosine) (`optimizer_step`);
4. every rank's stage times gathered, for the metrics row and rank 0's adaptive correction.

The trainer is Stateful for the checkpointer (`state_dict`). `spans` traces the steps of
``train.trace_steps`` (`dflop.runtime.spans`): forwards / backwards, P2P messages, the gradient
sync (``allreduce``: from the pipeline's end until every gradient is reduced), the optimizer step.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from dflop.costmodel.analytic import analytic_cost_model
from dflop.costmodel.model import CostModel
from dflop.data.readers import RawSample
from dflop.data.sampling import dataset_mix
from dflop.data.training import ExpectedShape, TrainingData
from dflop.errors import UserError
from dflop.models.handle import ModelHandle
from dflop.models.packing import select_packed_kernel
from dflop.models.precision import Precision
from dflop.plan import Plan, PlanFile
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool
from dflop.pricing.pricing import Pricing
from dflop.runtime.agreement import rank0_result
from dflop.runtime.checkpoint import TrainState
from dflop.runtime.launch import check_trainable_schedule
from dflop.runtime.loading import StepLoader, feature_rows_fn, processors_needed, requests_for
from dflop.runtime.metrics import StepStats, measured_times
from dflop.runtime.model import build_rank_modules
from dflop.models.optimizer import build_optimizer
from dflop.runtime.optim import GradientSync, build_lr_scheduler, follow_schedule, param_infos, warmup_cosine
from dflop.runtime.p2p import P2P
from dflop.runtime.param_names import rank_parameters
from dflop.runtime.run_identity import run_fingerprint
from dflop.runtime.schedule import PipelineExecutor
from dflop.runtime.spans import SpanRecorder, rank_labels, trace_window, write_trace
from dflop.runtime.settings import TrainSettings
from dflop.runtime.sharding import StepSharding
from dflop.runtime.skipping import FailureCheck, SkippedSamples, StepAborted
from dflop.runtime.topology import Topology
from dflop.scheduler.online import GlobalBatches, StepPlan, StepPlanner
from dflop.scheduler.padded import price
from dflop.scheduler.settings import SchedulerSettings

if TYPE_CHECKING:
    from dflop.runtime.step_source import Batch

log = logging.getLogger("dflop.train")


def training_pricing(plan: Plan, model: ModelHandle, cost: CostModel | None, cluster: Cluster) -> Pricing:
    """How the trainer prices its batches: the fitted cost model (None: the FLOP-count stand-in of
    `dflop.costmodel.analytic`, for runs without a profile) on `cluster` (the one plan.yaml was
    planned for, so the trainer's predictions are the planner's: `plan_cluster`)."""
    if cost is None:
        cost = analytic_cost_model(model.config, tp_degrees=sorted({plan.layout.tp_v, plan.layout.tp_l}),
                                   dtype=model.spec.dtype, preset=model.spec.preset, info=model.info)
    return Pricing.of(plan, cost, model, cluster)


def plan_cluster(plan_file: PlanFile, settings: TrainSettings) -> Cluster:
    """The cluster plan.yaml records (what optimize priced with), else the config's (a hand-written plan):
    rule train passes only the cluster section's device keys, not the bandwidths the plan was made for."""
    record = plan_file.doc.get("cluster")
    if record is None:
        return Cluster.from_section(settings.cluster)
    return Cluster.from_record(record, plan_file.source)


def step_planner(settings: TrainSettings, pricing: Pricing, pool: pd.DataFrame, batches: GlobalBatches,
                 rules) -> StepPlanner:
    """Rank 0's online scheduler for `pricing`'s plan: every global batch priced by the one pricing
    path, partitioned with its send latency and all-reduces (``scheduler.ilp`` says whether the
    portfolio's exact member runs). The padded baseline (``scheduler.pad_to_longest``) is priced as
    the planner prices it (`dflop.scheduler.padded.price`): its fixed-count bins do not depend on
    the costs, but its predicted step must pay the padding the executor computes."""
    sched = SchedulerSettings.of_config(settings.scheduler)
    whole = Pool.from_shapes(pool, where="the trainer's shapes")  # checked once, each batch a take of it
    if len(whole) != len(pool):
        raise UserError("the trainer's shapes hold rows whose status is not ok: pass `read_shapes`' table")
    return StepPlanner(pool, batches, pricing.plan, lambda rows: price(pricing, whole.take(rows), sched.policy).costs,
                       feature_rows_fn(rules), policy=sched.policy, budget_s=sched.budget_s,
                       prefetch=settings.scheduler.prefetch, seed=settings.seed, total_steps=settings.train.steps,
                       adaptive=settings.adaptive_correction, p2p_s=pricing.p2p_s, allreduce_s=pricing.allreduce_s,
                       ilp=sched.ilp, wgrad_frac_fn=lambda rows: pricing.wgrad_frac(whole.take(rows)))


class Trainer:
    """One rank's model, optimizer, data path and step (module docstring).

    model: the resolved model (resolved from settings.model when None); cost: the fitted cost
    model the scheduler prices with (None: `training_pricing`'s stand-in); cluster: the one it
    prices on (None: the config's; `run_training` passes `plan_cluster`); trace_path: where
    `train_step` writes the traced steps once the window's last is done (None: nowhere).
    """

    def __init__(self, settings: TrainSettings, plan: Plan, pool: pd.DataFrame, samples: Sequence[RawSample], *,
                 model: ModelHandle | None = None, cost: CostModel | None = None, cluster: Cluster | None = None,
                 device: torch.device | None = None, trace_path: Path | None = None):
        check_trainable_schedule(plan)  # before any group or module is built
        self.settings, self.trace_path = settings, trace_path
        self.device = device if device is not None else torch.device("cpu")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.model = model = model if model is not None else ModelHandle.resolve(settings.model)
        if settings.baseline:  # data-blind: the same grid with a uniform layer split
            plan = plan.with_uniform_layers(model.n_vision_layers, model.n_llm_layers)
        self.plan = plan
        self.topo = Topology(plan, self.rank, self.world, tied_embeddings=model.tied_embeddings)
        self.topo.create_groups()
        self.modules = build_rank_modules(self.topo, model, settings.seed, self.device)
        self.rules = model.sample_rules()
        self._setup_parameters()
        train, sched = settings.train, settings.scheduler
        precision = Precision.of(model.spec.dtype)
        select_packed_kernel(model.spec.packed_attention, device_type=self.device.type,  # the kernel the profile timed
                             compute_dtype=precision.compute_dtype)
        self.spans = SpanRecorder(trace_window(train.trace_steps, train.steps), self.device)
        self.p2p = P2P(self.device, precision.compute_dtype)
        self.p2p.spans = self.spans
        self.executor = PipelineExecutor(self.topo, self.modules, model, self.p2p,
                                         image_token_id=self.rules.image_token_id,
                                         video_token_id=self.rules.video_token_id, schedule=train.schedule,
                                         pad_to_longest=sched.pad_to_longest, precision=precision,
                                         device=self.device, spans=self.spans)
        self.pool = pool
        expected = [ExpectedShape(int(t), int(v), int(s)) for t, v, s in
                    zip(pool["n_tiles"], pool["vision_tokens"], pool["seq_len"])]
        self.data = TrainingData(samples, self.rules, expected)
        self.loader = StepLoader(self.data, workers=train.loader_workers, device=self.device)
        tokens, pixels = processors_needed(self.topo)  # built now, not in step 1's loads (`prepare`)
        self.loader.prepare(tokens=tokens, pixels=pixels)
        self.batches = GlobalBatches(len(pool), train.global_batch_size, settings.seed,
                                     mix=dataset_mix(pool["dataset"].tolist(), settings.datasets))
        self.pricing = training_pricing(plan, model, cost,
                                        cluster if cluster is not None else Cluster.from_section(settings.cluster))
        self.planner = step_planner(settings, self.pricing, pool, self.batches, self.rules) if self.rank == 0 else None
        # Rank 0 decides about resuming and writes the checkpoint's record (hashing manifests).
        self.fingerprint = run_fingerprint(settings, plan, pool) if self.rank == 0 else None
        self.skipped = SkippedSamples.for_pool(len(pool), settings.data.max_skip_frac)

    def _setup_parameters(self) -> None:
        """Global names, replication info, optimizer and LR schedule."""
        self.rank_params = rank_parameters(self.modules.full, self.modules.parts)
        self.param_infos = infos = param_infos(self.modules, self.topo, self.rank_params)
        t = self.settings.train
        self.sync = GradientSync(self.topo, infos, overlap=t.overlap_grad_sync)
        self.sharding = StepSharding(self.modules.sharded)
        self.optimizer = self.lr_scheduler = None  # a rank whose modules are all frozen has none
        if infos:
            self.optimizer = build_optimizer([(i.name, p) for p, i in infos.items()], lr=t.lr,
                                             weight_decay=t.weight_decay)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, total_steps=t.steps, warmup_steps=t.warmup_steps,
                                                   min_lr_ratio=t.min_lr_ratio)

    # -- one step ----------------------------------------------------------------------------------

    def next_plan(self, step: int) -> StepPlan:
        """Step `step`'s plan on every rank (collective)."""
        return rank0_result(lambda: self.planner.get(step))

    def load(self, plan: StepPlan):
        """Start loading what this rank needs of `plan` (returns a future of {pool index: sample})."""
        return self.loader.start(requests_for(plan, self.topo))

    @property
    def communicates_in_compute(self) -> bool:
        """Whether this rank's forwards run collectives (tensor parallelism, FSDP2's all-gathers)."""
        tp = [self.plan.vision.tp if self.topo.vision_role is not None else 1,
              self.plan.llm.tp if self.topo.llm_role is not None else 1]
        return max(tp) > 1 or bool(self.modules.sharded)

    def gradients(self, batch: Batch) -> tuple[dict, Batch]:
        """`compute_gradients` of `batch`, whose loads the ranks may not have agreed on yet: a rank
        whose own loads succeeded computes at once and waits for the agreement only before it first
        communicates (`FailureCheck`), as the pricing charges each rank's loads to its own forwards.
        If a sample failed anywhere, that work is redone with the failed samples replaced
        (`StepSource.replace_failed`). Returns (statistics, the batch computed)."""
        check = batch.check
        if check is not None and not check.failed_here:
            recorded = len(self.spans.spans)
            try:
                return self.compute_gradients(batch.plan, batch.loaded, batch.decode_s, agreement=check), batch
            except StepAborted:
                self.executor.discard()
                self.spans.void_since(recorded, "voided (a sample failed to load)")
        if check is not None:
            batch = batch.source.replace_failed(batch)
        return self.compute_gradients(batch.plan, batch.loaded, batch.decode_s), batch

    def begin_step(self, step: int) -> None:
        """Step `step` (0-based) begins: its trace, its wall clock and the CUDA peak start here."""
        self.spans.begin_step(step + 1)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._step_start = time.perf_counter()

    def train_step(self, batch: Batch) -> StepStats:
        """The step `begin_step` began, from its batch (`StepSource.next`) to its update (collective):
        gradients, optimizer step, the step's end (its clock; the trace file after the traced window's
        last step), every rank's stage times gathered and, on rank 0, fed to the adaptive correction."""
        step = batch.plan.step
        grads, batch = self.gradients(batch)
        lr = self.current_lr(step)
        norm = self.optimizer_step()
        batch.source.after_update(step)
        if self.device.type == "cuda":  # the optimizer's kernels are still queued: count them in this step
            torch.cuda.synchronize(self.device)
        step_s = time.perf_counter() - self._step_start
        self.spans.end_step()
        if self.trace_path is not None and self.spans.window and step + 1 == self.spans.window[-1]:
            names, args = rank_labels(self.topo)
            write_trace(self.spans, self.trace_path, rank=self.rank, world=self.world, process_names=names,
                        process_args=args)
        times = self.gather_times(grads["result"])
        peak = float(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else np.nan
        if self.planner is not None:
            self.planner.report(step, measured_times(self.topo, times, batch.plan), step_s=step_s)
        return StepStats(batch.plan, grads, times, step_s, batch.data_wait_s, norm, lr, batch.skipped, peak)

    def compute_gradients(self, plan: StepPlan, loaded: Mapping[int, Any],
                          decode_s: np.ndarray | None = None, agreement: FailureCheck | None = None) -> dict:
        """Forward + backward of one global batch; leaves in .grad the gradient of the mean
        answer-token loss of the whole batch, summed over replicas. Returns step statistics.
        decode_s: [m] load seconds counted into each position's forward (`Batch.decode_s`);
        agreement: the step's load agreement, confirmed before this rank first communicates
        (raises `StepAborted` there when a sample failed; see `gradients`)."""
        self.sync.zero_grads()
        inputs = {i: loaded[row] for i, row in enumerate(plan.rows) if row in loaded}
        arm = self.sync.arm
        if agreement is not None:
            confirm = functools.partial(agreement.confirm_traced, self.spans)
            if self.communicates_in_compute:
                confirm()
            else:  # the first message, or else the gradient sync armed before the last backward
                self.p2p.before_first_message, arm = confirm, lambda: (confirm(), self.sync.arm())
        t0 = time.perf_counter()
        try:
            self.sharding.begin()
            result = self.executor.run(plan, inputs, before_last_backward=arm)
            if agreement is not None:
                agreement.confirm()  # settled already before the last backward; kept so no path skips it
        finally:
            self.p2p.before_first_message = None
        pipeline_s = time.perf_counter() - t0
        if decode_s is not None:  # the stage's busy time includes the decoding the pricing charges it
            result.fwd_s = result.fwd_s + decode_s
        with self.spans.span("allreduce", "gradient sync"):
            self.sharding.reduce()  # data-parallel sum of the sharded stages' gradients (FSDP2)
            pending = self.sync.start_all_reduce()  # the rest; runs while the world total below waits for the last stage
            counts_here = (self.topo.llm_role is not None and self.topo.llm_role.is_last
                           and self.topo.llm_role.tp_rank == 0)
            totals = torch.tensor([result.loss_sum if counts_here else 0.0, result.n_answer if counts_here else 0],
                                  dtype=torch.float64, device=self.device)
            dist.all_reduce(totals)
            pending.wait()
        loss_sum, n_answer = float(totals[0]), int(totals[1])
        if n_answer == 0:
            raise UserError(f"step {plan.step}: the global batch has no answer tokens to train on")
        self.sync.scale(1.0 / n_answer)
        return {"loss": loss_sum / n_answer, "n_answer": n_answer, "result": result, "pipeline_s": pipeline_s}

    def optimizer_step(self) -> float:
        """Clip by the global norm, AdamW step, LR schedule step; returns the norm before clipping."""
        with self.spans.span("optimizer"):
            norm = self.sync.global_norm(self.device)
            self.sync.clip(self.settings.train.grad_clip, norm)
            if self.optimizer is not None:
                self.optimizer.step()
                self.lr_scheduler.step()
        return norm

    def current_lr(self, step: int) -> float:
        """The learning rate the next optimizer step (`step`, 0-based) applies: the optimizer's own
        (its schedule's closed form on a rank whose modules are all frozen)."""
        return self.lr_at(step) if self.optimizer is None else float(self.optimizer.param_groups[0]["lr"])

    def follow_schedule(self) -> None:
        """After a resume: the optimizer's LR from this run's schedule at the checkpoint's step.

        A checkpoint restores the LR its own schedule set; when train.steps has grown since, the
        schedule (rebuilt from the current config) gives another one (`dflop.runtime.run_identity`).
        """
        if self.lr_scheduler is not None:
            follow_schedule(self.lr_scheduler)

    def lr_at(self, step: int, total_steps: int | None = None) -> float:
        """Learning rate used by optimizer step `step` (0-based) of a `total_steps` schedule
        (default: train.steps)."""
        t = self.settings.train
        total = t.steps if total_steps is None else total_steps
        return t.lr * warmup_cosine(step, total_steps=total, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio)

    def gather_times(self, result) -> np.ndarray | None:
        """[world, 2, m] (forward, backward) busy seconds of every rank per position, on rank 0."""
        mine = torch.tensor(np.stack([result.fwd_s, result.bwd_s]), dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        return torch.stack([g.cpu() for g in gathered]).numpy() if self.rank == 0 else None

    def close(self) -> None:
        self.loader.close()
        if self.planner is not None:
            self.planner.close()

    # -- checkpoint state: rank 0's copy is saved (train_state.json "extra"), every rank loads it ------

    def train_state(self) -> TrainState:
        """What this rank checkpoints: parameters, optimizer, LR schedule and this Stateful trainer."""
        return TrainState(params=self.rank_params, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                          data_seed=self.settings.seed, extra=self,
                          run=None if self.fingerprint is None else self.fingerprint.to_json())

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's adaptive correction (rank 0, dflop policy) and the samples skipped so far."""
        correction = self.planner.correction if self.planner is not None else None
        state = {"correction": correction.state_dict()} if correction is not None else {}
        state["skipped"] = self.skipped.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """After a resume: continue the correction and the count of skipped samples where the
        checkpoint left them."""
        self.skipped.load_state_dict(state.get("skipped", {}))
        correction = self.planner.correction if self.planner is not None else None
        if correction is not None and "correction" in state and not correction.load_state_dict(state["correction"]):
            log.warning("checkpoint's adaptive correction does not fit this scheduler (other shape buckets, or saved "
                        "before its noise terms); starting it afresh")
