"""A training run (rule train): `train` inside every torchrun worker, step after step, with
checkpoints a re-run resumes from.

`train(cfg, plan_path=..., shapes_path=..., costmodel_path=..., out_dir=...)` reads plan.yaml
(`dflop.plan`), shapes.parquet (`dflop.shapes`) and the cost model, builds this rank's `Trainer`
and, after each step, on rank 0: a metrics row (metrics.parquet), the progress bar and a one-line
log, and the measured stage times for the scheduler's adaptive correction; every
``train.checkpoint_every`` steps and at the end the rows since the last checkpoint, then a
checkpoint (`dflop.runtime.checkpoint`). A re-run
resumes from the newest checkpoint when it is of the same run (`dflop.runtime.run_identity`).
The steps of ``train.trace_steps`` are traced (`dflop.runtime.spans`): ``trace.json`` beside the
checkpoints once the window's last step is done, published beside metrics.parquet at the end.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from dflop.plan import read_plan
from dflop.profiling.model_profiler import CPU_THREADS_PER_RANK
from dflop.progress import progress as progress_counter
from dflop.runtime.agreement import rank0_result
from dflop.data.training import pool_samples
from dflop.runtime.metrics import MetricsWriter, measured_times, metrics_row
from dflop.runtime.process_group import barrier, init_distributed
from dflop.runtime.run_identity import prepare_checkpoints
from dflop.runtime.spans import publish_trace, rank_labels, write_trace
from dflop.runtime.settings import TrainSettings
from dflop.runtime.trainer import Trainer, plan_cluster
from dflop.runtime.turns import NoTurns, Turns
from dflop.shapes import read_shapes
from dflop.costmodel.jsonio import load_cost_model

log = logging.getLogger("dflop.train")


def train(cfg, *, plan_path: str | Path, shapes_path: str | Path, costmodel_path: str | Path | None,
          out_dir: str | Path, steps: int | None = None, policy: str | None = None, pad_to_longest: bool | None = None,
          export: bool = True, progress: bool = True, stop_after: int | None = None, fresh: bool = False,
          take_turns: str | Path | None = None) -> Path:
    """Train inside a torchrun worker (every rank calls it); returns metrics.parquet's path.

    cfg: a `dflop.config.Config`. plan_path: plan.yaml; shapes_path: shapes.parquet; costmodel_path:
    costmodel.json (None: the FLOP-count stand-in, `dflop.costmodel.analytic`). out_dir gets
    ``metrics.parquet`` and ``checkpoints/`` and, at the end, ``final/`` (a Hugging Face
    directory, unless export=False); a re-run resumes from the newest complete checkpoint there
    when it is of the same run (otherwise, or with fresh=True, it is moved aside and the run
    starts afresh).
    steps / policy / pad_to_longest: override train.steps / scheduler.policy / the baseline's
    padding variant. stop_after: stop (as if killed) after this many steps of this run (tests).
    take_turns: ``DIR/NAME``: take each step in turn with the other jobs of DIR (`dflop.runtime.turns`).
    """
    settings = TrainSettings.from_config(cfg, steps=steps, policy=policy, pad_to_longest=pad_to_longest)
    return run_training(settings, plan_path=plan_path, shapes_path=shapes_path, costmodel_path=costmodel_path,
                        out_dir=out_dir, export=export, progress=progress, stop_after=stop_after, fresh=fresh,
                        take_turns=take_turns)


def run_training(settings: TrainSettings, *, plan_path: str | Path, shapes_path: str | Path,
                 costmodel_path: str | Path | None, out_dir: str | Path, export: bool = True,
                 progress: bool = True, stop_after: int | None = None, fresh: bool = False,
                 take_turns: str | Path | None = None) -> Path:
    """`train` with explicit settings (see there)."""
    from dflop.runtime.checkpoint import load_latest, save_checkpoint

    device = init_distributed(settings.cluster.device)
    if device.type == "cpu":  # as the profile timed a rank (CPU_THREADS_PER_RANK)
        torch.set_num_threads(CPU_THREADS_PER_RANK)
    torch.manual_seed(settings.seed)
    out_dir = Path(out_dir)
    plan_file = read_plan(plan_path)
    plan_file.check_batch(settings.train.global_batch_size)
    pool = read_shapes(shapes_path)
    cost = load_cost_model(costmodel_path) if costmodel_path is not None else None
    trainer = Trainer(settings, plan_file.plan, pool, pool_samples(pool, settings.datasets, settings.seed),
                      cost=cost, cluster=plan_cluster(plan_file, settings), device=device)
    ckpt_dir = out_dir / "checkpoints"
    decision = rank0_result(lambda: prepare_checkpoints(ckpt_dir, trainer.fingerprint, fresh=fresh,
                                                        lr_at=trainer.lr_at))
    if trainer.rank == 0:
        log.info(decision.message)
    state = trainer.train_state()
    restored = load_latest(ckpt_dir, state)
    start = restored or 0
    if restored is not None:  # else state.extra is this trainer's own fresh state: nothing to continue
        trainer.restore_extra(state.extra)
    trainer.follow_schedule()
    total = settings.train.steps
    metrics = MetricsWriter(ckpt_dir / "metrics", resume_step=start) if trainer.rank == 0 else None
    bar = _progress_bar(total, start, progress and trainer.rank == 0)
    last = total if stop_after is None else min(total, start + stop_after)
    prefetch = not trainer.loads_in_step  # GPUs: the next step loads behind this one (Trainer.loads_in_step)
    turns = Turns(take_turns, rank=trainer.rank, barrier=barrier) if take_turns is not None else NoTurns()
    try:
        if start < last:
            plan_now = trainer.next_plan(start)
            pending = trainer.load(plan_now) if prefetch else None
        spans = trainer.spans
        for step in range(start, last):
            turns.wait()
            spans.begin_step(step + 1)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            with spans.span("data", "data wait"):
                if prefetch:
                    plan_now, loaded, n_skipped = trainer.without_failures(plan_now, pending)
                    check = None
                else:  # the ranks agree on these loads while they compute (Trainer.gradients)
                    (loaded, check), n_skipped = trainer.checked_load(plan_now), 0
                decode_s = trainer.in_step_loads(plan_now, loaded)
            data_wait = time.perf_counter() - t0
            if prefetch and step + 1 < last:
                with spans.span("data", "next plan"):
                    plan_next = trainer.next_plan(step + 1)
                    pending = trainer.load(plan_next)
            stats, plan_now, skipped_late = trainer.gradients(plan_now, loaded, decode_s, check)
            n_skipped += skipped_late
            lr = trainer.current_lr(step)
            norm = trainer.optimizer_step()
            if not prefetch and step + 1 < last:  # a collective: after every rank's agreement wait
                with spans.span("data", "next plan"):
                    plan_next = trainer.next_plan(step + 1)
            if device.type == "cuda":  # the optimizer's kernels are still queued: count them in this step
                torch.cuda.synchronize(device)
            step_s = time.perf_counter() - t0
            spans.end_step()
            if spans.window and step + 1 == spans.window[-1]:
                names, args = rank_labels(trainer.topo)
                write_trace(spans, ckpt_dir / "trace.json", rank=trainer.rank, world=trainer.world,
                            process_names=names, process_args=args)
            times = trainer.gather_times(stats["result"])
            if trainer.rank == 0:
                peak = float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else np.nan
                row = metrics_row(trainer, plan_now, stats, times, step_s, data_wait, norm, lr,
                                  skipped_samples=n_skipped, peak_bytes=peak)
                metrics.append(row)
                trainer.planner.report(step, measured_times(trainer.topo, times, plan_now), step_s=step_s)
                bar.update(1)
                log.info("step %d/%d loss %.4f step %.3fs idle %.1f%% sched %.1fms gap %.3f pred %.3fs corrected %.3fs "
                         "lr %.2e", step + 1, total, row.loss, step_s, 100 * row.idle_frac, row.sched_ms,
                         row.sched_gap, row.predicted_step_s, row.corrected_step_s, row.lr)
            done = step + 1
            if checkpoint_due(done, total, settings.train.checkpoint_every):
                if metrics is not None:  # the rows first: a checkpoint never lacks a step's row
                    metrics.flush()
                save_checkpoint(ckpt_dir, done, trainer.train_state())
            if step + 1 < last:
                plan_now = plan_next
                turns.done()
            else:
                turns.finish()
        if metrics is not None and last == total:
            metrics.publish(out_dir / "metrics.parquet")
            publish_trace(ckpt_dir / "trace.json", out_dir / "trace.json")
        if export and last == total:
            from dflop.runtime.export import export_hf

            export_hf(out_dir / "final", trainer.rank_params)
    finally:
        bar.close()
        trainer.close()
    return out_dir / "metrics.parquet"


def checkpoint_due(done: int, total: int, every: int) -> bool:
    """Whether a checkpoint follows step `done` of `total`: every `every` steps and after the last;
    never with `every` 0 (``train.checkpoint_every``)."""
    return every > 0 and (done % every == 0 or done == total)


def _progress_bar(total: int, start: int, enabled: bool):
    # Off a terminal (logs/train.log) the step's own log line says as much: no extra lines.
    return progress_counter(total, "train", "step", enabled=enabled, initial=start, plain=False)
