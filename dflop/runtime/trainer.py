"""One rank of a training run: its modules, optimizer and data path, one global batch at a time.

`Trainer` does one step at a time (the loop and its checkpoints are `dflop.runtime.run`):

1. rank 0's `StepPlanner` (the online scheduler in its background thread) has partitioned the
   step's global batch, priced by the one pricing path (`dflop.pricing.pricing`); the plan is
   broadcast, and every rank's loader started on it one step ago (`next_plan`, `load`; samples
   that fail to load are replaced on every rank alike: `without_failures`). On CPU each rank
   loads the step's samples at its start instead and computes while the ranks agree that every
   load succeeded (`checked_load`, `gradients`);
2. `PipelineExecutor.run`: 1F1B over vision then LLM stages; the loss is the SUM of answer-token
   losses per bin;
3. one world all-reduce of (loss sum, answer tokens); gradients: tied-embedding sum, data-parallel
   sum (a ``shard_optimizer`` module's by FSDP2's reduce-scatter, `dflop.runtime.sharding`),
   divided by the global answer-token count (the exact mean over the global batch);
4. global-norm clipping, AdamW, LR schedule (warm-up + cosine) (`optimizer_step`).

`spans` records the steps of ``train.trace_steps`` (`dflop.runtime.spans`, results/train/trace.json):
the executor's forwards / backwards, the P2P messages, the gradient sync (``allreduce``: from the
pipeline's end until every gradient is reduced) and the optimizer step (norm, clipping, AdamW).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from dflop.costmodel.analytic import analytic_cost_model
from dflop.costmodel.model import CostModel, loads_share_compute_cores
from dflop.data.readers import RawSample
from dflop.data.sampling import dataset_mix
from dflop.data.training import ExpectedShape, TrainingData
from dflop.errors import UserError
from dflop.models.handle import ModelHandle
from dflop.models.packing import select_packed_kernel
from dflop.models.precision import Precision
from dflop.models.tensor_parallel import is_tp_shard
from dflop.plan import Plan, PlanFile
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool
from dflop.pricing.pricing import Pricing
from dflop.runtime.agreement import rank0_result
from dflop.runtime.loading import StepLoader, decode_seconds, feature_rows_fn, requests_for
from dflop.runtime.model import EMBEDDING_NAME, build_rank_modules, parameter_names
from dflop.models.optimizer import build_optimizer
from dflop.runtime.optim import GradientSync, ParamInfo, build_lr_scheduler, warmup_cosine
from dflop.runtime.p2p import P2P
from dflop.runtime.run_identity import run_fingerprint
from dflop.runtime.schedule import PipelineExecutor
from dflop.runtime.spans import SpanRecorder, trace_window
from dflop.runtime.settings import TrainSettings
from dflop.runtime.sharding import StepSharding, is_sharded_parameter
from dflop.runtime.skipping import FailureCheck, SkippedSamples, StepAborted, checked_load, load_without_failures
from dflop.runtime.topology import LLM, VISION, Topology
from dflop.scheduler.online import GlobalBatches, StepPlan, StepPlanner
from dflop.scheduler.padded import price

log = logging.getLogger("dflop.train")


def training_pricing(plan: Plan, model: ModelHandle, cost: CostModel | None, cluster: Cluster) -> Pricing:
    """How the trainer prices its batches: the fitted cost model (None: the FLOP-count stand-in of
    `dflop.costmodel.analytic`, for runs without a profile) on `cluster` (the one plan.yaml was
    planned for, so the trainer's predictions are the planner's: `plan_cluster`)."""
    if cost is None:
        cost = analytic_cost_model(model.config, tp_degrees=sorted({plan.layout.tp_v, plan.layout.tp_l}),
                                   dtype=model.spec.dtype, preset=model.spec.preset)
    return Pricing.of(plan, cost, model, cluster)


def plan_cluster(plan_file: PlanFile, settings: TrainSettings) -> Cluster:
    """The cluster plan.yaml records (what optimize priced with), else the config's (a hand-written
    plan). The workflow's train rule passes only the device keys of the cluster section, so the
    config's bandwidths are not the ones the plan was made for."""
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
    sched = settings.scheduler
    policy = "padded" if sched.pad_to_longest and sched.policy == "baseline" else sched.policy
    whole = Pool.from_shapes(pool, where="the trainer's shapes")  # checked once, each batch a take of it
    if len(whole) != len(pool):
        raise UserError("the trainer's shapes hold rows whose status is not ok: pass `read_shapes`' table")
    return StepPlanner(pool, batches, pricing.plan, lambda rows: price(pricing, whole.take(rows), policy).costs,
                       feature_rows_fn(rules), policy=sched.policy, budget_s=sched.budget_ms / 1e3,
                       prefetch=sched.prefetch, seed=settings.seed, total_steps=settings.train.steps,
                       adaptive=settings.adaptive_correction, p2p_s=pricing.p2p_s, allreduce_s=pricing.allreduce_s,
                       ilp=sched.ilp)


class Trainer:
    """One rank's model, optimizer, data path and step (module docstring).

    model: the resolved model (resolved from settings.model when None); cost: the fitted cost
    model the scheduler prices with (None: `training_pricing`'s stand-in); cluster: the one it
    prices on (None: the config's; `run_training` passes `plan_cluster`).
    """

    def __init__(self, settings: TrainSettings, plan: Plan, pool: pd.DataFrame, samples: Sequence[RawSample], *,
                 model: ModelHandle | None = None, cost: CostModel | None = None, cluster: Cluster | None = None,
                 device: torch.device | None = None):
        self.settings = settings
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
        self.batches = GlobalBatches(len(pool), train.global_batch_size, settings.seed,
                                     mix=dataset_mix(pool["dataset"].tolist(), settings.datasets))
        self.pricing = training_pricing(plan, model, cost,
                                        cluster if cluster is not None else Cluster.from_section(settings.cluster))
        self.planner = step_planner(settings, self.pricing, pool, self.batches, self.rules) if self.rank == 0 else None
        # Rank 0 decides about resuming and writes the checkpoint's record (hashing manifests).
        self.fingerprint = run_fingerprint(settings, plan, pool) if self.rank == 0 else None
        self.skipped = SkippedSamples.for_pool(len(pool), settings.data.max_skip_frac)

    def _setup_parameters(self) -> None:
        """Global names, replication info, optimizer, LR schedule, checkpoint state."""
        from dflop.runtime.param_names import rank_parameters

        self.rank_params = rank_parameters(self.modules.full, self.modules.parts)
        names = parameter_names(self.modules)
        canonical = {id(t): n for n, t in self.rank_params.tensors.items()}
        llm_role = self.topo.llm_role
        head_copy = (self.topo.tied_embeddings and llm_role is not None and llm_role.is_last and not llm_role.is_first)
        infos: dict[torch.nn.Parameter, ParamInfo] = {}
        for param in self.modules.trainable_parameters():
            name = canonical.get(id(param), names[id(param)])
            module = LLM if name.startswith(("model.language_model.", "lm_head.")) else VISION
            infos[param] = ParamInfo(name, module, is_tp_shard(param),
                                     tied_copy=head_copy and name == EMBEDDING_NAME,
                                     zero=is_sharded_parameter(param, self.modules.sharded))
        self.param_infos = infos
        t = self.settings.train
        self.sync = GradientSync(self.topo, infos, overlap=t.overlap_grad_sync)
        self.sharding = StepSharding(self.modules.sharded)
        self.optimizer = self.lr_scheduler = None  # a rank whose modules are all frozen has none
        if infos:
            self.optimizer = build_optimizer([(i.name, p) for p, i in infos.items()], lr=t.lr,
                                             weight_decay=t.weight_decay)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, total_steps=t.steps, warmup_steps=t.warmup_steps,
                                                   min_lr_ratio=t.min_lr_ratio)

    # -- the data of a step ------------------------------------------------------------------------

    def next_plan(self, step: int) -> StepPlan:
        """Step `step`'s plan on every rank (collective)."""
        return rank0_result(lambda: self.planner.get(step))

    @property
    def loads_in_step(self) -> bool:
        """Whether each step loads its own samples at its start instead of during the previous
        step: on CPU, where that load would run on the cores the ranks compute on (the pricing then
        charges it, `dflop.pricing.pricing.Pricing.load_s`); on GPUs it is prefetched, hidden."""
        return loads_share_compute_cores(self.device.type)

    def in_step_loads(self, plan: StepPlan, loaded: Mapping[int, Any]) -> np.ndarray | None:
        """[m] seconds this rank spent loading, per position, the samples the pricing charges to
        its forwards (`decode_seconds`), where steps load in the step (`loads_in_step`), else None.
        Traced as "data" spans ending now (call it right after the load, inside the data wait)."""
        if not self.loads_in_step:
            return None
        seconds = decode_seconds(plan, self.topo, loaded)
        self.spans.add_back_to_back("data", "sample loads (counted in its forward)", seconds)
        return seconds

    def load(self, plan: StepPlan):
        """Start loading what this rank needs of `plan` (returns a future of {pool index: sample})."""
        return self.loader.start(requests_for(plan, self.topo))

    def without_failures(self, plan: StepPlan, pending=None,
                         started: tuple[dict, FailureCheck] | None = None) -> tuple[StepPlan, dict, int]:
        """`plan` and its loaded samples (`pending`: the load started for it, or `started`: that
        load done and its agreement under way, `checked_load`) with the samples that failed to
        load on any rank replaced, and how many were skipped (collective; `dflop.runtime.skipping`)."""
        pool = self.pool

        def describe(row: int) -> str:
            return f"{pool['dataset'].iat[row]}/{pool['sample_id'].iat[row]}"

        return load_without_failures(
            plan, pending.result if pending is not None else None, skipped=self.skipped, describe=describe,
            replan=lambda p, rows: self.planner.replan(p, rows), reload=lambda p: self.load(p).result(),
            device=self.device, n_pool=len(pool), seed=self.settings.seed, started=started)

    def checked_load(self, plan: StepPlan) -> tuple[dict, FailureCheck]:
        """Load this rank's samples of `plan` now and start the ranks' agreement on them, without
        waiting for it (the step's own loads, `loads_in_step`; `gradients` waits)."""
        return checked_load(plan, lambda: self.load(plan).result(), self.device)

    @property
    def communicates_in_compute(self) -> bool:
        """Whether this rank's forwards run collectives (tensor parallelism, FSDP2's all-gathers)."""
        tp = [self.plan.vision.tp if self.topo.vision_role is not None else 1,
              self.plan.llm.tp if self.topo.llm_role is not None else 1]
        return max(tp) > 1 or bool(self.modules.sharded)

    def gradients(self, plan: StepPlan, loaded: Mapping[int, Any], decode_s: np.ndarray | None,
                  check: FailureCheck | None = None) -> tuple[dict, StepPlan, int]:
        """`compute_gradients` of a step whose loads the ranks may not have agreed on yet (`check`).

        A rank whose own loads succeeded computes at once and waits for the agreement only before
        its first message or collective (`FailureCheck`): where a step loads its own samples, no
        rank waits for the slowest loader before computing, as the pricing charges each rank's
        loads to its own forwards. If a sample failed anywhere, the work is dropped and the step
        runs again with the failed samples replaced. Returns (statistics, the step's plan,
        samples skipped)."""
        if check is None:
            return self.compute_gradients(plan, loaded, decode_s), plan, 0
        if not check.failed_here:
            recorded = len(self.spans.spans)
            try:
                return self.compute_gradients(plan, loaded, decode_s, agreement=check), plan, 0
            except StepAborted:
                self.executor.discard()
                self.spans.void_since(recorded, "voided (a sample failed to load)")
        with self.spans.span("data", "replacing failed samples"):
            plan, loaded, n_skipped = self.without_failures(plan, started=(loaded, check))
            decode_s = self.in_step_loads(plan, loaded)
        return self.compute_gradients(plan, loaded, decode_s), plan, n_skipped

    # -- one step ----------------------------------------------------------------------------------

    def compute_gradients(self, plan: StepPlan, loaded: Mapping[int, Any],
                          decode_s: np.ndarray | None = None, agreement: FailureCheck | None = None) -> dict:
        """Forward + backward of one global batch; leaves in .grad the gradient of the mean
        answer-token loss of the whole batch, summed over replicas. Returns step statistics.
        decode_s: [m] load seconds counted into each position's forward (`in_step_loads`);
        agreement: the step's load agreement, confirmed before this rank first communicates
        (raises `StepAborted` there when a sample failed; see `gradients`)."""
        for param, info in self.param_infos.items():  # zeros, not None: every replica all-reduces the same list
            if info.zero:  # FSDP2 sets the reduced shard; none held meanwhile (dflop.costmodel.memory)
                param.grad = None
            elif param.grad is None:
                param.grad = torch.zeros_like(param)
            else:
                param.grad.zero_()
        inputs = {i: loaded[row] for i, row in enumerate(plan.rows) if row in loaded}
        arm = self.sync.arm
        if agreement is not None:
            def confirm() -> None:
                if not agreement.settled:
                    with self.spans.span("data", "load agreement"):
                        agreement.confirm()

            def confirm_then_arm() -> None:
                confirm()
                self.sync.arm()

            if self.communicates_in_compute:
                confirm()
            else:  # the first message, or else the gradient sync armed before the last backward
                self.p2p.before_first_message, arm = confirm, confirm_then_arm
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
        if self.optimizer is None:
            return self.lr_at(step)
        return float(self.optimizer.param_groups[0]["lr"])

    def follow_schedule(self) -> None:
        """After a resume: the optimizer's LR from this run's schedule at the checkpoint's step.

        A checkpoint restores the LR its own schedule set; when train.steps has grown since, the
        schedule (rebuilt from the current config) gives another one (`dflop.runtime.run_identity`).
        """
        if self.lr_scheduler is None:
            return
        sched = self.lr_scheduler
        for group, base, factor in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * factor(sched.last_epoch)

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

    # -- checkpoint state --------------------------------------------------------------------------

    def train_state(self):
        from dflop.runtime.checkpoint import TrainState

        correction = self.planner.correction if self.planner is not None else None
        extra = {"correction": correction.state_dict()} if correction is not None else {}
        extra["skipped"] = self.skipped.state_dict()
        return TrainState(params=self.rank_params, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                          data_seed=self.settings.seed, extra=extra,
                          run=None if self.fingerprint is None else self.fingerprint.to_json())

    def restore_extra(self, extra: dict) -> None:
        """After a resume: continue the scheduler's adaptive correction and the count of skipped
        samples where the checkpoint left them."""
        self.skipped.load_state_dict(extra.get("skipped", {}))
        correction = self.planner.correction if self.planner is not None else None
        if correction is not None and "correction" in extra and not correction.load_state_dict(extra["correction"]):
            log.warning("checkpoint's adaptive correction does not fit this scheduler (other shape buckets, or saved "
                        "before its noise terms); starting it afresh")
