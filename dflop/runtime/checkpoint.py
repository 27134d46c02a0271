"""Atomic, resumable training checkpoints with torch.distributed.checkpoint (DCP).

Every rank calls `save_checkpoint` / `load_latest` with its `TrainState`. Parameters and optimizer
tensors are stored under the full model's global parameter names (the Hugging Face names), so
pipeline stages never collide; DCP writes a tensor held by several data-parallel replicas once, and
a tensor-parallel shard (a DTensor) as its chunk of the global tensor. Checkpoint layout, one directory per step:

    <ckpt_root>/step_000123/
        .metadata, __<rank>_0.distcp   DCP: "model.<name>" and "optim.<name>.<key>" tensors
        rank_00000.json, ...           per rank: RNG states, optimizer hyper-parameters, LR scheduler
        train_state.json               rank 0: step, world size, data seed, run fingerprint, extra JSON state
        COMPLETE                       written last by rank 0

All ranks write into ``step_000123.tmp/``; after a barrier rank 0 writes COMPLETE and renames the
directory, so a run killed mid-save leaves only a ``.tmp`` directory (or a directory without the
marker), which `load_latest` ignores: the run resumes from the previous checkpoint.

Nothing is unpickled freely: DCP tensor files are read with ``torch.load(weights_only=True)``,
DCP's metadata file with an unpickler that only builds DCP's own metadata classes
(`dflop.runtime.safe_dcp`), and every non-tensor state is JSON. Works with gloo (CPU), NCCL (GPU), and in one process without a process
group.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from dflop.errors import UserError
from dflop.io import replace_dir
from dflop.runtime.param_names import RankParameters
from dflop.runtime.process_group import (
    barrier,
    broadcast_int,
    global_rank,
    is_distributed,
    world_size,
)
from dflop.runtime.safe_dcp import SafeFileSystemReader, TensorOnlyLoadPlanner

FORMAT_VERSION = 2  # 2: train_state.json records the run fingerprint (dflop.runtime.run_identity)
COMPLETE_MARKER = "COMPLETE"
TRAIN_STATE_FILE = "train_state.json"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


# --------------------------------------------------------------------------------------------------
# Training state
# --------------------------------------------------------------------------------------------------

@dataclass
class TrainState:
    """What one rank checkpoints; `load_latest` restores it in place.

    data_seed: seed of the global-batch order; with the step it is the data position.
    extra: JSON-able state beyond the model (e.g. the scheduler's adaptive correction); rank 0's
        copy is saved and every rank gets it back on load.
    run: the run's fingerprint (`RunFingerprint.to_json`), saved by rank 0; a re-run reads it with
        `latest_run_record` to decide whether it may resume.
    RNG states (python, numpy, torch CPU, CUDA) are saved and restored per rank automatically.
    """

    params: RankParameters
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    data_seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] | None = None


# --------------------------------------------------------------------------------------------------
# Public API
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


def save_checkpoint(ckpt_root: str | Path, step: int, state: TrainState, *, keep: int = 2) -> Path:
    """Write the checkpoint after `step` optimizer steps (collective: every rank calls it) and keep
    the newest `keep` complete checkpoints. Returns the checkpoint directory.

    Returns only once the checkpoint is complete on disk (final barrier)."""
    if keep < 1:
        raise UserError(f"checkpoint keep must be at least 1, got {keep}")
    if step < 0:
        raise UserError(f"checkpoint step must be >= 0, got {step}")
    rank, world = global_rank(), world_size()
    final = step_dir(ckpt_root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        for pattern in ("step_*.tmp", "step_*.old"):  # left by a run killed mid-save
            for stale in final.parent.glob(pattern):
                shutil.rmtree(stale)
        tmp.mkdir()
    barrier()

    tensors = _tensor_state(state, _name_of_params(state))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP warns about every single-process save
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=not is_distributed())
    _write_json(tmp / f"rank_{rank:05d}.json", _rank_json(state, rank, world))
    if rank == 0:
        _write_json(tmp / TRAIN_STATE_FILE, {"format": FORMAT_VERSION, "step": step, "world_size": world,
                                             "data_seed": state.data_seed, "run": state.run, "extra": state.extra})
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
    if train_state["format"] != FORMAT_VERSION:
        raise UserError(f"checkpoint {path}: format {train_state['format']!r}, expected {FORMAT_VERSION}")
    if train_state["world_size"] != world:
        raise UserError(f"checkpoint {path} was written by {train_state['world_size']} ranks; this run has {world} "
                        "(resume with the same world size)")
    per_rank = _read_json(path / f"rank_{rank:05d}.json", ("rng",))
    metadata = SafeFileSystemReader(path).read_metadata()
    name_of = _name_of_params(state)

    wanted = _model_tensors(state)
    optimizer_targets = _optimizer_targets(state, name_of, metadata)
    for param_targets in optimizer_targets.values():
        wanted.update(param_targets)
    missing = [key for key in wanted if key not in metadata.state_dict_metadata]
    if missing:
        raise UserError(f"checkpoint {path} has no tensor {missing[0]!r}" +
                        (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") +
                        "; was it written for a different model?")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(wanted, storage_reader=SafeFileSystemReader(path), planner=TensorOnlyLoadPlanner(),
                 no_dist=not is_distributed())
    _copy_back(state, wanted)
    _restore_optimizer(state, per_rank.get("optimizer"), optimizer_targets, path)
    if state.lr_scheduler is not None:
        if per_rank.get("lr_scheduler") is None:
            raise UserError(f"checkpoint {path} has no LR scheduler state for rank {rank}")
        state.lr_scheduler.load_state_dict(per_rank["lr_scheduler"])
    _set_rng_state(per_rank["rng"])
    state.data_seed = int(train_state["data_seed"])
    state.extra.clear()
    state.extra.update(train_state["extra"])
    return int(train_state["step"])


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
# Tensors: what DCP writes and reads
# --------------------------------------------------------------------------------------------------

def _name_of_params(state: TrainState) -> dict[int, str]:
    """id(parameter) -> global name, checking that the optimizer only holds this rank's parameters."""
    name_of = {id(t): name for name, t in state.params.tensors.items()}
    if state.optimizer is not None:
        for g, group in enumerate(state.optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if id(param) not in name_of:
                    raise UserError(f"optimizer parameter {i} of group {g} (shape {list(param.shape)}) is not "
                                    "among this rank's parameters (rank_parameters)")
    return name_of


def _model_tensors(state: TrainState) -> dict[str, torch.Tensor]:
    """Flat DCP state of the parameters: "model.<name>" -> tensor (DTensors as they are)."""
    return {f"model.{name}": t.detach() for name, t in state.params.tensors.items()}


def _tensor_state(state: TrainState, name_of: dict[int, str]) -> dict[str, torch.Tensor]:
    """Flat DCP state: "model.<name>" and "optim.<name>.<key>" (optimizer tensors shaped like their
    parameter are DTensors like it; scalars such as Adam's step are whole)."""
    out = _model_tensors(state)
    if state.optimizer is not None:
        for group in state.optimizer.param_groups:
            for param in group["params"]:
                name = name_of[id(param)]
                for key, value in state.optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"optim.{name}.{key}"] = value.detach()
    return out


def _optimizer_targets(state: TrainState, name_of: dict[int, str],
                       metadata: Metadata) -> dict[int, dict[str, torch.Tensor]]:
    """id(param) -> {"optim.<name>.<key>": tensor to load into}, for every optimizer tensor the
    checkpoint holds: existing state tensors where shapes fit, else new ones (a fresh optimizer)."""
    if state.optimizer is None:
        return {}
    saved_keys: dict[str, list[tuple[str, TensorStorageMetadata]]] = {}  # name -> [(state key, meta)]
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("optim.") and isinstance(meta, TensorStorageMetadata):
            name, _, state_key = key.removeprefix("optim.").rpartition(".")
            saved_keys.setdefault(name, []).append((state_key, meta))
    targets = {}
    for group in state.optimizer.param_groups:
        on_param_device = bool(group.get("capturable") or group.get("fused"))
        for param in group["params"]:
            name = name_of[id(param)]
            current = state.optimizer.state.get(param, {})
            entries = {}
            for state_key, meta in saved_keys.get(name, []):
                like_param = tuple(meta.size) == tuple(param.shape)  # a DTensor reports its global shape
                want_shape = tuple(param.shape) if like_param else tuple(meta.size)
                existing = current.get(state_key)
                if (isinstance(existing, torch.Tensor) and tuple(existing.shape) == want_shape
                        and existing.dtype == meta.properties.dtype):
                    local = existing
                elif like_param:
                    local = torch.empty_like(param, dtype=meta.properties.dtype)
                else:
                    device = param.device if on_param_device else torch.device("cpu")
                    local = torch.empty(meta.size, dtype=meta.properties.dtype, device=device)
                entries[f"optim.{name}.{state_key}"] = local
            targets[id(param)] = entries
    return targets


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copy_back(state: TrainState, loaded: dict[str, torch.Tensor]) -> None:
    """DCP loads in place into detached views of the parameters; copy in case it did not."""
    with torch.no_grad():
        for name, tensor in state.params.tensors.items():
            value, target = _local(loaded[f"model.{name}"]), _local(tensor)
            if value.data_ptr() != target.data_ptr():
                target.copy_(value)


def _restore_optimizer(state: TrainState, saved: dict | None, targets: dict[int, dict[str, torch.Tensor]],
                       path: Path) -> None:
    if state.optimizer is None:
        return
    if saved is None:
        raise UserError(f"checkpoint {path} has no optimizer state for rank {global_rank()}")
    groups = state.optimizer.param_groups
    name_of = {id(t): name for name, t in state.params.tensors.items()}
    if len(saved["param_groups"]) != len(groups):
        raise UserError(f"checkpoint {path}: rank {global_rank()} saved {len(saved['param_groups'])} optimizer groups, "
                        f"the optimizer has {len(groups)}")
    for g, (group, saved_group) in enumerate(zip(groups, saved["param_groups"])):
        names = [name_of[id(p)] for p in group["params"]]
        if names != saved_group["params"]:
            raise UserError(f"checkpoint {path}: optimizer group {g} of rank {global_rank()} holds other parameters "
                            "than the checkpoint's")
        for key, value in saved_group.items():
            if key == "params":
                continue
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            elif isinstance(current, tuple):
                group[key] = tuple(value)
            else:
                group[key] = value
    state.optimizer.state.clear()
    for group in groups:
        for param in group["params"]:
            name = name_of[id(param)]
            entries = {}
            for key, value in targets.get(id(param), {}).items():
                if isinstance(value, DTensor) and not isinstance(param, DTensor):
                    value = value.to_local()
                entries[key[len(f"optim.{name}."):]] = value
            entries.update(saved["non_tensor_state"].get(name, {}))
            if entries:
                state.optimizer.state[param] = entries


# --------------------------------------------------------------------------------------------------
# JSON state: per rank (RNG, optimizer hyper-parameters, LR scheduler)
# --------------------------------------------------------------------------------------------------

def _rank_json(state: TrainState, rank: int, world: int) -> dict:
    out: dict[str, Any] = {"rank": rank, "world_size": world, "rng": _rng_state()}
    if state.optimizer is not None:
        name_of = {id(t): name for name, t in state.params.tensors.items()}
        groups = []
        for group in state.optimizer.param_groups:
            hyper = {key: _plain(value) for key, value in group.items() if key != "params"}
            hyper["params"] = [name_of[id(p)] for p in group["params"]]
            groups.append(hyper)
        non_tensor = {}
        for param, values in state.optimizer.state.items():
            plain = {key: value for key, value in values.items() if not isinstance(value, torch.Tensor)}
            if plain:
                non_tensor[name_of[id(param)]] = plain
        out["optimizer"] = {"param_groups": groups, "non_tensor_state": non_tensor}
    if state.lr_scheduler is not None:
        out["lr_scheduler"] = {key: _plain(value) for key, value in state.lr_scheduler.state_dict().items()}
    return out


def _plain(value: Any) -> Any:
    """JSON form of an optimizer / scheduler setting (tensors become numbers, tuples lists)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _rng_state() -> dict:
    """This rank's random generator states, JSON-able (torch states as base64 bytes)."""
    version, mt_state, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)

    def b64(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode("ascii")

    cuda = [b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {
        "python": [version, list(mt_state), gauss],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": b64(torch.get_rng_state()),
        "cuda": cuda,
    }


def _set_rng_state(saved: dict) -> None:
    version, mt_state, gauss = saved["python"]
    random.setstate((version, tuple(mt_state), gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = saved["numpy"]
    np.random.set_state((np_kind, np.asarray(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))

    def unb64(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(unb64(saved["torch"]))
    if saved["cuda"] and torch.cuda.is_available():
        if len(saved["cuda"]) != torch.cuda.device_count():
            raise UserError(f"checkpoint RNG state is for {len(saved['cuda'])} CUDA devices; "
                            f"this rank sees {torch.cuda.device_count()}")
        torch.cuda.set_rng_state_all([unb64(s) for s in saved["cuda"]])


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
