"""The training loop that runs inside every torchrun worker (rule train).

`train(cfg, plan_path=..., shapes_path=..., costmodel_path=..., out_dir=...)` is the entry point;
`Trainer` holds one rank's state and does one step at a time:

1. rank 0's `StepPlanner` (the online scheduler in its background thread) has partitioned the
   step's global batch; the plan is broadcast, and every rank's loader started on it one step ago;
2. `PipelineExecutor.run`: 1F1B over vision then LLM stages; the loss is the SUM of answer-token
   losses per bin;
3. one world all-reduce of (loss sum, answer tokens); gradients: tied-embedding sum, data-parallel
   sum, divided by the global answer-token count (the exact mean over the global batch);
4. global-norm clipping, AdamW, LR schedule (warm-up + cosine);
5. rank 0: metrics row (metrics.parquet), progress bar and a one-line log; measured stage times to
   the scheduler's adaptive correction; every ``checkpoint_every`` steps and at the end a checkpoint
   (`dflop.runtime.checkpoint`), from which a re-run resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from dflop.config import DatasetSpec
from dflop.costmodel.types import BatchCosts
from dflop.cpu_memory import reuse_large_cpu_allocations
from dflop.data.readers import RawSample, read_dataset
from dflop.data.training import ExpectedShape, SampleRules, TrainingData
from dflop.errors import UserError
from dflop.models.tensor_parallel import is_tp_shard
from dflop.plan import Plan, read_plan
from dflop.shapes import read_shapes
from dflop.runtime.agreement import rank0_result
from dflop.runtime.batches import GlobalBatches, StepPlan, StepPlanner, broadcast_step_plan
from dflop.runtime.loading import StepLoader, requests_for
from dflop.runtime.metrics import MetricsWriter, step_flops
from dflop.runtime.model import EMBEDDING_NAME, ModelSpec, build_rank_modules, parameter_names
from dflop.runtime.optim import (
    GradientSync,
    ParamInfo,
    build_lr_scheduler,
    build_optimizer,
    warmup_cosine,
)
from dflop.runtime.p2p import P2P
from dflop.runtime.run_identity import prepare_checkpoints, run_fingerprint
from dflop.runtime.skipping import SkippedSamples, load_without_failures
from dflop.runtime.schedule import PipelineExecutor
from dflop.runtime.topology import LLM, VISION, Topology
from dflop.runtime.vision import feature_rows

log = logging.getLogger("dflop.train")

TEST_PRESET_SUFFIXES = ("-tiny", "-small")


@dataclass(frozen=True)
class TrainSettings:
    """Everything the trainer reads from the config, as plain values (see `from_config`)."""

    arch: str = "llava_ov"
    vision: str = "siglip-tiny"
    llm: str = "qwen2.5-tiny"
    weights: str | None = None
    tokenizer: str = "qwen2.5"
    dtype: str = "float32"
    freeze_vision: bool = False
    freeze_projector: bool = False
    freeze_llm: bool = False
    arch_params: Mapping[str, Any] = field(default_factory=dict)
    datasets: tuple[DatasetSpec, ...] = ()
    seed: int = 0
    global_batch_size: int = 16
    steps: int = 6
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 2
    schedule: str = "1f1b"
    loader_workers: int = 0
    overlap_grad_sync: bool = True
    policy: str = "dflop"
    budget_ms: float = 200.0
    prefetch: int = 2
    device: str = "cpu"
    gpu_memory_gb: float = math.inf
    pad_to_longest: bool = False
    adaptive_correction: bool = True
    max_skip_frac: float = 0.01

    @classmethod
    def from_config(cls, cfg, **overrides) -> "TrainSettings":
        """From a `dflop.config.Config` (its defaulted ``raw`` sections)."""
        raw = cfg.raw
        model, train, sched, cluster = raw["model"], raw["train"], raw["scheduler"], raw["cluster"]
        values = dict(
            arch=model["arch"], vision=model["vision"], llm=model["llm"], weights=model["weights"],
            tokenizer=model["tokenizer"], dtype=model["dtype"], freeze_vision=model["freeze"]["vision"],
            freeze_projector=model["freeze"]["projector"], freeze_llm=model["freeze"]["llm"],
            arch_params=dict(model[model["arch"]]), datasets=tuple(cfg.datasets), seed=raw["run"]["seed"],
            global_batch_size=train["global_batch_size"], steps=train["steps"], lr=train["lr"],
            min_lr_ratio=train["min_lr_ratio"], warmup_steps=train["warmup_steps"],
            weight_decay=train["weight_decay"], grad_clip=train["grad_clip"],
            checkpoint_every=train["checkpoint_every"], schedule=train["schedule"],
            loader_workers=train["loader_workers"], overlap_grad_sync=train["overlap_grad_sync"],
            policy=sched["policy"], budget_ms=sched["budget_ms"], prefetch=sched["prefetch"], pad_to_longest=sched["pad_to_longest"], device=cluster["device"],
            gpu_memory_gb=cluster["gpu_memory_gb"], max_skip_frac=raw["data"]["max_skip_frac"])
        values.update(overrides)
        return cls(**values)

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec(self.arch, self.vision, self.llm, self.weights, self.seed, self.freeze_vision,
                         self.freeze_projector, self.freeze_llm)


# -- process group -----------------------------------------------------------------------------


def init_distributed(device: str) -> torch.device:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU); a plain process is a world of 1."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("cluster.device is cuda but this machine has no CUDA device")
        torch_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(torch_device)
    else:
        torch_device = torch.device("cpu")
        reuse_large_cpu_allocations()  # no page faults on every step's large tensors (dflop.cpu_memory)
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a single process: a world of one over a local store
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=10),
                                device_id=torch_device if device == "cuda" else None)
    return torch_device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- data --------------------------------------------------------------------------------------


def pool_samples(pool: pd.DataFrame, datasets: Sequence[DatasetSpec], seed: int) -> list[RawSample]:
    """The RawSample of every pool row, read from the datasets (each rank reads the manifests).

    Images embedded in Parquet datasets are kept as their (file, row) source, not their bytes:
    the loader reads the bytes of the images a step needs (`embedded_image_bytes`), so no rank
    holds a dataset's images in memory.
    """
    wanted = set(zip(pool["dataset"], pool["sample_id"]))
    found: dict[tuple[str, str], RawSample] = {}
    for ds in datasets:
        for sample in read_dataset(ds.path, dataset=ds.name, fmt=ds.format, media_root=ds.media_root,
                                   sample=ds.sample, seed=seed):
            key = (sample.dataset, sample.sample_id)
            if key in wanted:
                found[key] = dataclasses.replace(sample, images=tuple(r.without_bytes() for r in sample.images))
    out = []
    for dataset, sample_id in zip(pool["dataset"], pool["sample_id"]):
        sample = found.get((dataset, sample_id))
        if sample is None:
            raise UserError(f"shapes.parquet sample {dataset}/{sample_id} is not in the configured datasets "
                            "(data changed since profile_data? re-run it)")
        out.append(sample)
    return out


def sample_rules(settings: TrainSettings, config) -> SampleRules:
    """Token and pixel rules of the model (`config`: its transformers config)."""
    from dflop.profiling.data_profiler import tower_arch_params

    text = config.get_text_config()
    remap = settings.weights is None and settings.llm.endswith(TEST_PRESET_SUFFIXES)
    video_id = getattr(config, "video_token_index", None) or getattr(config, "video_token_id", None)
    image_id = getattr(config, "image_token_index", None) or config.image_token_id
    return SampleRules(settings.arch, tower_arch_params(settings.arch, settings.vision, settings.arch_params),
                       image_token_id=int(image_id), video_token_id=int(video_id if video_id is not None else image_id),
                       vocab_size=int(text.vocab_size), tokenizer=settings.tokenizer, remap_text_ids=remap)


def feature_rows_fn(rules: SampleRules) -> Callable[[pd.DataFrame], np.ndarray]:
    per_tile = int(rules.arch_params.get("tokens_per_tile", 0))

    def rows(shapes: pd.DataFrame) -> np.ndarray:
        return np.array([feature_rows(rules.arch, t, v, per_tile)
                         for t, v in zip(shapes["n_tiles"], shapes["vision_tokens"])], dtype=np.int64)

    return rows


def make_costs_fn(plan: Plan, costmodel_path: str | Path | None, memory_gb: float) -> Callable[[pd.DataFrame], BatchCosts]:
    """shapes rows of a batch -> BatchCosts for the plan's layout: the fitted cost model, or (no
    costmodel.json) the documented analytic stand-in with the plan's layer shares."""
    vision_layers, llm_layers = plan.vision.layers_per_stage, plan.llm.layers_per_stage
    if costmodel_path is not None:
        from dflop.costmodel.model import CostModel

        model = CostModel.load(costmodel_path)
        in_flight = plan.layout.in_flight()
        memory = memory_gb * 2**30 if math.isfinite(memory_gb) else math.inf

        def fitted(shapes: pd.DataFrame) -> BatchCosts:
            return model.batch_costs(shapes["n_tiles"].to_numpy(), shapes["seq_len"].to_numpy(),
                                     vision_layers_per_stage=vision_layers, llm_layers_per_stage=llm_layers,
                                     tp_v=plan.vision.tp, tp_l=plan.llm.tp, mem_limit_bytes=memory,
                                     in_flight_per_stage=in_flight, colocated=plan.colocated)

        return fitted
    from dflop.scheduler.costs import AnalyticCostModel, StageLayout, batch_costs_from_shapes

    def share(layers: Sequence[int]) -> tuple[float, ...]:
        total = sum(layers)
        return tuple((n + 1e-9) / (total + 1e-9 * len(layers)) for n in layers)

    layout = StageLayout(vision_layer_share=share(vision_layers), llm_layer_share=share(llm_layers))
    analytic = AnalyticCostModel()

    def approximate(shapes: pd.DataFrame) -> BatchCosts:
        costs = batch_costs_from_shapes(shapes, layout, analytic)
        if plan.colocated:  # the tower runs on LLM stage 0: its cost goes there
            from dataclasses import replace

            llm_fwd, llm_bwd = costs.llm_fwd.copy(), costs.llm_bwd.copy()
            llm_fwd[0] += costs.vision_fwd.sum(0)
            llm_bwd[0] += costs.vision_bwd.sum(0)
            empty = np.zeros((0, costs.n_samples))
            costs = replace(costs, llm_fwd=llm_fwd, llm_bwd=llm_bwd, vision_fwd=empty, vision_bwd=empty,
                            vision_act_bytes=empty, vision_fwd_const=np.zeros(0), vision_bwd_const=np.zeros(0),
                            vision_mem_limit_bytes=np.zeros(0))
        return costs

    return approximate


# -- one rank ----------------------------------------------------------------------------------


class Trainer:
    """One rank's model, optimizer, data path and step (module docstring)."""

    def __init__(self, settings: TrainSettings, plan: Plan, pool: pd.DataFrame, samples: Sequence[RawSample], *,
                 costs_fn: Callable[[pd.DataFrame], BatchCosts] | None = None, device: torch.device | None = None):
        self.settings = settings
        self.device = device if device is not None else torch.device("cpu")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        spec = settings.model_spec
        from dflop.models.builder import model_config

        config = model_config(settings.arch, settings.vision, settings.llm, weights_dir=settings.weights)
        if settings.policy == "baseline":  # data-blind: the same grid with a uniform layer split
            from dflop.models.architectures import architecture_of

            plan = plan.with_uniform_layers(architecture_of(config).n_feature_layers(config),
                                            config.get_text_config().num_hidden_layers)
        self.plan = plan
        self.topo = Topology(plan, self.rank, self.world, tied_embeddings=spec.tied_embeddings())
        self.topo.create_groups()
        self.modules = build_rank_modules(self.topo, spec, self.device)
        self.rules = sample_rules(settings, config)
        self._setup_parameters(spec)
        autocast = torch.bfloat16 if (self.device.type == "cuda" and settings.dtype == "bfloat16") else None
        self.p2p = P2P(self.device, autocast or torch.float32)
        self.executor = PipelineExecutor(self.topo, self.modules, spec, self.p2p,
                                         image_token_id=self.rules.image_token_id,
                                         video_token_id=self.rules.video_token_id, schedule=settings.schedule,
                                         pad_to_longest=settings.pad_to_longest, autocast_dtype=autocast,
                                         device=self.device)
        self.pool = pool
        expected = [ExpectedShape(int(t), int(v), int(s)) for t, v, s in
                    zip(pool["n_tiles"], pool["vision_tokens"], pool["seq_len"])]
        self.data = TrainingData(samples, self.rules, expected)
        self.loader = StepLoader(self.data, workers=settings.loader_workers, pin_memory=self.device.type == "cuda")
        self.batches = GlobalBatches(len(pool), settings.global_batch_size, settings.seed)
        self.planner = None
        if self.rank == 0:
            self.planner = StepPlanner(pool, self.batches, plan, costs_fn or make_costs_fn(plan, None, math.inf),
                                       feature_rows_fn(self.rules), policy=settings.policy,
                                       budget_s=settings.budget_ms / 1e3, prefetch=settings.prefetch,
                                       seed=settings.seed, total_steps=settings.steps,
                                       adaptive=settings.adaptive_correction)
        from dflop.models.info import model_info

        self.info = model_info(settings.arch, settings.vision, settings.llm, weights_dir=settings.weights)
        # Rank 0 decides about resuming and writes the checkpoint's record (hashing manifests).
        self.fingerprint = run_fingerprint(settings, plan, pool) if self.rank == 0 else None
        self.skipped = SkippedSamples.for_pool(len(pool), settings.max_skip_frac)

    def _setup_parameters(self, spec: ModelSpec) -> None:
        """Global names, replication info, optimizer, LR schedule, checkpoint state."""
        from dflop.runtime.checkpoint import rank_parameters

        parts = []
        if self.modules.vision is not None:
            parts.append((self.modules.vision, self.topo.vision_tp))
        if self.modules.llm is not None:
            parts.append((self.modules.llm, self.topo.llm_tp))
        self.rank_params = rank_parameters(self.modules.full, parts)
        names = parameter_names(self.modules)
        canonical = {id(t): n for n, t in self.rank_params.tensors.items()}
        llm_role = self.topo.llm_role
        head_copy = (self.topo.tied_embeddings and llm_role is not None and llm_role.is_last and not llm_role.is_first)
        infos: dict[torch.nn.Parameter, ParamInfo] = {}
        for param in self.modules.trainable_parameters():
            name = canonical.get(id(param), names[id(param)])
            module = LLM if name.startswith(("model.language_model.", "lm_head.")) else VISION
            sharded = name in self.rank_params.shards or is_tp_shard(param)
            infos[param] = ParamInfo(name, module, sharded,
                                     tied_copy=head_copy and name == EMBEDDING_NAME)
        self.param_infos = infos
        self.sync = GradientSync(self.topo, infos, overlap=self.settings.overlap_grad_sync)
        s = self.settings
        self.optimizer = self.lr_scheduler = None  # a rank whose modules are all frozen has none
        if infos:
            self.optimizer = build_optimizer([(i.name, p) for p, i in infos.items()], lr=s.lr,
                                             weight_decay=s.weight_decay)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, total_steps=s.steps, warmup_steps=s.warmup_steps,
                                                   min_lr_ratio=s.min_lr_ratio)

    # -- one step ------------------------------------------------------------------------------

    def next_plan(self, step: int) -> StepPlan:
        """Step `step`'s plan on every rank (collective)."""
        plan = self.planner.get(step) if self.rank == 0 else None
        return broadcast_step_plan(plan, self.device)

    def load(self, plan: StepPlan):
        """Start loading what this rank needs of `plan` (returns a future of {pool index: sample})."""
        return self.loader.start(requests_for(plan, self.topo))

    def without_failures(self, plan: StepPlan, pending) -> tuple[StepPlan, dict, int]:
        """`plan` and its loaded samples (`pending`: the load started for it) with the samples that
        failed to load on any rank replaced, and how many were skipped (collective;
        `dflop.runtime.skipping`)."""
        pool = self.pool

        def describe(row: int) -> str:
            return f"{pool['dataset'].iat[row]}/{pool['sample_id'].iat[row]}"

        return load_without_failures(
            plan, pending.result, skipped=self.skipped, describe=describe,
            replan=lambda p, rows: self.planner.replan(p, rows), reload=lambda p: self.load(p).result(),
            device=self.device, n_pool=len(pool), seed=self.settings.seed)

    def compute_gradients(self, plan: StepPlan, loaded: Mapping[int, Any]) -> dict:
        """Forward + backward of one global batch; leaves in .grad the gradient of the mean
        answer-token loss of the whole batch, summed over replicas. Returns step statistics."""
        for param in self.param_infos:  # zeros, not None: every replica all-reduces the same list
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            else:
                param.grad.zero_()
        inputs = {i: loaded[row] for i, row in enumerate(plan.rows) if row in loaded}
        t0 = time.perf_counter()
        result = self.executor.run(plan, inputs, before_last_backward=self.sync.arm)
        pipeline_s = time.perf_counter() - t0
        pending = self.sync.start_all_reduce()  # the rest; runs while the world total below waits for the last stage
        counts_here = self.topo.llm_role is not None and self.topo.llm_role.is_last and self.topo.llm_role.tp_rank == 0
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
        norm = self.sync.global_norm(self.device)
        self.sync.clip(self.settings.grad_clip, norm)
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
        s = self.settings
        total = s.steps if total_steps is None else total_steps
        return s.lr * warmup_cosine(step, total_steps=total, warmup_steps=s.warmup_steps, min_lr_ratio=s.min_lr_ratio)

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

    # -- checkpoint state ------------------------------------------------------------------------

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
            log.warning("checkpoint's adaptive correction does not fit this scheduler (other shape buckets); "
                        "starting it afresh")


# -- metrics from the gathered times -------------------------------------------------------------


def stage_labels(topo: Topology) -> list[str]:
    """Name of every pipeline stage, in chain order (vision0.., llm0..)."""
    vision = [] if topo.plan.colocated else [f"vision{k}" for k in range(topo.plan.vision.pp)]
    return vision + [f"llm{j}" for j in range(topo.plan.llm.pp)]


def rank_stage(topo: Topology, rank: int) -> int:
    """Chain position of `rank`."""
    other = Topology(topo.plan, rank, topo.world_size)
    return other.pipeline_stage


def measured_times(topo: Topology, times: np.ndarray, plan: StepPlan):
    """MeasuredTimes (by microbatch id) from the gathered [world, 2, m] busy seconds: per stage the
    slowest replica/TP rank (vision) or the slowest TP rank of each replica (LLM)."""
    from dflop.scheduler.correction import MeasuredTimes

    p_v = 0 if topo.plan.colocated else topo.plan.vision.pp
    m, dp = plan.n_microbatches, topo.plan.llm.dp
    ids = np.asarray(plan.microbatch_ids)
    vision_fwd, vision_bwd = np.zeros((p_v, m)), np.zeros((p_v, m))
    llm_fwd, llm_bwd = np.zeros((dp, topo.plan.llm.pp, m)), np.zeros((dp, topo.plan.llm.pp, m))
    for rank in range(topo.world_size):
        other = Topology(topo.plan, rank, topo.world_size)
        fwd, bwd = times[rank, 0], times[rank, 1]
        if other.llm_role is not None:
            r, j = other.llm_role.replica, other.llm_role.stage
            llm_fwd[r, j, ids] = np.maximum(llm_fwd[r, j, ids], fwd)
            llm_bwd[r, j, ids] = np.maximum(llm_bwd[r, j, ids], bwd)
        else:
            k = other.vision_role.stage
            vision_fwd[k, ids] = np.maximum(vision_fwd[k, ids], fwd)
            vision_bwd[k, ids] = np.maximum(vision_bwd[k, ids], bwd)
    return MeasuredTimes(vision_fwd, vision_bwd, llm_fwd, llm_bwd)


def stage_busy(topo: Topology, times: np.ndarray) -> dict[str, float]:
    """Mean busy seconds of each pipeline stage's ranks."""
    labels = stage_labels(topo)
    per_stage: dict[int, list[float]] = {}
    for rank in range(topo.world_size):
        per_stage.setdefault(rank_stage(topo, rank), []).append(float(times[rank].sum()))
    return {labels[s]: float(np.mean(v)) for s, v in sorted(per_stage.items())}


# -- the entry point -------------------------------------------------------------------------


def train(cfg, *, plan_path: str | Path, shapes_path: str | Path, costmodel_path: str | Path | None,
          out_dir: str | Path, steps: int | None = None, policy: str | None = None, pad_to_longest: bool | None = None,
          export: bool = True, progress: bool = True, stop_after: int | None = None, fresh: bool = False) -> Path:
    """Train inside a torchrun worker (every rank calls it); returns metrics.parquet's path.

    cfg: a `dflop.config.Config`. plan_path: plan.yaml; shapes_path: shapes.parquet; costmodel_path:
    costmodel.json (None: the analytic stand-in cost model). out_dir gets ``metrics.parquet`` and
    ``checkpoints/`` and, at the end, ``final/`` (a Hugging Face directory, unless export=False);
    a re-run resumes from the newest complete checkpoint there when it is of the same run
    (`dflop.runtime.run_identity`; otherwise, or with fresh=True, it is moved aside and the run
    starts afresh).
    steps / policy / pad_to_longest: override train.steps / scheduler.policy / the baseline's
    padding variant. stop_after: stop (as if killed) after this many steps of this run (tests).
    """
    overrides = {k: v for k, v in (("steps", steps), ("policy", policy), ("pad_to_longest", pad_to_longest))
                 if v is not None}
    settings = TrainSettings.from_config(cfg, **overrides)
    return run_training(settings, plan_path=plan_path, shapes_path=shapes_path, costmodel_path=costmodel_path,
                        out_dir=out_dir, export=export, progress=progress, stop_after=stop_after, fresh=fresh)


def run_training(settings: TrainSettings, *, plan_path: str | Path, shapes_path: str | Path,
                 costmodel_path: str | Path | None, out_dir: str | Path, export: bool = True,
                 progress: bool = True, stop_after: int | None = None, fresh: bool = False) -> Path:
    """`train` with explicit settings (see there)."""
    from dflop.runtime.checkpoint import load_latest, save_checkpoint

    device = init_distributed(settings.device)
    torch.manual_seed(settings.seed)
    out_dir = Path(out_dir)
    plan_file = read_plan(plan_path)
    plan_file.check_batch(settings.global_batch_size)
    plan = plan_file.plan
    pool = read_shapes(shapes_path)
    trainer = Trainer(settings, plan, pool, pool_samples(pool, settings.datasets, settings.seed),
                      costs_fn=make_costs_fn(plan_for_costs(settings, plan), costmodel_path, settings.gpu_memory_gb),
                      device=device)
    ckpt_dir = out_dir / "checkpoints"
    decision = rank0_result(lambda: prepare_checkpoints(ckpt_dir, trainer.fingerprint, fresh=fresh,
                                                        lr_at=trainer.lr_at))
    if trainer.rank == 0:
        log.info(decision.message)
    state = trainer.train_state()
    start = load_latest(ckpt_dir, state) or 0
    trainer.restore_extra(state.extra)
    trainer.follow_schedule()
    metrics = MetricsWriter(ckpt_dir / "metrics.parquet", resume_step=start) if trainer.rank == 0 else None
    bar = _progress_bar(settings.steps, start, progress and trainer.rank == 0)
    last = settings.steps if stop_after is None else min(settings.steps, start + stop_after)
    try:
        if start < last:
            plan_now = trainer.next_plan(start)
            pending = trainer.load(plan_now)
        for step in range(start, last):
            t0 = time.perf_counter()
            plan_now, loaded, n_skipped = trainer.without_failures(plan_now, pending)
            data_wait = time.perf_counter() - t0
            if step + 1 < last:
                plan_next = trainer.next_plan(step + 1)
                pending = trainer.load(plan_next)
            stats = trainer.compute_gradients(plan_now, loaded)
            lr = trainer.current_lr(step)
            norm = trainer.optimizer_step()
            step_s = time.perf_counter() - t0
            times = trainer.gather_times(stats["result"])
            if trainer.rank == 0:
                row = _metrics_row(trainer, plan_now, stats, times, step_s, data_wait, norm, lr)
                row["skipped_samples"] = n_skipped
                metrics.append(row)
                trainer.planner.report(step, measured_times(trainer.topo, times, plan_now))
                bar.update(1)
                log.info("step %d/%d loss %.4f step %.3fs idle %.1f%% sched %.1fms gap %.3f pred %.3fs lr %.2e",
                         step + 1, settings.steps, row["loss"], step_s, 100 * row["idle_frac"], row["sched_ms"],
                         row["sched_gap"], row["predicted_step_s"], row["lr"])
            done = step + 1
            if done % settings.checkpoint_every == 0 or done == settings.steps:
                save_checkpoint(ckpt_dir, done, trainer.train_state())
            if step + 1 < last:
                plan_now = plan_next
        if metrics is not None and last == settings.steps:
            metrics.publish(out_dir / "metrics.parquet")
        if export and last == settings.steps:
            from dflop.runtime.export import export_hf

            export_hf(out_dir / "final", trainer.rank_params)
    finally:
        bar.close()
        trainer.close()
    return out_dir / "metrics.parquet"


def plan_for_costs(settings: TrainSettings, plan: Plan) -> Plan:
    """The layout the cost model prices: the baseline runs a uniform layer split."""
    if settings.policy != "baseline":
        return plan
    from dflop.models.architectures import architecture_of
    from dflop.models.builder import model_config

    config = model_config(settings.arch, settings.vision, settings.llm, weights_dir=settings.weights)
    return plan.with_uniform_layers(architecture_of(config).n_feature_layers(config),
                                    config.get_text_config().num_hidden_layers)


def _metrics_row(trainer: Trainer, plan: StepPlan, stats: dict, times: np.ndarray, step_s: float,
                 data_wait: float, norm: float, lr: float) -> dict:
    spec = trainer.settings.model_spec
    flops = step_flops(trainer.info, plan.n_tiles, plan.seq_len, vision_trainable=spec.vision_side_trainable,
                       llm_trainable=not spec.freeze_llm)
    busy = stage_busy(trainer.topo, times)
    row = {
        "step": plan.step + 1, "run_id": trainer.fingerprint.run_id, "loss": stats["loss"], "step_s": step_s,
        "samples": len(plan.rows),
        "tokens": int(sum(plan.seq_len)), "tflops": flops / step_s / 1e12,
        "idle_frac": float(1 - times.sum() / (trainer.world * step_s)),
        "sched_ms": plan.sched_s * 1e3, "sched_gap": plan.predicted_step_s / plan.lower_bound_s
        if plan.lower_bound_s > 0 else float("nan"),
        "predicted_step_s": plan.predicted_step_s, "lr": lr,
        "grad_norm": norm, "answer_tokens": stats["n_answer"], "data_wait_s": data_wait, "member": plan.member,
    }
    for label, seconds in busy.items():
        row[f"busy_s_{label}"] = seconds
        row[f"idle_s_{label}"] = step_s - seconds
    return row


def _progress_bar(total: int, start: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, unit="step", desc="train", disable=not enabled, file=sys.stderr)
