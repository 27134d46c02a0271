"""The identity of a training run, and whether a checkpoint on disk may be resumed.

A checkpoint records the fingerprint of the run that wrote it: everything that decides what is
trained (the model and its weights, the tokenizer, the plan's layout, the data actually trained
on, the optimisation settings and the seed), each under the config key a user would change. A
re-run compares its own fingerprint with the newest checkpoint's (`decide`):

- the same fingerprint: resume ("resuming run <id> at step N");
- only ``train.steps`` changed, to at least the checkpoint's step: resume and continue. The LR
  schedule is rebuilt for the new length (what torchtitan does, and Megatron with
  ``--override-opt_param-scheduler``): from step N on the LR is what a run planned with the new
  ``train.steps`` would use at step N; the log line says what the LR was and becomes;
- anything else (or ``dflop train --fresh``, or a checkpoint of an older format): the old
  checkpoint directory is moved aside to ``<out_dir>/previous_runs/`` (nothing is deleted), the
  run starts fresh, and one log line names the keys that differ.

Not part of the identity: settings that change speed but not what is learned (scheduler budget,
prefetch, loader workers, gradient-sync overlap, checkpoint interval, the pipeline schedule) and
``train.steps`` itself. The run id is a short hash of the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pandas as pd

from dflop.errors import UserError

if TYPE_CHECKING:
    from dflop.plan import Plan
    from dflop.runtime.settings import TrainSettings

log = logging.getLogger("dflop.train")

FINGERPRINT_VERSION = 1
PREVIOUS_RUNS_DIR = "previous_runs"
# Columns of shapes.parquet that decide what a step trains on (the usable rows, in file order).
POOL_COLUMNS = ("dataset", "sample_id", "n_tiles", "vision_tokens", "seq_len")
# Bytes of each safetensors file's data hashed at its start and at its end (the header is hashed
# whole): enough to tell two checkpoints of one architecture apart without reading 100s of GB.
WEIGHTS_SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True)
class RunFingerprint:
    """What defines a run: config key -> JSON value (plain values, or ``sha256:...`` digests).

    steps: ``train.steps``, kept apart: a changed length continues the same run.
    """

    fields: Mapping[str, Any]
    steps: int

    @property
    def run_id(self) -> str:
        """12 hex digits naming the run (the fingerprint without ``train.steps``)."""
        return _digest(json.dumps(dict(self.fields), sort_keys=True))[:12]

    def differences(self, other: "RunFingerprint") -> list[str]:
        """Keys whose values differ (present on one side only included), sorted."""
        keys = set(self.fields) | set(other.fields)
        return sorted(k for k in keys if self.fields.get(k) != other.fields.get(k))

    def to_json(self) -> dict:
        return {"version": FINGERPRINT_VERSION, "run_id": self.run_id, "steps": self.steps,
                "fields": dict(self.fields)}

    @classmethod
    def from_json(cls, data: Any) -> "RunFingerprint | None":
        """The fingerprint a checkpoint recorded; None when it has none of this version."""
        if not isinstance(data, Mapping) or data.get("version") != FINGERPRINT_VERSION:
            return None
        if not isinstance(data.get("fields"), Mapping) or not isinstance(data.get("steps"), int):
            return None
        return cls(dict(data["fields"]), int(data["steps"]))


def run_fingerprint(settings: "TrainSettings", plan: "Plan", pool: pd.DataFrame) -> RunFingerprint:
    """The fingerprint of training `settings` with `plan` on the usable shapes rows `pool`."""
    m, t, sched = settings.model, settings.train, settings.scheduler
    layout = {k: v for k, v in plan.to_dict(t.global_batch_size).items() if k != "global_batch_size"}
    # recomputation and SP trade memory for time, the maths is the same; a sharded optimizer changes
    # what a checkpoint holds; a 1F1B LLM (schedule 1f1b, chunks 1) fingerprints as before the keys
    unchanged = {"shard_optimizer": False, "schedule": "1f1b", "chunks": 1}
    for module in ("vision", "llm"):
        layout[module] = {k: v for k, v in layout[module].items()
                          if k not in ("recompute", "sequence_parallel") and not (k in unchanged and v == unchanged[k])}
    fields: dict[str, Any] = {
        "run.seed": settings.seed,
        "model.arch": m.arch,
        "model.vision": m.vision,
        "model.llm": m.llm,
        "model.weights": weights_identity(m.weights),
        "model.tokenizer": tokenizer_identity(m.tokenizer),
        "model.dtype": m.dtype,
        "model.freeze": {"vision": m.freeze_vision, "projector": m.freeze_projector, "llm": m.freeze_llm},
        f"model.{m.arch}": _plain(m.arch_params),
        "plan": layout,
        "scheduler.policy": sched.policy,
        "scheduler.pad_to_longest": sched.pad_to_longest,
        "data.datasets": [{"name": d.name, "format": d.format, "sample": d.sample, "files": dataset_identity(d.path),
                           **({"weight": d.weight} if d.weight is not None else {})}  # the mix decides the batches
                          for d in settings.datasets],
        "data.shapes": pool_identity(pool),
        "train.global_batch_size": t.global_batch_size,
        "train.lr": t.lr,
        "train.min_lr_ratio": t.min_lr_ratio,
        "train.warmup_steps": t.warmup_steps,
        "train.weight_decay": t.weight_decay,
        "train.grad_clip": t.grad_clip,
    }
    return RunFingerprint(fields, int(t.steps))


def pool_identity(pool: pd.DataFrame) -> str:
    """Digest of the training pool: which samples, in which order, with which shapes."""
    h = hashlib.sha256()
    for column in POOL_COLUMNS:
        values = pool[column]
        h.update(column.encode())
        if values.dtype.kind in "iub":
            h.update(np.ascontiguousarray(values.to_numpy(dtype=np.int64)).tobytes())
        else:
            h.update("\x00".join(map(str, values)).encode())
    return f"sha256:{h.hexdigest()}"


def dataset_identity(path: str | Path) -> str:
    """Digest of a dataset's records, wherever it lies: a JSON/JSONL manifest's bytes (the text
    trained on; its media are covered by their shapes in `pool_identity`), or, for a directory of
    Parquet parts (images embedded: too large to read), each part's name, size and footer."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_dir():
        for part in sorted(path.glob("*.parquet")):
            size = part.stat().st_size
            h.update(f"{part.name}:{size}".encode())
            with open(part, "rb") as f:
                f.seek(max(0, size - 8))
                tail = f.read(8)
                footer = int.from_bytes(tail[:4], "little") if len(tail) == 8 else 0
                f.seek(max(0, size - 8 - footer))
                h.update(f.read(footer + 8))
    elif path.is_file():
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    else:
        h.update(b"missing")
    return f"sha256:{h.hexdigest()}"


def weights_identity(weights: str | None) -> str | None:
    """Digest of a local weights directory (config.json, each safetensors file's name, size, header
    and the first and last `WEIGHTS_SAMPLE_BYTES` of its data), wherever it lies; None for random
    init (the seed and presets name it)."""
    if weights is None:
        return None
    root = Path(weights)
    h = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            start = 8 + min(header_len, size)
            f.seek(0)
            h.update(f.read(start))
            h.update(f.read(WEIGHTS_SAMPLE_BYTES))
            f.seek(max(start, size - WEIGHTS_SAMPLE_BYTES))
            h.update(f.read(WEIGHTS_SAMPLE_BYTES))
    return f"sha256:{h.hexdigest()}"


def tokenizer_identity(tokenizer: str) -> str:
    """The bundled tokenizer's name, or a digest of a local tokenizer directory's files."""
    path = Path(tokenizer)
    if str(tokenizer).lower() == "qwen2.5" or not path.is_dir():
        return str(tokenizer)
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode())
        h.update(file.read_bytes())
    return f"sha256:{h.hexdigest()}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _plain(value: Any) -> Any:
    """JSON-comparable form (tuples become lists), so a fingerprint read back compares equal."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


# -- the decision -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumeDecision:
    """resume: continue from the checkpoint; otherwise start fresh. message: the log line."""

    resume: bool
    message: str


def decide(current: RunFingerprint, saved: RunFingerprint | None, saved_step: int | None, *,
           fresh: bool = False, lr_at=None, unreadable: str | None = None) -> ResumeDecision:
    """Whether the checkpoint at `saved_step` (None: there is none) of run `saved` may be resumed.

    saved None with a checkpoint: it records no fingerprint (older format), or `unreadable` says
    why its record cannot be read. lr_at(step, total_steps) -> learning rate (for the log line
    when only train.steps changed).
    """
    run = current.run_id
    if saved_step is None:
        return ResumeDecision(False, f"starting run {run} ({current.steps} steps)")
    if fresh:
        return ResumeDecision(False, f"--fresh: starting run {run} afresh")
    if saved is None:
        why = unreadable or "is of an older format (no run fingerprint)"
        return ResumeDecision(False, f"the checkpoint at step {saved_step} {why}; starting run {run} afresh")
    differing = current.differences(saved)
    if differing:
        shown = ", ".join(_describe_change(k, saved.fields.get(k), current.fields.get(k)) for k in differing[:4])
        more = f" and {len(differing) - 4} more" if len(differing) > 4 else ""
        return ResumeDecision(False, f"the checkpoint at step {saved_step} is from run {saved.run_id}, which "
                                     f"differs in {shown}{more}; starting run {run} afresh")
    if saved_step > current.steps:
        return ResumeDecision(False, f"train.steps is {current.steps} but the checkpoint of run {run} is at step "
                                     f"{saved_step}; starting afresh")
    if saved.steps != current.steps:
        lr = ""
        if lr_at is not None and saved_step < current.steps:
            lr = (f"; the LR schedule now spans {current.steps} steps: the lr of step {saved_step + 1} is "
                  f"{lr_at(saved_step, current.steps):.3g} (was {lr_at(saved_step, saved.steps):.3g} on the "
                  f"{saved.steps}-step schedule)")
        return ResumeDecision(True, f"train.steps {saved.steps} -> {current.steps}: resuming run {run} at step "
                                    f"{saved_step}{lr}")
    if saved_step == current.steps:
        return ResumeDecision(True, f"run {run} is already complete at step {saved_step}; republishing its "
                                    "results (dflop train --fresh trains again)")
    return ResumeDecision(True, f"resuming run {run} at step {saved_step}")


def _describe_change(key: str, old: Any, new: Any) -> str:
    def short(value: Any) -> str:
        text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
        if "sha256:" in text:
            return text[:text.index("sha256:") + 15] + "..."
        return text if len(text) <= 60 else text[:57] + "..."

    return f"{key} ({short(old)} -> {short(new)})"


def move_aside(ckpt_dir: str | Path, saved: RunFingerprint | None) -> Path | None:
    """Rename the checkpoint directory into ``previous_runs/<run id>-<UTC time>`` beside it (nothing
    is deleted); returns the new path, or None when there was nothing to move."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = f"{saved.run_id if saved is not None else 'unknown'}-{stamp}"
    target = ckpt_dir.parent / PREVIOUS_RUNS_DIR / name
    n = 1
    while target.exists():
        n += 1
        target = ckpt_dir.parent / PREVIOUS_RUNS_DIR / f"{name}-{n}"
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        ckpt_dir.rename(target)
    except OSError as exc:
        raise UserError(f"cannot move the old checkpoints {ckpt_dir} aside to {target}: {exc.strerror or exc}") from None
    return target


def prepare_checkpoints(ckpt_dir: str | Path, current: RunFingerprint, *, fresh: bool = False,
                        lr_at=None) -> ResumeDecision:
    """Rank 0, before resuming: decide about the newest checkpoint under `ckpt_dir` and, when the
    run starts afresh, move the old checkpoints aside. Returns the decision (its message says
    where they went)."""
    from dflop.runtime.checkpoint import FORMAT_VERSION, TRAIN_STATE_FILE, latest_run_record

    record = latest_run_record(ckpt_dir)
    saved_step, saved, unreadable = None, None, None
    if record is not None:
        saved_step, state = record
        if state is None:
            unreadable = f"has an unreadable {TRAIN_STATE_FILE}"
        elif state.get("format") == FORMAT_VERSION:
            saved = RunFingerprint.from_json(state.get("run"))
    decision = decide(current, saved, saved_step, fresh=fresh, lr_at=lr_at, unreadable=unreadable)
    if not decision.resume and record is not None:
        moved = move_aside(ckpt_dir, saved)
        decision = ResumeDecision(False, f"{decision.message}; the old checkpoints are in {moved}")
    return decision
