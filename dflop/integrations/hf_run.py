"""The Hugging Face `Trainer` as a LLaVA-OV user runs it, timed per step like `dflop train`: the
peer `dflop head-to-head` measures DFLOP against (and `benchmarks/bench_hf_trainer.py` against its
sampler too).

Inside a torchrun worker, ``python -m dflop.integrations.hf_run --shapes S --out-dir D ...`` trains
transformers' model of the config (random weights, seed ``run.seed``) on the config's datasets
with the config's global batch over the world's data-parallel ranks x ``--accum`` gradient
accumulation steps, AdamW at ``train.lr``, the samples padded to the longest of their microbatch
(`LlavaOnevisionCollator`, as LLaVA-OV's training code batches) and ordered by the Trainer's own
``train_sampling_strategy`` (default ``group_by_length``: the fastest of HF's samplers in
bench_hf_trainer.py). Rank 0 writes ``metrics.parquet`` (`HF_METRICS_COLUMNS`), one row per
optimizer step:

- step_s: wall seconds from the step's start (its turn, with ``--take-turns``) to its end (after the
  optimizer), data loading included, as `dflop train` counts a step;
- idle_frac: the share of the step a rank's main thread did not compute (wall minus thread CPU
  time: waiting in DDP's all-reduce, or descheduled), mean over ranks;
- samples, tokens (real tokens, padding excluded), loss (the step's mean over ranks).

HF's LLaVA-OV takes a batch's videos as one [videos, frames, ...] tensor, so a video with fewer
frames than the model's ``video_frames`` cannot be batched: `hf_pool` leaves those out, and
whoever compares trains every run on that same pool.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from dflop.errors import UserError

HF_METRICS_COLUMNS = ("step", "step_s", "idle_frac", "samples", "tokens", "loss")
STRATEGIES = ("random", "group_by_length", "batch_rebalance")


def hf_pool(shapes: pd.DataFrame, video_frames: int) -> pd.DataFrame:
    """The usable shapes rows HF's LLaVA-OV can batch (module docstring), in file order."""
    from dflop.shapes import usable

    pool = usable(shapes, "shapes")
    keep = (pool["modality"] != "video") | (pool["n_frames"] == video_frames)
    return pool[keep].reset_index(drop=True)


def per_device_batch(global_batch: int, world: int, accum: int) -> int:
    """Samples per rank per microbatch: HF's Trainer takes a fixed count."""
    if global_batch % (world * accum):
        raise UserError(f"train.global_batch_size {global_batch} does not split over {world} rank(s) x "
                        f"{accum} accumulation step(s) (the Hugging Face Trainer needs equal microbatches)")
    return global_batch // (world * accum)


class StepRecorder:
    """Per step of one rank: samples, tokens, summed microbatch losses, wall and thread CPU seconds.

    A step's clock starts at `start()` (train begin, or the turn's start with turns) and stops at
    `stop()` (the step's end); `count` and `add_loss` are called per microbatch."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, float, float, float]] = []
        self._current = [0, 0, 0.0]
        self._wall = self._cpu = 0.0

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def count(self, inputs) -> None:
        if "position_ids" in inputs:  # packed: one row, positions restart at each sample
            self._current[0] += int((inputs["position_ids"] == 0).sum())
            self._current[1] += int(inputs["input_ids"].numel())
        else:
            self._current[0] += int(inputs["input_ids"].shape[0])
            self._current[1] += int(inputs["attention_mask"].sum())

    def add_loss(self, loss: float) -> None:
        self._current[2] += loss

    def stop(self) -> None:
        wall, cpu = time.perf_counter() - self._wall, time.thread_time() - self._cpu
        self.rows.append((*self._current, wall, cpu))
        self._current = [0, 0, 0.0]

    def gathered(self) -> dict[str, list[float]]:
        """Every rank's steps combined (a collective): samples, tokens summed; loss the mean over
        ranks; wall_s the slowest rank's; wait_s the mean over ranks of wall minus thread CPU."""
        import torch
        import torch.distributed as dist

        rows = np.array(self.rows, dtype=np.float64).reshape(-1, 5)
        world = dist.get_world_size() if dist.is_initialized() else 1
        summed = torch.tensor(rows[:, :3])
        walls = torch.tensor(rows[:, 3:])
        gathered = [walls]
        if world > 1:
            dist.all_reduce(summed)
            gathered = [torch.zeros_like(walls) for _ in range(world)]
            dist.all_gather(gathered, walls)
        stacked = torch.stack(gathered).numpy()  # [rank, step, (wall, cpu)]
        return {"samples": summed[:, 0].tolist(), "tokens": summed[:, 1].tolist(),
                "loss": (summed[:, 2] / world).tolist(), "wall_s": stacked[:, :, 0].max(axis=0).tolist(),
                "wait_s": (stacked[:, :, 0] - stacked[:, :, 1]).clip(min=0).mean(axis=0).tolist()}


def recording_trainer(base: type, recorder: StepRecorder) -> type:
    """`base` (a `transformers.Trainer` class) that counts every microbatch into `recorder`."""

    class Recorded(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            recorder.count(inputs)
            loss = super().training_step(model, inputs, num_items_in_batch)
            recorder.add_loss(float(loss))
            return loss

    return Recorded


def step_callback(recorder: StepRecorder, turns=None):
    """A `TrainerCallback` that times each optimizer step into `recorder`, taking its steps in turn
    with other jobs (`dflop.runtime.turns.Turns`) when `turns` is given."""
    from transformers import TrainerCallback

    from dflop.runtime.turns import NoTurns

    turns = turns or NoTurns()

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            turns.wait()
            recorder.start()

        def on_step_end(self, args, state, control, **kwargs):
            recorder.stop()
            turns.done(last=state.global_step >= state.max_steps)
            if state.global_step < state.max_steps:
                turns.wait()
                recorder.start()

    return StepClock()


def training_arguments(cfg, out_dir: Path, *, per_device: int, accum: int, steps: int, strategy: str):
    """The `TrainingArguments` of a CPU/gloo or GPU run of `cfg`'s training settings."""
    from transformers import TrainingArguments

    cpu = cfg.cluster.device == "cpu"
    return TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=accum, max_steps=steps, learning_rate=cfg.train.lr,
                             weight_decay=cfg.train.weight_decay, max_grad_norm=cfg.train.grad_clip,
                             lr_scheduler_type="constant", train_sampling_strategy=strategy, use_cpu=cpu,
                             ddp_backend="gloo" if cpu else None, report_to=[], save_strategy="no",
                             logging_strategy="no", remove_unused_columns=False, dataloader_num_workers=0,
                             seed=cfg.seed, disable_tqdm=True, dataloader_drop_last=True)


def train_hf(cfg, *, shapes_path: str | Path, out_dir: str | Path, steps: int, accum: int,
             strategy: str = "group_by_length", take_turns: str | Path | None = None) -> Path:
    """Train `steps` optimizer steps with HF's `Trainer` in this torchrun worker (module docstring);
    rank 0 writes out_dir/metrics.parquet, whose path is returned."""
    import torch
    import torch.distributed as dist
    from transformers import Trainer

    from dflop.data.training import TrainingData, pool_samples
    from dflop.integrations.hf import LlavaOnevisionCollator, TokenItems
    from dflop.io import atomic_path
    from dflop.models.builder import build_model
    from dflop.models.handle import ModelHandle
    from dflop.profiling.model_profiler import CPU_THREADS_PER_RANK
    from dflop.runtime.process_group import barrier, init_distributed
    from dflop.runtime.turns import Turns
    from dflop.shapes import read_shapes

    if strategy not in STRATEGIES:
        raise UserError(f"--strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    init_distributed(cfg.cluster.device)
    if cfg.cluster.device == "cpu":  # as `dflop train` runs a CPU rank
        torch.set_num_threads(CPU_THREADS_PER_RANK)
    handle = ModelHandle.resolve(cfg.model)
    rules = handle.sample_rules()
    pool = hf_pool(read_shapes(shapes_path), int(rules.arch_params["video_frames"]))
    items = TokenItems(TrainingData(pool_samples(pool, cfg.datasets, cfg.seed), rules))
    world, rank = dist.get_world_size(), dist.get_rank()
    per_device = per_device_batch(cfg.train.global_batch_size, world, accum)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model.arch, cfg.model.vision, cfg.model.llm, seed=cfg.seed, llm_attention="sdpa")
    recorder = StepRecorder()
    turns = Turns(take_turns, rank=rank, barrier=barrier) if take_turns is not None else None
    out_dir = Path(out_dir)
    args = training_arguments(cfg, out_dir / "hf_trainer", per_device=per_device, accum=accum, steps=steps,
                              strategy=strategy)
    trainer = recording_trainer(Trainer, recorder)(
        model=model, args=args, train_dataset=items, data_collator=LlavaOnevisionCollator(items.data, 0),
        callbacks=[step_callback(recorder, turns)])
    trainer.train()
    res = recorder.gathered()
    path = out_dir / "metrics.parquet"
    if rank == 0:
        wall = np.array(res["wall_s"])
        frame = pd.DataFrame({"step": np.arange(1, len(wall) + 1), "step_s": wall,
                              "idle_frac": np.array(res["wait_s"]) / wall,
                              "samples": np.array(res["samples"], dtype=np.int64),
                              "tokens": np.array(res["tokens"], dtype=np.int64), "loss": res["loss"]})
        with atomic_path(path) as tmp:
            frame[list(HF_METRICS_COLUMNS)].to_parquet(tmp, index=False)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflop.integrations.hf_run",
                                     description="Train with the Hugging Face Trainer inside a torchrun worker "
                                                 "(dflop.integrations.hf_run's docstring).")
    parser.add_argument("--config", type=Path, help="YAML config (default: the demo default)")
    parser.add_argument("--settings", help="JSON object laid over --config")
    parser.add_argument("--shapes", type=Path, required=True, help="shapes.parquet")
    parser.add_argument("--out-dir", type=Path, required=True, help="where metrics.parquet goes")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: train.steps)")
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--strategy", default="group_by_length", choices=STRATEGIES,
                        help="the Trainer's train_sampling_strategy")
    parser.add_argument("--take-turns", metavar="DIR/NAME", help="take each step in turn (dflop.runtime.turns)")
    args = parser.parse_args(argv)
    from dflop.config import load
    from dflop.runtime.process_group import end_worker

    try:
        cfg = load(args.config, args.settings)
        train_hf(cfg, shapes_path=args.shapes, out_dir=args.out_dir, steps=args.steps or cfg.train.steps,
                 accum=args.accum, strategy=args.strategy, take_turns=args.take_turns)
    except UserError as exc:
        print(f"hf_run: {exc}", file=sys.stderr)
        return 2
    end_worker(0)


if __name__ == "__main__":
    sys.exit(main())
