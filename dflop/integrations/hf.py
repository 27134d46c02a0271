"""DFLOP's scheduler inside the Hugging Face `Trainer`: a batch sampler and the subclass that installs it.

Why: most people train LLaVA-OV / InternVL models on `transformers.Trainer` (DDP, FSDP, DeepSpeed)
and would rather add a sampler than replace their trainer. transformers' own data-aware sampler
(``train_sampling_strategy="batch_rebalance"``) balances a text-length formula; this one prices every
sample with DFLOP's cost model (tiles, frames and the vision tower included) and partitions with
DFLOP's scheduler under its memory guard.

What it does, per optimizer step (`DflopBatchSampler`):

1. the step's global batch is the one `dflop train` takes: `dflop.scheduler.online.GlobalBatches`
   over the pool (one shapes row per dataset index) with the config's ``run.seed``;
2. it is priced by the one pricing path (`dflop.pricing`, through `dflop.scheduler.padded.price`
   and `dflop.planner.expected.run_partition`, as the planner prices its sampled batches) on a pp = 1 plan:
   the whole model on every rank (``colocated``), dp = world size, m = gradient-accumulation steps;
3. DFLOP's scheduler (`dflop.scheduler.partition`, seed ``run.seed + step`` as the trainer's
   service uses) splits it into m microbatches x dp bins; every rank computes the same partition
   (a pure function of costs, settings, seed and step: no communication) and yields its own bins,
   one per microbatch, in the partition's order.

So every rank yields exactly m batches per step (DDP and FSDP need the same number of forwards on
every rank), with varying sample counts. The loss stays the exact mean over the global batch's
answer tokens through transformers' own ``num_items_in_batch`` path (the `Trainer` counts labels
over the step's m batches and all ranks, and each microbatch's loss is its sum over that count).

What it does not do: pipeline stages (HF's `Trainer` has none: pp = 1), nor change how samples are
batched into tensors: that is the collator's (`LlavaOnevisionCollator` pads; with ``pack=True`` it
packs a bin into one row, which is what DFLOP's costs price).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader, Sampler
from transformers import Trainer
from transformers.trainer_utils import seed_worker

from dflop.config import Config
from dflop.costmodel.jsonio import load_cost_model
from dflop.costmodel.model import CostModel
from dflop.data.sampling import DatasetMix, dataset_mix
from dflop.errors import UserError
from dflop.models.handle import ModelHandle
from dflop.plan import Layout, Plan
from dflop.planner.expected import run_partition
from dflop.pricing.cluster import Cluster
from dflop.pricing.pool import Pool
from dflop.pricing.pricing import Pricing
from dflop.runtime.trainer import training_pricing
from dflop.scheduler.greedy import MemoryGuardError
from dflop.scheduler.online import GlobalBatches
from dflop.scheduler.padded import price
from dflop.scheduler.partition import Partition
from dflop.scheduler.policy import Policy
from dflop.scheduler.settings import SchedulerSettings
from dflop.shapes import read_shapes, usable


def hf_plan(model: ModelHandle, world_size: int, grad_accum: int) -> Plan:
    """The plan HF's `Trainer` runs: the whole model on each of `world_size` data-parallel ranks
    (pp = 1, tp = 1, the vision tower on the LLM's ranks), `grad_accum` microbatches per step."""
    layout = Layout("colocated", tp_v=1, pp_v=1, dp_v=world_size, tp_l=1, pp_l=1, dp_l=world_size, m=grad_accum)
    return Plan(layout, (model.n_vision_layers,), (model.n_llm_layers,))


def align_shapes(shapes: pd.DataFrame, keys: Sequence[tuple[str, str]] | None, where: str = "shapes") -> pd.DataFrame:
    """One shapes row per dataset index: `keys[i]` = (dataset, sample_id) of the train dataset's item i.
    keys None: the usable rows in file order (the order `dflop train`'s pool and
    `dflop.data.training.pool_samples` use). A key with no usable row is a one-line error naming it."""
    table = usable(shapes, where)
    if keys is None:
        return table
    index = {(d, s): i for i, (d, s) in enumerate(zip(table["dataset"], table["sample_id"]))}
    rows = []
    for i, (dataset, sample_id) in enumerate(keys):
        row = index.get((str(dataset), str(sample_id)))
        if row is None:
            raise UserError(f"{where}: train dataset item {i} ({dataset}/{sample_id}) has no usable shapes row "
                            "(re-run `dflop profile-data` on the same data)")
        rows.append(row)
    return table.iloc[rows].reset_index(drop=True)


@dataclass(frozen=True)
class Sampling:
    """What every rank's sampler shares: the pool, how it is priced, the seed and the scheduler.

    pool: one usable shapes row per train-dataset index (`align_shapes`).
    model: the model priced (its layer counts and widths); cost: the fitted cost model (None: the
        analytic stand-in, `dflop.costmodel.analytic`, as `dflop train` without a profile);
    cluster: the device and its memory (the memory guard's limit) and links;
    seed: ``run.seed``: the global batches' order and the scheduler's seed (plus the step).
    mix: the datasets' sampling ratios (``data.datasets[].weight``), None: each sample once per epoch.
    """

    pool: pd.DataFrame
    model: ModelHandle
    cost: CostModel | None
    cluster: Cluster
    seed: int
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings.planning)
    mix: DatasetMix | None = None

    @classmethod
    def from_config(cls, cfg: Config, *, shapes: str | Path | pd.DataFrame,
                    costmodel: str | Path | CostModel | None = None,
                    keys: Sequence[tuple[str, str]] | None = None) -> "Sampling":
        """From a dflop config (model, cluster, ``run.seed``, ``data.datasets`` weights), a
        shapes table (`dflop profile-data`'s file, or a DataFrame such as `shapes_of_samples`' rows)
        and optionally a fitted costmodel.json."""
        where = str(shapes) if not isinstance(shapes, pd.DataFrame) else "shapes"
        table = read_shapes(shapes) if not isinstance(shapes, pd.DataFrame) else shapes
        cost = load_cost_model(costmodel) if isinstance(costmodel, (str, Path)) else costmodel
        # Every rank partitions on its own, so only the deterministic members may run: the exact ILP
        # (`scheduler.ilp`) stops at a wall-clock deadline and could leave ranks with different splits.
        sched = replace(SchedulerSettings.of_config(cfg.scheduler), policy=Policy.DFLOP, ilp="never")
        pool = align_shapes(table, keys, where)
        mix = dataset_mix(pool["dataset"].tolist(), cfg.datasets) if "dataset" in pool.columns else None
        return cls(pool, ModelHandle.resolve(cfg.model), cost, Cluster.from_section(cfg.cluster), cfg.seed, sched, mix)

    def pricing(self, world_size: int, grad_accum: int) -> Pricing:
        """The pricing of `hf_plan` (the trainer's: `dflop.runtime.trainer.training_pricing`)."""
        return training_pricing(hf_plan(self.model, world_size, grad_accum), self.model, self.cost, self.cluster)


def shapes_of_samples(samples, cfg: Config) -> pd.DataFrame:
    """Shapes rows computed now from `samples` (`dflop.data.readers.RawSample`, e.g. `read_spec`'s),
    as `dflop profile-data` computes them (headers only, no pixels decoded); for data without a
    shapes.parquet. Skipped samples keep their row with a ``skipped:`` status."""
    from dflop.data.tokenizer import load_tokenizer
    from dflop.models.presets import tower_arch_params
    from dflop.profiling.data_profiler import ShapeRules, shape_rows

    rules = ShapeRules(arch=cfg.model.arch, arch_params=tower_arch_params(cfg.model.arch, cfg.model.vision,
                                                                        cfg.model.arch_params),
                       tokenizer=cfg.model.tokenizer)
    rows = shape_rows(list(samples), rules, load_tokenizer(rules.tokenizer))
    return pd.DataFrame([row for row, _ in rows])


class DflopBatchSampler(Sampler[list[int]]):
    """This rank's microbatches: `grad_accum` lists of train-dataset indices per optimizer step
    (module docstring). An epoch has ``len(pool) // global_batch_size`` steps (a last incomplete
    batch is dropped, as in `dflop train`); `set_epoch` picks the epoch (the `Trainer` calls it).

    global_batch_size: samples per optimizer step over all ranks (HF's per-device batch x
    accumulation x world size is the same number of samples, split evenly there)."""

    def __init__(self, sampling: Sampling, *, global_batch_size: int, world_size: int, rank: int,
                 grad_accum: int):
        for name, value in (("world_size", world_size), ("grad_accum", grad_accum),
                            ("global_batch_size", global_batch_size)):
            if int(value) != value or value < 1:
                raise UserError(f"DflopBatchSampler: {name} must be a positive integer, got {value!r}")
        if not 0 <= rank < world_size:
            raise UserError(f"DflopBatchSampler: rank {rank} is outside world size {world_size}")
        if sampling.scheduler.ilp != "never" and world_size > 1:
            raise UserError("DflopBatchSampler: scheduler ilp must be 'never' on more than one rank: every rank "
                            "partitions on its own, and the ILP's wall-clock deadline could split differently")
        if global_batch_size < world_size * grad_accum:
            raise UserError(f"DflopBatchSampler: a global batch of {global_batch_size} samples cannot give each of "
                            f"{world_size} ranks x {grad_accum} microbatches a sample")
        self.sampling, self.rank, self.world_size, self.grad_accum = sampling, rank, world_size, grad_accum
        self.global_batch_size = global_batch_size
        self.pricing = sampling.pricing(world_size, grad_accum)
        self.whole = Pool.from_shapes(sampling.pool, where="the sampler's shapes")
        self.batches = GlobalBatches(len(self.whole), global_batch_size, sampling.seed, mix=sampling.mix)
        self.epoch = 0
        self._last: tuple[int, list[list[list[int]]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    @property
    def steps_per_epoch(self) -> int:
        return self.batches.per_epoch

    def __len__(self) -> int:
        return self.batches.per_epoch * self.grad_accum

    def partition(self, step: int) -> tuple[np.ndarray, Partition]:
        """(pool rows of global batch `step`, DFLOP's partition of it). A batch the memory guard
        cannot place is a one-line error naming the step and the sample."""
        rows = self.batches.rows(step)
        costs = price(self.pricing, self.whole.take(rows), "dflop")
        try:
            part = run_partition(costs, self.pricing, self.sampling.scheduler, seed=self.sampling.seed + step)
        except MemoryGuardError as exc:
            index = str(exc).split(":")[0].removeprefix("sample index ").strip()
            sample = self.whole.sample_id[rows[int(index)]] if index.isdigit() else "?"
            raise UserError(f"DflopBatchSampler step {step}: sample {sample} fits in no microbatch under "
                            f"cluster.gpu_memory_gb ({exc}); raise gradient_accumulation_steps or the memory") from None
        return rows, part

    def step_bins(self, step: int) -> list[list[list[int]]]:
        """[microbatch position][rank] -> train-dataset indices of global batch `step` (every rank's)."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        rows, part = self.partition(step)
        bins = [[[int(rows[i]) for i in b] for b in mb] for mb in part.bins()]
        for p, mb in enumerate(bins):
            for r, b in enumerate(mb):
                if not b:  # the scheduler never leaves a bin empty; DDP would wait on this rank forever
                    raise RuntimeError(f"DflopBatchSampler step {step}: rank {r}'s microbatch {p} is empty")
        self._last = (step, bins)
        return bins

    def __iter__(self) -> Iterator[list[int]]:
        first = self.epoch * self.batches.per_epoch
        for step in range(first, first + self.batches.per_epoch):
            for mb in self.step_bins(step):
                yield mb[self.rank]


class DflopTrainer(Trainer):
    """`transformers.Trainer` whose training batches come from `DflopBatchSampler`.

    dflop: the `Sampling` (`Sampling.from_config`). The global batch is
    ``per_device_train_batch_size x gradient_accumulation_steps x world_size`` samples, as in HF's
    own samplers; each microbatch then holds a varying number of them. Everything else (collator,
    optimizer, DDP/FSDP/DeepSpeed, the loss's ``num_items_in_batch``) is HF's."""

    def __init__(self, *args, dflop: Sampling, **kwargs):
        super().__init__(*args, **kwargs)
        self.dflop = dflop

    def _get_train_sampler(self, train_dataset=None) -> DflopBatchSampler:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if dataset is not None and len(dataset) != len(self.dflop.pool):
            raise UserError(f"DflopTrainer: the train dataset has {len(dataset)} items but the shapes "
                            f"{len(self.dflop.pool)} usable rows (one row per item: `align_shapes`)")
        args = self.args
        world = max(1, args.world_size)
        accum = args.gradient_accumulation_steps
        return DflopBatchSampler(self.dflop, global_batch_size=args.per_device_train_batch_size * accum * world,
                                 world_size=world, rank=args.process_index if world > 1 else 0, grad_accum=accum)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        sampler = self._get_train_sampler()
        args = self.args
        collate = self._get_collator_with_removed_columns(self.data_collator, description="Training")
        loader = DataLoader(self.train_dataset, batch_sampler=sampler, collate_fn=collate,
                            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
                            persistent_workers=args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
                            worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers,
                                                   rank=args.process_index))
        loader = self.accelerator.prepare(loader)
        # accelerate wraps a batch sampler in a `BatchSamplerShard` that deals batches out to the
        # processes; ours yields only this rank's already, so the wrapper must pass them all through.
        pass_through(loader, sampler)
        return loader


def pass_through(loader: DataLoader, sampler: DflopBatchSampler) -> None:
    """Make accelerate's `BatchSamplerShard` around `sampler` (`Accelerator.prepare`) hand on every
    batch: `sampler` yields only this rank's already. Also expose `sampler` as the shard's
    ``sampler``, so `set_epoch` still reaches it when a resume wraps the shard in a
    `SkipBatchSampler` (accelerate's `DataLoaderShard.set_epoch` looks two levels down for a
    ``sampler``; the `Trainer` forwards only one level)."""
    shard = getattr(loader, "batch_sampler", None)
    if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
        shard.num_processes, shard.process_index = 1, 0
        shard.sampler = sampler


class TokenItems(torch.utils.data.Dataset):
    """A train dataset for HF's `Trainer` over `dflop.data.training.TrainingData`: item i is
    ``{"input_ids", "labels", "dflop_index": i}`` (tokens with the media placeholders expanded; no
    pixels). Pixels are decoded by the collator, for the batch it is given only: HF's length-based
    samplers (``group_by_length``, ``batch_rebalance``) read every item's ``input_ids`` once to
    learn its length, which must not decode every image and video of the dataset. Train with
    ``remove_unused_columns=False`` so ``dflop_index`` reaches the collator."""

    def __init__(self, data):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        ids, labels = self.data.tokens(int(i))
        return {"input_ids": ids, "labels": labels, "dflop_index": int(i)}


class LlavaOnevisionCollator:
    """A list of `TokenItems` items -> the inputs of transformers' `LlavaOnevisionForConditionalGeneration`.

    Media in the processor's format: ``pixel_values`` [images, most tiles, 3, S, S] (an image's
    AnyRes crops, zero-padded to the batch's most), ``image_sizes`` [images, 2] (height, width in
    pixels), ``batch_num_images`` [samples] (a lone image is tiled, images of a multi-image sample
    are not), ``pixel_values_videos`` [videos, frames, 3, S, S].

    pack False: rows right-padded to the longest (``attention_mask``; padding labelled -100), as
    LLaVA-OV's own training code batches. pack True: the samples concatenated into one row with
    ``position_ids`` restarting per sample and no attention mask, which transformers turns into a
    block-causal mask (sdpa/eager: only with ``use_cache=False``, set here); ``shift_labels`` are
    shifted per sample, so no sample's last token is trained on the next sample's first and the
    answer-token count (`Trainer`'s ``num_items_in_batch``) is the padded batch's.

    transformers' LLaVA-OV takes a batch's videos as one [videos, frames, ...] tensor, so videos of
    one batch must have the same frame count (a video shorter than ``video_frames`` has fewer): a
    batch mixing counts is a one-line error naming them.
    """

    def __init__(self, data, pad_token_id: int, *, pack: bool = False):
        self.data, self.pad_token_id, self.pack = data, int(pad_token_id), pack

    def __call__(self, features: Sequence[dict]) -> dict:
        from dflop.data.training import IGNORE_INDEX, IMAGE, VIDEO, Request

        images, sizes, per_sample, videos = [], [], [], []
        for f in features:
            loaded = self.data[Request(int(f["dflop_index"]), layout=True, pixels=True)]
            start, n_images = 0, 0
            for item in loaded.layout.media:
                tiles = loaded.pixels[start:start + item.n_tiles]
                start += item.n_tiles
                if item.kind == IMAGE:
                    images.append(tiles)
                    sizes.append(item.size_hw)
                    n_images += 1
                elif item.kind == VIDEO:
                    videos.append((tiles, int(f["dflop_index"])))
            per_sample.append(n_images)
        batch: dict = {}
        if self.pack:
            ids = torch.cat([f["input_ids"] for f in features])[None]
            labels = torch.cat([f["labels"] for f in features])[None]
            shifted = torch.cat([torch.cat([f["labels"][1:], torch.tensor([IGNORE_INDEX])]) for f in features])[None]
            positions = torch.cat([torch.arange(len(f["input_ids"])) for f in features])[None]
            batch.update(input_ids=ids, labels=labels, shift_labels=shifted, position_ids=positions, use_cache=False)
        else:
            longest = max(len(f["input_ids"]) for f in features)
            ids = torch.full((len(features), longest), self.pad_token_id, dtype=torch.long)
            labels = torch.full((len(features), longest), IGNORE_INDEX, dtype=torch.long)
            mask = torch.zeros((len(features), longest), dtype=torch.long)
            for row, f in enumerate(features):
                n = len(f["input_ids"])
                ids[row, :n], labels[row, :n], mask[row, :n] = f["input_ids"], f["labels"], 1
            batch.update(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False)
        if images:
            most = max(len(t) for t in images)
            stacked = torch.zeros(len(images), most, *images[0].shape[1:])
            for k, tiles in enumerate(images):
                stacked[k, :len(tiles)] = tiles
            batch.update(pixel_values=stacked, image_sizes=torch.tensor(sizes, dtype=torch.long),
                         batch_num_images=torch.tensor(per_sample, dtype=torch.long))
        if videos:
            frames = {len(tiles) for tiles, _ in videos}
            if len(frames) > 1:  # the model takes [videos, frames, ...]: one frame count per batch
                raise UserError("LlavaOnevisionCollator: videos of one batch must have the same frame count, got "
                                + ", ".join(f"{self.data.samples[i].sample_id}: {len(t)}" for t, i in videos))
            batch["pixel_values_videos"] = torch.stack([tiles for tiles, _ in videos])
        return batch
