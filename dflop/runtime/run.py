"""A training run (rule train): `train` inside every torchrun worker, step after step, with
checkpoints a re-run resumes from.

`train(cfg, plan_path=..., shapes_path=..., costmodel_path=..., out_dir=...)` reads plan.yaml
(`dflop.plan`), shapes.parquet (`dflop.shapes`) and the cost model and builds this rank's
`Trainer`. Each step begins (`Trainer.begin_step`), takes its batch from a `StepSource`
(`dflop.runtime.step_source`: prefetch, the ranks' agreement on failed loads, replacements) and
ends in `Trainer.train_step` (gradients, update, trace, the adaptive correction's measurement);
then rank 0 writes its metrics row (metrics.parquet), the progress bar and a one-line log. Every
``train.checkpoint_every`` steps and at the end: the rows since the last checkpoint, then a
checkpoint (`dflop.runtime.checkpoint`). A re-run resumes from the newest checkpoint when it is
of the same run (`dflop.runtime.run_identity`). The steps of ``train.trace_steps`` are traced
(`dflop.runtime.spans`): ``trace.json`` beside the checkpoints once the window's last step is
done, published beside metrics.parquet at the end.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflop.plan import read_plan
from dflop.profiling.model_profiler import CPU_THREADS_PER_RANK
from dflop.progress import progress as progress_counter
from dflop.runtime.agreement import rank0_result
from dflop.data.training import pool_samples
from dflop.runtime.metrics import MetricsRow, MetricsWriter, metrics_row
from dflop.runtime.process_group import barrier, init_distributed
from dflop.runtime.run_identity import prepare_checkpoints
from dflop.runtime.spans import publish_trace
from dflop.runtime.settings import TrainSettings
from dflop.runtime.step_source import StepSource
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
    ckpt_dir = out_dir / "checkpoints"
    trainer = Trainer(settings, plan_file.plan, pool, pool_samples(pool, settings.datasets, settings.seed),
                      cost=cost, cluster=plan_cluster(plan_file, settings), device=device,
                      trace_path=ckpt_dir / "trace.json")
    decision = rank0_result(lambda: prepare_checkpoints(ckpt_dir, trainer.fingerprint, fresh=fresh,
                                                        lr_at=trainer.lr_at))
    if trainer.rank == 0:
        log.info(decision.message)
    start = load_latest(ckpt_dir, trainer.train_state()) or 0
    trainer.follow_schedule()
    total = settings.train.steps
    metrics = MetricsWriter(ckpt_dir / "metrics", resume_step=start) if trainer.rank == 0 else None
    bar = _progress_bar(total, start, progress and trainer.rank == 0)
    last = total if stop_after is None else min(total, start + stop_after)
    turns = Turns(take_turns, rank=trainer.rank, barrier=barrier) if take_turns is not None else NoTurns()
    try:
        source = StepSource(trainer, start, last)
        for step in range(start, last):
            turns.wait()  # with other jobs taking turns: this job's turn (before the step's clock starts)
            trainer.begin_step(step)  # the step begins
            batch = source.next(step)
            stats = trainer.train_step(batch)  # the step ends
            if metrics is not None:
                row = metrics_row(trainer, stats.plan, stats.gradients, stats.times, stats.step_s, stats.data_wait_s,
                                  stats.grad_norm, stats.lr, skipped_samples=stats.skipped, peak_bytes=stats.peak_bytes)
                metrics.append(row)
                bar.update(1)
                _log_step(row, total)
            if checkpoint_due(step + 1, total, settings.train.checkpoint_every):
                if metrics is not None:  # the rows first: a checkpoint never lacks a step's row
                    metrics.flush()
                save_checkpoint(ckpt_dir, step + 1, trainer.train_state())
            turns.done(last=step + 1 == last)  # the next job's turn
        if last == total:
            _publish(trainer, metrics, out_dir, export)
    finally:
        bar.close()
        trainer.close()
    return out_dir / "metrics.parquet"


def _log_step(row: MetricsRow, total: int) -> None:
    log.info("step %d/%d loss %.4f step %.3fs idle %.1f%% sched %.1fms gap %.3f pred %.3fs corrected %.3fs lr %.2e",
             row.step, total, row.loss, row.step_s, 100 * row.idle_frac, row.sched_ms, row.sched_gap,
             row.predicted_step_s, row.corrected_step_s, row.lr)


def _publish(trainer: Trainer, metrics: MetricsWriter | None, out_dir: Path, export: bool) -> None:
    """The finished run's metrics.parquet and trace.json beside it (rank 0), and the exported model."""
    ckpt_dir = out_dir / "checkpoints"
    if metrics is not None:
        metrics.publish(out_dir / "metrics.parquet")
        publish_trace(ckpt_dir / "trace.json", out_dir / "trace.json")
    if export:
        from dflop.runtime.export import export_hf

        export_hf(out_dir / "final", trainer.rank_params)


def checkpoint_due(done: int, total: int, every: int) -> bool:
    """Whether a checkpoint follows step `done` of `total`: every `every` steps and after the last;
    never with `every` 0 (``train.checkpoint_every``)."""
    return every > 0 and (done % every == 0 or done == total)


def _progress_bar(total: int, start: int, enabled: bool):
    # Off a terminal (logs/train.log) the step's own log line says as much: no extra lines.
    return progress_counter(total, "train", "step", enabled=enabled, initial=start, plain=False)
