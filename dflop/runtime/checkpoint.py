"""Atomic, resumable training checkpoints: torch.distributed.checkpoint (DCP) with torch's
state_dict API, non-tensor state as JSON beside it.

Every rank calls `save_checkpoint` / `load_latest` with its `TrainState`. Its Stateful parts
(`dflop.runtime.checkpoint_parts`: the model and optimizer keyed by global parameter name, the LR
scheduler, the RNG states) are saved together: their tensors by one ``dcp.save`` (DCP writes a
tensor held by several data-parallel replicas once, a DTensor shard as its chunk of the global
tensor), their other values as JSON, so nothing is pickled. One directory per step:

    <ckpt_root>/step_000123/
        .metadata, __<rank>_0.distcp   DCP: "model.<name>", "optimizer.state.<name>.<key>"
        rank_00000.json, ...           per rank: each part's non-tensor values (RNG states, the LR
                                       scheduler, "param_groups.<name>.<setting>" of the optimizer)
        train_state.json               rank 0: format, step, world size, data seed, run fingerprint,
                                       "extra": the trainer's own state (its Stateful state_dict:
                                       skipped samples, the scheduler's adaptive correction)
        COMPLETE                       written last by rank 0

All ranks write into ``step_000123.tmp/``; after a barrier rank 0 writes COMPLETE and renames the
directory, so a run killed mid-save leaves only a ``.tmp`` directory (or a directory without the
marker), which `load_latest` ignores: the run resumes from the previous checkpoint.

A vision stage whose TP degree does not divide its heads holds zero heads
(`dflop.models.tensor_parallel`): its attention tensors are saved padded, at the padded model's
global shape (also by `read_checkpoint_model`). A resume runs the same plan (the run fingerprint
holds it), hence the same padding; `dflop.runtime.export` cuts the padding off.

Loading reads tensors with ``torch.load(weights_only=True)`` (DCP's reader) and DCP's metadata
file with a restricted unpickler (`dflop.runtime.safe_dcp`). Works with gloo (CPU), NCCL (GPU),
and in one process without a process group. Resuming needs the world size that saved.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from dflop.errors import UserError
from dflop.io import replace_dir
from dflop.runtime.checkpoint_parts import ModelState, OptimizerState, RNGState
from dflop.runtime.param_names import RankParameters, global_name_module
from dflop.runtime.process_group import barrier, broadcast_int, global_rank, is_distributed, world_size
from dflop.runtime.safe_dcp import SafeFileSystemReader, TensorOnlyLoadPlanner

FORMAT_VERSION = 3  # 3: torch's state_dict API, flattened optimizer state; 2: run fingerprint in train_state.json
COMPLETE_MARKER = "COMPLETE"
TRAIN_STATE_FILE = "train_state.json"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


@dataclass
class TrainState:
    """What one rank checkpoints; `load_latest` restores it in place.

    data_seed: seed of the global-batch order; with the step it is the data position.
    extra: JSON-able state beyond the model, rank 0's saved as train_state.json's "extra" and
        given back to every rank on load: a dict (restored in place) or a Stateful whose
        state_dict() is JSON (the trainer: `dflop.runtime.trainer.Trainer.state_dict`).
    run: the run's fingerprint (`RunFingerprint.to_json`), saved by rank 0; a re-run reads it with
        `latest_run_record` to decide whether it may resume.
    RNG states (python, numpy, torch CPU, CUDA) are saved and restored per rank automatically.
    """

    params: RankParameters
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    data_seed: int = 0
    extra: dict[str, Any] | Stateful = field(default_factory=dict)
    run: dict[str, Any] | None = None

    def parts(self) -> dict[str, Stateful]:
        """The rank's Stateful parts by name (a part's name prefixes its DCP keys); RNG last, so a
        load restores it after everything else has run."""
        module = global_name_module(self.params.tensors)
        parts: dict[str, Stateful] = {"model": ModelState(module)}
        if self.optimizer is not None:
            parts["optimizer"] = OptimizerState(module, self.optimizer)
        if self.lr_scheduler is not None:
            parts["lr_scheduler"] = self.lr_scheduler
        parts["rng"] = RNGState()
        return parts


# --------------------------------------------------------------------------------------------------
# Where checkpoints are
# --------------------------------------------------------------------------------------------------

def step_dir(ckpt_root: str | Path, step: int) -> Path:
    """Directory of the checkpoint after `step` optimizer steps."""
    return Path(ckpt_root) / f"step_{step:06d}"


def complete_checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under `ckpt_root`, oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    found = complete_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def latest_run_record(ckpt_root: str | Path) -> tuple[int, dict | None] | None:
    """(step, its train_state.json, or None when that cannot be read) of the newest complete
    checkpoint, or None when there is none. Reads one small JSON file; no process group needed.
    The record's ``run`` entry is the fingerprint of the run that wrote it (format >= 2)."""
    latest = latest_checkpoint(ckpt_root)
    if latest is None:
        return None
    step = int(_STEP_DIR.match(latest.name).group(1))
    try:
        train_state = json.loads((latest / TRAIN_STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return step, None
    return step, train_state if isinstance(train_state, dict) else None


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------

def save_checkpoint(ckpt_root: str | Path, step: int, state: TrainState, *, keep: int = 2) -> Path:
    """Write the checkpoint after `step` optimizer steps (collective: every rank calls it) and keep
    the newest `keep` complete checkpoints. Returns the checkpoint directory.

    Returns only once the checkpoint is complete on disk (final barrier)."""
    if keep < 1:
        raise UserError(f"checkpoint keep must be at least 1, got {keep}")
    if step < 0:
        raise UserError(f"checkpoint step must be >= 0, got {step}")
    rank, world = global_rank(), world_size()
    parts = state.parts()  # refuses an optimizer over other parameters before anything is written
    final = step_dir(ckpt_root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        for pattern in ("step_*.tmp", "step_*.old"):  # left by a run killed mid-save
            for stale in final.parent.glob(pattern):
                shutil.rmtree(stale)
        tmp.mkdir()
    barrier()

    tensors, plain = {}, {}
    for name, part in parts.items():
        part_tensors, plain[name] = _split(part.state_dict())
        tensors.update({f"{name}.{key}": value for key, value in part_tensors.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP warns about every single-process save
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=not is_distributed())
    _write_json(tmp / f"rank_{rank:05d}.json", {"rank": rank, "world_size": world, **plain})
    if rank == 0:
        _write_json(tmp / TRAIN_STATE_FILE, {"format": FORMAT_VERSION, "step": step, "world_size": world,
                                             "data_seed": state.data_seed, "run": state.run,
                                             "extra": _extra_state(state.extra)})
    barrier()

    if rank == 0:
        _write_json(tmp / COMPLETE_MARKER, {"step": step})
        replace_dir(tmp, final)  # also when the same step is saved again (a re-run that did no new step)
        _fsync_dir(final.parent)
        others = [path for s, path in complete_checkpoints(ckpt_root) if s != step]
        for older in others[:max(0, len(others) + 1 - keep)]:  # oldest first; never the one just written
            shutil.rmtree(older)
    barrier()
    return final


def _split(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A part's state_dict -> (its tensors, for DCP; its other values, for JSON). DCP would pickle
    the other values into its files; JSON cannot run code when read."""
    tensors = {key: value for key, value in state_dict.items() if isinstance(value, torch.Tensor)}
    return tensors, {key: value for key, value in state_dict.items() if key not in tensors}


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------

def load_latest(ckpt_root: str | Path, state: TrainState) -> int | None:
    """Restore `state` from the newest complete checkpoint (collective: every rank calls it).

    Returns the restored step (optimizer steps done = index of the next global batch), or None
    when `ckpt_root` holds no complete checkpoint (then `state` is untouched).
    """
    latest = latest_checkpoint(ckpt_root) if global_rank() == 0 else None
    step = broadcast_int(-1 if latest is None else int(_STEP_DIR.match(latest.name).group(1)))
    if step < 0:
        return None
    load_checkpoint(step_dir(ckpt_root, step), state)
    return step


def load_checkpoint(path: str | Path, state: TrainState) -> int:
    """Restore `state` from one complete checkpoint directory; returns its step."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        raise UserError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker)")
    rank, world = global_rank(), world_size()
    train_state = _read_json(path / TRAIN_STATE_FILE, ("format", "step", "world_size", "data_seed", "extra"))
    fmt = train_state["format"]
    if fmt != FORMAT_VERSION:
        older = "an older" if isinstance(fmt, int) and fmt < FORMAT_VERSION else "another"
        raise UserError(f"checkpoint {path} is of {older} format ({fmt!r}; this dflop reads format {FORMAT_VERSION}): "
                        "it cannot be resumed, train afresh")
    if train_state["world_size"] != world:
        raise UserError(f"checkpoint {path} was written by {train_state['world_size']} ranks; this run has {world} "
                        "(resume with the same world size)")
    per_rank = _read_json(path / f"rank_{rank:05d}.json", ("rng",))
    saved_tensors = set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)

    parts = state.parts()
    templates: dict[str, dict[str, Any]] = {}
    wanted: dict[str, torch.Tensor] = {}
    for name, part in parts.items():
        if not isinstance(per_rank.get(name), dict):
            raise UserError(f"checkpoint {path} has no {name} state for rank {rank}")
        prefix = f"{name}."
        saved = {key[len(prefix):] for key in saved_tensors if key.startswith(prefix)} | set(per_rank[name])
        to_load = getattr(part, "state_dict_to_load", None)  # else, as DCP does, its state_dict()
        templates[name] = to_load(saved) if to_load is not None else part.state_dict()
        part_tensors, _ = _split(templates[name])
        wanted.update({prefix + key: value for key, value in part_tensors.items()})
    missing = [key for key in wanted if key not in saved_tensors]
    if missing:
        raise UserError(f"checkpoint {path} has no tensor {missing[0]!r}" +
                        (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") +
                        "; was it written for a different model?")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(wanted, storage_reader=SafeFileSystemReader(path), planner=TensorOnlyLoadPlanner(),
                 no_dist=not is_distributed())  # in place: the templates' tensors
    for name, part in parts.items():
        part.load_state_dict(_with_plain(templates[name], per_rank[name]))
    state.data_seed = int(train_state["data_seed"])
    if isinstance(state.extra, Stateful):
        state.extra.load_state_dict(train_state["extra"])
    else:
        state.extra.clear()
        state.extra.update(train_state["extra"])
    return int(train_state["step"])


def _extra_state(extra: dict[str, Any] | Stateful) -> dict[str, Any]:
    """`TrainState.extra` as the JSON object train_state.json holds."""
    return extra.state_dict() if isinstance(extra, Stateful) else extra


def _with_plain(template: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """`template` with its non-tensor values replaced by the saved JSON ones (a tuple stays a
    tuple: JSON has only lists). Values the part does not have now are dropped."""
    out = dict(template)
    for key, value in saved.items():
        if key in out and not isinstance(out[key], torch.Tensor):
            out[key] = tuple(value) if isinstance(out[key], tuple) and isinstance(value, list) else value
    return out


def read_checkpoint_model(path: str | Path) -> dict[str, torch.Tensor]:
    """Full model tensors (global name -> whole tensor, shards assembled) of a checkpoint, read in one
    process without a process group, e.g. to compare the final weights of two runs."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        raise UserError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker)")
    metadata = SafeFileSystemReader(path).read_metadata()
    out = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            out[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=SafeFileSystemReader(path), planner=TensorOnlyLoadPlanner(), no_dist=True)
    return {key.removeprefix("model."): tensor for key, tensor in out.items()}


# --------------------------------------------------------------------------------------------------
# JSON files
# --------------------------------------------------------------------------------------------------

def _write_json(path: Path, data: Any) -> None:
    try:
        text = json.dumps(data)
    except TypeError as exc:
        raise UserError(f"checkpoint: cannot write {path.name} as JSON: {exc}") from None
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: Path, required: tuple[str, ...]) -> dict:
    """A JSON object with (at least) the `required` keys."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"checkpoint file {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"checkpoint file {path} is not valid JSON: {exc}") from None
    missing = [key for key in required if not isinstance(data, dict) or key not in data]
    if missing:
        raise UserError(f"checkpoint file {path} has no {missing[0]!r} entry")
    return data


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
