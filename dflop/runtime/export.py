"""Export trained weights as a Hugging Face model directory (config.json + model.safetensors).

Every rank calls `export_hf` with its `RankParameters` (the stage modules it runs, by global name).
Rank 0 learns from a small manifest what each rank holds, then receives each parameter once from the
lowest rank holding it (data-parallel replicas are skipped), a DTensor after ``full_tensor()`` on
its mesh; rank 0 cuts off the zero heads a padded vision tensor holds (checking that they are still
zero), so the export has the real model's shapes. Parameters no pipeline stage runs (never trained)
come from the ranks' own full models. Rank 0 loads them into the transformers model built from the
same config (on the meta device, so no second random init) and calls ``save_pretrained`` into a
temporary directory that is renamed into place, so a reader never sees a half-written export.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import PreTrainedConfig, PreTrainedModel

from dflop.errors import UserError
from dflop.io import replace_dir
from dflop.models.architectures import architecture_of
from dflop.models.builder import resolve_dtype
from dflop.models.tensor_parallel import drop_head_padding
from dflop.progress import library_bars_off_in_logs
from dflop.runtime.param_names import RankParameters, canonical_names
from dflop.runtime.process_group import barrier, collective_device, global_rank, is_distributed


@dataclass(frozen=True)
class HeldTensor:
    """One parameter as one rank holds it, as advertised in the manifest.

    shape: the whole tensor's (a DTensor's global shape: it is sent after ``full_tensor()``).
    gather_ranks: for a DTensor, the ranks of its device mesh, which all take part in
    ``full_tensor()``.
    padding: (dimension, real length) of a tensor holding zero vision heads beyond it (sent padded).
    """

    name: str
    rank: int
    shape: tuple[int, ...]
    dtype: str
    gather_ranks: tuple[int, ...] = ()
    padding: tuple[int, int] | None = None


def manifest(params: RankParameters, rank: int) -> list[HeldTensor]:
    """What this rank holds: its trained parameters, then the untrained ones of its full model."""
    held = []
    for name, tensor in sorted(params.tensors.items()):
        dtype = str(tensor.dtype).removeprefix("torch.")
        mesh_ranks = (tuple(int(r) for r in tensor.device_mesh.mesh.flatten().tolist())
                      if isinstance(tensor, DTensor) else ())
        held.append(HeldTensor(name, rank, tuple(tensor.shape), dtype, mesh_ranks, params.padding.get(name)))
    for name, tensor in sorted(params.untrained.items()):
        if name not in params.tensors:
            held.append(HeldTensor(name, rank, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
    return held


def transfer_plan(manifests: list[list[HeldTensor]], expected: set[str]) -> list[HeldTensor]:
    """Which rank sends each parameter (its lowest holder), by parameter name. Raises UserError
    naming a parameter that no rank holds, or one the model does not have."""
    by_name: dict[str, list[HeldTensor]] = {}
    for entries in manifests:
        for entry in entries:
            by_name.setdefault(entry.name, []).append(entry)
    unknown = sorted(set(by_name) - expected)
    if unknown:
        raise UserError(f"export: parameter {unknown[0]} is not a parameter of the model")
    missing = sorted(expected - set(by_name))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"export: no rank holds parameter {missing[0]}{more}; pass every stage module to rank_parameters")
    return [min(by_name[name], key=lambda e: e.rank) for name in sorted(by_name)]


def export_hf(out_dir: str | Path, params: RankParameters, *, dtype: str | torch.dtype | None = None) -> Path:
    """Write the full model as a Hugging Face directory (collective: every rank calls it).

    out_dir: the directory to create (replaced if it exists); rank 0 writes it.
    params: this rank's parameters (`dflop.runtime.param_names.rank_parameters`).
    dtype: dtype of the saved weights (default: as trained).
    Returns out_dir on every rank, once it is complete.
    """
    rank = global_rank()
    mine = manifest(params, rank)
    if is_distributed():
        manifests: list = [None] * dist.get_world_size()
        dist.all_gather_object(manifests, mine)
    else:
        manifests = [mine]
    expected = set(canonical_names(_meta_model(params.config)).values())
    plan = transfer_plan(manifests, expected)  # the same on every rank, so a bad plan fails everywhere

    weights: dict[str, torch.Tensor] = {}
    for source in plan:
        local = params.tensors.get(source.name, params.untrained.get(source.name))
        if source.gather_ranks and rank in source.gather_ranks:
            local = local.full_tensor()
        if source.rank == rank:
            if rank == 0:
                weights[source.name] = local.detach().cpu()
            else:
                dist.send(local.detach().to(collective_device()).contiguous(), dst=0)
        elif rank == 0:
            buf = torch.empty(source.shape, dtype=getattr(torch, source.dtype), device=collective_device())
            dist.recv(buf, src=source.rank)
            weights[source.name] = buf.cpu()
        if rank == 0 and source.padding is not None:
            weights[source.name] = drop_head_padding(source.name, weights[source.name], *source.padding)
    out = Path(out_dir)
    if rank == 0:
        _write_hf_dir(out, params.config, weights, dtype)
    barrier()
    return out


def _meta_model(config: PreTrainedConfig) -> PreTrainedModel:
    """The transformers model of `config` on the meta device, default (SDPA) attention everywhere,
    so the saved config.json names no dflop-only attention."""
    with torch.device("meta"):
        return architecture_of(config).model_class._from_config(copy.deepcopy(config), attn_implementation="sdpa")


def _write_hf_dir(out: Path, config: PreTrainedConfig, weights: dict[str, torch.Tensor],
                  dtype: str | torch.dtype | None) -> None:
    model = _meta_model(config)
    result = model.load_state_dict(weights, strict=False, assign=True)
    aliases = set(canonical_names(model)) - set(weights)  # tied names (lm_head.weight) follow their tensor
    if set(result.missing_keys) - aliases or result.unexpected_keys:
        raise UserError(f"export: weights do not fit the model: missing {sorted(set(result.missing_keys) - aliases)[:3]}, "
                        f"unexpected {result.unexpected_keys[:3]}")
    model.tie_weights()
    still_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise UserError(f"export: parameter {still_meta[0]} got no weights")
    if dtype is not None:
        model.to(resolve_dtype(dtype))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with library_bars_off_in_logs():
        model.save_pretrained(tmp)
    replace_dir(tmp, out)
