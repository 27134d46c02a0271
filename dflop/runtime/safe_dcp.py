"""Reading torch.distributed.checkpoint (DCP) files without unpickling anything a user could plant.

A checkpoint directory is user-controlled input (copied between machines, shared on clusters).
DCP's own reader does not protect against that in torch 2.13: ``FileSystemReader.read_metadata``
unpickles ``.metadata`` with plain ``pickle.load``, and ``DefaultLoadPlanner.load_bytes`` reads any
non-tensor entry with ``torch.load(weights_only=False)``. Tensor data itself is read with
``torch.load(weights_only=True)``. So: `SafeFileSystemReader` unpickles ``.metadata`` with an
unpickler that builds only DCP's metadata classes, and `TensorOnlyLoadPlanner` refuses every
non-tensor entry (dflop writes none: non-tensor state is JSON beside the DCP files).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from dflop.errors import UserError

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # layout name -> torch.strided etc.
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes, torch dtypes and sizes; refuses any other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == _METADATA_MODULE:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == _METADATA_MODULE:
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with a restricted unpickler for the .metadata file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise UserError(f"checkpoint metadata {path} is missing") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise UserError(f"checkpoint metadata {path} is not DCP metadata: {exc}") from None
        if not isinstance(metadata, Metadata):
            raise UserError(f"checkpoint metadata {path} is not DCP metadata (found {type(metadata).__name__})")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """We never save pickled objects, so never unpickle one from a checkpoint."""

    def load_bytes(self, read_item, value) -> None:
        raise UserError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; refusing to load it")
