"""Per-step metrics: metrics.parquet (docs/design.md) and the model-FLOPs estimate behind ``tflops``.

Columns: ``step`` (optimizer steps done, from 1), ``loss`` (mean over the global batch's answer
tokens), ``step_s`` (wall seconds), ``samples``, ``tokens`` (real LLM tokens, no padding),
``tflops`` (model TFLOP/s of the whole run: `step_flops` / step_s / 1e12), ``idle_frac`` (share of
rank-seconds not computing: pipeline bubble + imbalance + communication waits), ``sched_ms``
(scheduler solve time, off the critical path when it keeps ahead), ``sched_gap`` (its simulated
step / lower bound, both priced as profiled), ``predicted_step_s`` (the step's partition simulated
with the cost model as profiled: never corrected), ``corrected_step_s`` (the same partition
simulated with the adaptive correction's learned stage costs, plus its learned seconds per step
outside the stages, `dflop.scheduler.correction`; NaN until it has learned from a step (a run's
first step, the warm-up, is not learned from) and under the baseline policy, which has none),
``correction_active`` (the correction's cost-benefit gate: True when the scheduler partitioned
this step with the corrected costs; the two predictions are reported either way), ``run_id`` (the
run the row belongs to, `dflop.runtime.run_identity`: a run resumed with more steps keeps its id),
then ``lr``, ``grad_norm``, ``data_wait_s`` (rank 0's wait for the step's samples: on GPUs the
prefetch's remainder and the ranks' agreement that every load succeeded; on CPU its own loads,
the agreement then overlapping its compute, `dflop.runtime.step_source`), ``member``, ``skipped_samples`` (samples that failed
to load in this step and were replaced, `dflop.runtime.skipping`), ``peak_bytes`` (rank 0's CUDA
allocator peak during the step; NaN on CPU), and per pipeline stage
``busy_s_<stage>`` / ``idle_s_<stage>`` (mean over the stage's ranks; stages named vision0.., llm0..).

Rows are saved at every checkpoint and joined into metrics.parquet at the end (`MetricsWriter`). A
resumed run first drops rows after its checkpoint's step, so the file never has lost or repeated steps.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np
import pandas as pd

from dflop.io import atomic_path
from dflop.scheduler.correction import WARMUP_STEPS, MeasuredTimes

if TYPE_CHECKING:  # annotations only: the report and compare-runs read metrics without torch or transformers
    from dflop.models.info import ModelInfo
    from dflop.runtime.topology import Topology
    from dflop.scheduler.online import StepPlan



@dataclass(frozen=True)
class MetricsRow:
    """One step's row of metrics.parquet (module docstring): the fields are the file's columns, in
    the file's order, except `stage_busy_s`, which becomes ``busy_s_<stage>`` / ``idle_s_<stage>``
    (idle: step_s less busy) per stage at its place (`to_dict`). Values keep their Python types
    (int, float, bool, str), so the columns' dtypes are int64, float64, bool and object."""

    step: int
    loss: float
    step_s: float
    samples: int
    tokens: int
    tflops: float
    idle_frac: float
    sched_ms: float
    sched_gap: float
    predicted_step_s: float
    corrected_step_s: float
    correction_active: bool
    run_id: str
    lr: float
    grad_norm: float
    answer_tokens: int
    data_wait_s: float
    member: str
    stage_busy_s: Mapping[str, float]  # seconds per stage label (`stage_labels`), in chain order
    skipped_samples: int
    peak_bytes: float  # NaN on CPU

    def to_dict(self) -> dict:
        """The row as metrics.parquet's columns, in order."""
        row = {}
        for f in fields(self):
            if f.name == "stage_busy_s":
                for label, seconds in self.stage_busy_s.items():
                    row[f"busy_s_{label}"] = seconds
                    row[f"idle_s_{label}"] = self.step_s - seconds
            else:
                row[f.name] = getattr(self, f.name)
        return row

    @classmethod
    def columns(cls, stages: Sequence[str]) -> list[str]:
        """metrics.parquet's columns for a run with these stage labels."""
        out = []
        for f in fields(cls):
            out += ([c for s in stages for c in (f"busy_s_{s}", f"idle_s_{s}")] if f.name == "stage_busy_s"
                    else [f.name])
        return out

PART_PREFIX = "steps_from_"  # a part file of MetricsWriter: steps_from_<first step, 9 digits>.parquet


class MetricsWriter:
    """Collects one row per step (rank 0 only) and saves them where a killed run finds them.

    `append` only keeps the row in memory; `flush`, called before every checkpoint is written,
    saves the rows since the previous flush as one more part file in `folder` (next to the
    checkpoints). A step therefore costs the same however many steps came before it, and every
    step up to a checkpoint is on disk before the checkpoint is. The folder survives a killed run
    (Snakemake deletes the declared outputs of an incomplete job, but not the checkpoint folder), so
    a re-run keeps the rows up to the checkpoint it resumes from and drops later ones: no step is
    lost or repeated. `publish` joins the parts and the unflushed rows into the run's
    metrics.parquet, one ordinary Parquet file, when training ends. Every write is atomic.
    """

    def __init__(self, folder: str | Path, resume_step: int = 0):
        self.folder = Path(folder)
        self.pending: list[dict] = []  # MetricsRow.to_dict() of the rows since the last flush
        if resume_step > 0:
            self._adopt_single_file()
            self._drop_after(resume_step)
        else:
            shutil.rmtree(self.folder, ignore_errors=True)

    def append(self, row: MetricsRow) -> None:
        self.pending.append(row.to_dict())

    def flush(self) -> None:
        """Save the rows appended since the last flush as a part file (before a checkpoint)."""
        if not self.pending:
            return
        frame = _frame(self.pending)
        _write(frame, self.folder / f"{PART_PREFIX}{int(frame['step'].iloc[0]):09d}.parquet")
        self.pending = []

    def publish(self, path: str | Path) -> None:
        """Write every row so far (the parts, then the unflushed rows) to `path` (the stage's metrics.parquet)."""
        frames = [pd.read_parquet(part) for part in self._parts()]
        if self.pending:
            frames.append(pd.DataFrame(self.pending))
        _write(_frame(frames), Path(path))

    def _parts(self) -> list[Path]:
        """The part files in step order (their names carry the first step, zero-padded)."""
        return sorted(self.folder.glob(f"{PART_PREFIX}*.parquet"))

    def _adopt_single_file(self) -> None:
        """Make the one working file that earlier versions rewrote every step (``<folder>.parquet``)
        the first part, so a run resumed across the upgrade keeps its earlier rows."""
        single = self.folder.with_suffix(".parquet")
        if single.exists() and not self._parts():
            self.folder.mkdir(parents=True, exist_ok=True)
            single.rename(self.folder / f"{PART_PREFIX}{0:09d}.parquet")

    def _drop_after(self, step: int) -> None:
        """Remove the rows after `step` (saved before a checkpoint that a kill left incomplete)."""
        for part in self._parts():
            steps = pd.read_parquet(part, columns=["step"])["step"]
            if steps.min() > step:
                part.unlink()
            elif steps.max() > step:
                frame = pd.read_parquet(part)
                _write(frame[frame["step"] <= step], part)


def _frame(rows: list[dict] | list[pd.DataFrame]) -> pd.DataFrame:
    """The rows (`MetricsRow.to_dict`s, or frames read back from parts) as one frame, in their
    columns' order."""
    if rows and isinstance(rows[0], pd.DataFrame):
        return pd.concat(rows, ignore_index=True)
    return pd.DataFrame(rows)


def _write(frame: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)


def step_flops(info: ModelInfo, n_tiles: Sequence[int], seq_len: Sequence[int], *, vision_trainable: bool = True,
               llm_trainable: bool = True) -> float:
    """Model FLOPs of one step (the MFU convention: matmuls only, 2 per multiply-add).

    Forward: vision ``2 * params * tokens`` per layer + ``4 * T^2 * d`` attention per tile of T
    tokens; LLM ``2 * params * s`` per layer and head + causal attention ``2 * s^2 * d`` per layer
    for a sample of s tokens. Training counts 3 forwards for a trained part, 1 for a frozen vision
    tower (it skips backward) and 2 for a frozen LLM (input gradients only).
    """
    tiles = np.asarray(n_tiles, dtype=np.float64)
    seqs = np.asarray(seq_len, dtype=np.float64)
    t = info.vision_tokens_per_tile
    per_tile = (2 * (info.vision_embed_params + info.vision_layers * info.vision_layer_params) * t
                + info.vision_layers * 4 * t * t * info.vision_hidden
                + 2 * info.projector_params * info.llm_tokens_per_tile)
    vision = per_tile * tiles.sum() * (3 if vision_trainable else 1)
    llm = (2 * (info.llm_layers * info.llm_layer_params + info.llm_head_params) * seqs.sum()
           + info.llm_layers * 2 * info.llm_hidden * (seqs ** 2).sum()) * (3 if llm_trainable else 2)
    return float(vision + llm)


# -- how far the predictions were from the measurements ------------------------------------------------



@dataclass(frozen=True)
class PredictionAgreement:
    """Measured / predicted step over the steady-state steps of one run (after `WARMUP_STEPS`).

    ratio_p10 / ratio_p50 / ratio_p90: of step_s / predicted_step_s per step; corrected_p50: the
    same against ``corrected_step_s`` (the adaptive correction's prediction) where the run has it.
    """

    steps: int
    first_step: int
    ratio_p10: float
    ratio_p50: float
    ratio_p90: float
    corrected_p50: float | None

    def describe(self) -> str:
        text = (f"measured / predicted step {self.ratio_p50:.3g} median (p10 {self.ratio_p10:.3g}, "
                f"p90 {self.ratio_p90:.3g}) over {self.steps} steps from step {self.first_step}")
        if self.corrected_p50 is not None:
            text += f"; against the corrected prediction {self.corrected_p50:.3g} median"
        return text


def prediction_agreement(metrics: pd.DataFrame, warmup_steps: int = WARMUP_STEPS) -> PredictionAgreement | None:
    """How the run's steady-state steps compared with their predictions; None without such steps."""
    rows = metrics[(metrics["step"] > warmup_steps) & (metrics["predicted_step_s"] > 0)]
    if rows.empty:
        return None
    ratio = (rows["step_s"] / rows["predicted_step_s"]).to_numpy()
    corrected = None
    if "corrected_step_s" in rows and rows["corrected_step_s"].notna().any():
        fixed = rows[rows["corrected_step_s"] > 0]
        corrected = float(np.median(fixed["step_s"] / fixed["corrected_step_s"])) if len(fixed) else None
    p10, p50, p90 = np.percentile(ratio, [10, 50, 90])
    return PredictionAgreement(len(rows), int(rows["step"].min()), float(p10), float(p50), float(p90), corrected)


# -- one row from the gathered stage times ------------------------------------------------------------


def stage_labels(topo: Topology) -> list[str]:
    """Name of every pipeline stage, in chain order (vision0.., llm0..)."""
    return plan_stage_labels(topo.plan)


def plan_stage_labels(plan) -> list[str]:
    """`stage_labels` of a `dflop.plan.Plan`: the stages its metrics.parquet has columns for."""
    vision = [f"vision{k}" for k in range(plan.layout.n_vision_stages)]
    return vision + [f"llm{j}" for j in range(plan.llm.pp)]


def measured_times(topo: Topology, times: np.ndarray, plan: StepPlan):
    """MeasuredTimes (by microbatch id) from the gathered [world, 2, m] busy seconds: per stage the
    slowest replica/TP rank (vision) or the slowest TP rank of each replica (LLM)."""
    p_v = topo.plan.layout.n_vision_stages
    m, dp = plan.n_microbatches, topo.plan.llm.dp
    ids = np.asarray(plan.microbatch_ids)
    vision_fwd, vision_bwd = np.zeros((p_v, m)), np.zeros((p_v, m))
    llm_fwd, llm_bwd = np.zeros((dp, topo.plan.llm.pp, m)), np.zeros((dp, topo.plan.llm.pp, m))
    for rank, other in enumerate(topo.peers):
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
    for rank, other in enumerate(topo.peers):
        per_stage.setdefault(other.pipeline_stage, []).append(float(times[rank].sum()))
    return {labels[s]: float(np.mean(v)) for s, v in sorted(per_stage.items())}


@dataclass(frozen=True)
class StepStats:
    """What one step did (`dflop.runtime.trainer.Trainer.train_step`), for its metrics row.

    plan: the step's plan as computed (failed samples replaced); gradients: `Trainer.compute_gradients`'
    statistics; times: [world, 2, m] busy seconds (`Trainer.gather_times`, rank 0; None elsewhere); step_s,
    data_wait_s: wall seconds of the step and of its wait for samples; skipped: samples replaced
    in it; peak_bytes: the rank's CUDA allocator peak during it (NaN on CPU).
    """

    plan: StepPlan
    gradients: dict
    times: np.ndarray | None
    step_s: float
    data_wait_s: float
    grad_norm: float
    lr: float
    skipped: int
    peak_bytes: float


def metrics_row(trainer, plan: StepPlan, stats: dict, times: np.ndarray, step_s: float, data_wait: float,
                norm: float, lr: float, *, skipped_samples: int, peak_bytes: float) -> MetricsRow:
    """Rank 0's metrics.parquet row of one step (module docstring); `times`: `Trainer.gather_times`."""
    model = trainer.model
    flops = step_flops(model.info, plan.n_tiles, plan.seq_len, vision_trainable=model.vision_side_trainable,
                       llm_trainable=not model.spec.freeze_llm)
    return MetricsRow(
        step=plan.step + 1, loss=stats["loss"], step_s=step_s, samples=len(plan.rows),
        tokens=int(sum(plan.seq_len)), tflops=flops / step_s / 1e12,
        idle_frac=float(1 - times.sum() / (trainer.world * step_s)), sched_ms=plan.sched_s * 1e3,
        sched_gap=plan.predicted_step_s / plan.lower_bound_s if plan.lower_bound_s > 0 else float("nan"),
        predicted_step_s=plan.predicted_step_s, corrected_step_s=plan.corrected_step_s,
        correction_active=bool(plan.correction_active), run_id=trainer.fingerprint.run_id, lr=lr, grad_norm=norm,
        answer_tokens=stats["n_answer"], data_wait_s=data_wait, member=plan.member,
        stage_busy_s=stage_busy(trainer.topo, times), skipped_samples=skipped_samples, peak_bytes=peak_bytes)
