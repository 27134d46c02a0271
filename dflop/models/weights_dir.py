"""A local Hugging Face weights directory, read tensor by tensor: only the tensors a rank keeps.

Each ``*.safetensors`` file's header names its tensors; a tensor is read with ``safe_open`` from
its file alone, so a rank holding two of 28 layers reads those and nothing else. Checkpoint keys
are renamed to the model's parameter names by transformers' own conversion mapping (what
``from_pretrained`` applies: transformers 5 saves the legacy ``language_model.model.*`` keys). A
key that needs more than a renaming (a fused or split tensor) is refused. Pickled checkpoints are
never read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from dflop.errors import UserError

INDEX_FILE = "model.safetensors.index.json"


class WeightsDirectory:
    """Where each tensor of `model` lies in the directory `path` (see module docstring).

    model: the model the directory holds, on the meta device (its names and the conversion mapping).
    """

    def __init__(self, path: str | Path, model: PreTrainedModel):
        self.path = Path(path)
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise UserError(f"model.weights: {self.path} has no *.safetensors files "
                            f"(pickled checkpoints are not loaded)")
        transforms = get_model_conversion_mapping(model)
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._prefix = model.base_model_prefix
        self._names = {name: True for name in model.state_dict(keep_vars=True)}  # what the renaming checks
        self.where: dict[str, tuple[Path, str]] = {}  # model name -> (file, checkpoint key)
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    self.where.setdefault(self._model_name(key, file), (file, key))
        self._indexed = self._index()

    def _model_name(self, key: str, file: Path) -> str:
        name, converter = rename_source_key(key, self._renamings, self._converters, self._prefix, self._names)
        if converter is not None:
            raise UserError(f"model.weights: {file.name}: tensor {key} needs transformers' weight conversion "
                            f"{converter!r}, which is not supported")
        return name

    def _index(self) -> dict[str, str]:
        """Model name -> the file the directory's index names for it (none without an index)."""
        index = self.path / INDEX_FILE
        if not index.is_file():
            return {}
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {self._model_name(key, index): file for key, file in weight_map.items()}

    def check_holds(self, names: Iterable[str]) -> None:
        """Raise a one-line UserError naming the first of `names` the directory does not hold."""
        for name in sorted(names):
            if name in self.where:
                continue
            if name in self._indexed:
                raise UserError(f"model.weights: tensor {name} is missing from {self.path / self._indexed[name]} "
                                f"(where {INDEX_FILE} puts it)")
            files = ", ".join(f.name for f in self.files[:3]) + (", ..." if len(self.files) > 3 else "")
            raise UserError(f"model.weights: no file of {self.path} holds tensor {name} (read {files})")

    def read(self, like: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, CPU tensor) for each name of `like` (a tensor of the shape and dtype wanted, meta
        is fine), read file by file and cast to its `like` dtype, one at a time (the caller moves
        each to its device before the next is read). The directory must hold them all."""
        self.check_holds(like)
        by_file: dict[Path, list[str]] = {}
        for name in like:
            by_file.setdefault(self.where[name][0], []).append(name)
        for file, names in sorted(by_file.items()):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in names:
                    key, want = self.where[name][1], like[name]
                    shape = list(f.get_slice(key).get_shape())
                    if shape != list(want.shape):
                        raise UserError(f"model.weights: {file.name}: tensor {key} has shape {shape}, "
                                        f"the model's {name} {list(want.shape)}")
                    yield name, f.get_tensor(key).to(want.dtype)
