"""The Stateful parts of a checkpoint (torch.distributed.checkpoint.stateful.Stateful): the model
and the optimizer through torch's state_dict API, keyed by global parameter name; the RNG states.

`ModelState` and `OptimizerState` read names from `global_name_module` (the rank's parameters
under their Hugging Face names), so ``get_model_state_dict`` / ``get_optimizer_state_dict`` key
every tensor by the full model's name whichever stage, tensor-parallel shard (DTensor) or replica
holds it, and ``set_*_state_dict`` load it back by name. The same API handles FSDP2-sharded
parameters, which sharded optimizer state will need. The optimizer state is flattened
(``flatten_optimizer_state_dict``): ``state.<name>.<key>`` (AdamW's exp_avg, exp_avg_sq, step) and
``param_groups.<name>.<setting>`` (lr, betas, ...), per parameter, so the stages' optimizers never
collide and their parameter groups need not match.

Values of a part's state_dict are tensors (saved by DCP) or JSON values (saved beside it, never
pickled): `dflop.runtime.checkpoint` splits them.
"""

from __future__ import annotations

import base64
import bisect
import random
from typing import Any, Collection

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from dflop.errors import UserError, first_line

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelState(Stateful):
    """The rank's parameters (`global_name_module`): global name -> tensor (DTensors as they are)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state_dict)


class OptimizerState(Stateful):
    """One optimizer over (some of) the parameters of `module`, flattened by global name.

    Parameters that have never been stepped (no gradient yet) have no optimizer state, and keep
    none across a checkpoint: AdamW counts steps per parameter, so giving one zero state would
    change its first real update. torch's API creates the state of an optimizer that has none at
    all by one step with LR 0 (``_init_optim_state``), which AdamW would count; an empty entry per
    parameter ("no state yet", as every torch optimizer reads it) keeps a save from doing that.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer):
        self.module = module
        self.optimizer = optimizer
        name_of = {id(p): name for name, p in module.named_parameters()}
        self.names: dict[str, torch.Tensor] = {}  # global name -> parameter, in optimizer order
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if id(param) not in name_of:
                    raise UserError(f"optimizer parameter {i} of group {g} (shape {list(param.shape)}) is not "
                                    "among this rank's parameters (rank_parameters)")
                self.names[name_of[id(param)]] = param

    def state_dict(self) -> dict[str, Any]:
        if not self.optimizer.state:
            for param in self.names.values():
                self.optimizer.state[param] = {}
        return get_optimizer_state_dict(self.module, self.optimizer, options=_FLAT)

    def state_dict_to_load(self, saved: Collection[str]) -> dict[str, Any]:
        """The state_dict a load fills in place, given the keys the checkpoint holds (`saved`).

        The optimizer's own state where every parameter has some; otherwise (a restarted process)
        the library's: on a cleared optimizer without gradients its zero-LR step creates every
        parameter's state with the right dtypes, devices and DTensor placements. Parameters the
        checkpoint has no state for are left out (they had never been stepped)."""
        if not all(self.optimizer.state.get(p) for p in self.names.values()):
            self.optimizer.state.clear()
        grads = {p: p.grad for p in self.names.values()}  # any gradient would stop the library's step
        for param in grads:
            param.grad = None
        try:
            template = get_optimizer_state_dict(self.module, self.optimizer, options=_FLAT)
        finally:
            for param, grad in grads.items():
                param.grad = grad
        never_stepped = tuple(f"state.{name}." for name in self._without_state(saved))
        return {key: value for key, value in template.items() if not key.startswith(never_stepped)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name in self._without_state(state_dict):
            self.optimizer.state[self.names[name]] = {}
        try:
            set_optimizer_state_dict(self.module, self.optimizer, state_dict, options=_FLAT)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise UserError(f"the checkpoint's optimizer state does not fit this optimizer: {first_line(exc)}") from None

    def _without_state(self, keys: Collection[str]) -> list[str]:
        """Names of this optimizer's parameters with no ``state.<name>.*`` entry among `keys`."""
        ordered = sorted(keys)
        out = []
        for name in self.names:
            prefix = f"state.{name}."
            at = bisect.bisect_left(ordered, prefix)
            if at == len(ordered) or not ordered[at].startswith(prefix):
                out.append(name)
        return out


class RNGState(Stateful):
    """This rank's random generators (python, numpy, torch CPU, and its own CUDA device's), as JSON
    values (torch states as base64 bytes).

    CUDA: only the rank's current device, saved as a list of one state. Asking every visible device
    (``get_rng_state_all``) would create a CUDA context on each (memory on every GPU of the node,
    per rank), and restoring them all would set other ranks' devices. A checkpoint written before
    held every visible device's state: the one at this rank's device index is restored."""

    def state_dict(self) -> dict[str, Any]:
        version, mt_state, gauss = random.getstate()
        np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
        cuda = ([_b64(torch.cuda.get_rng_state(torch.cuda.current_device()))]
                if torch.cuda.is_available() and torch.cuda.is_initialized() else [])
        return {
            "python": [version, list(mt_state), gauss],
            "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
            "torch": _b64(torch.get_rng_state()),
            "cuda": cuda,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        version, mt_state, gauss = state_dict["python"]
        random.setstate((version, tuple(mt_state), gauss))
        np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state_dict["numpy"]
        np.random.set_state((np_kind, np.asarray(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))
        torch.set_rng_state(_unb64(state_dict["torch"]))
        cuda = state_dict["cuda"]
        if cuda and torch.cuda.is_available():
            device = torch.cuda.current_device()
            if len(cuda) == 1:
                torch.cuda.set_rng_state(_unb64(cuda[0]), device)
            elif len(cuda) == torch.cuda.device_count():  # an older checkpoint: every visible device
                torch.cuda.set_rng_state(_unb64(cuda[device]), device)
            else:
                raise UserError(f"checkpoint RNG state is for {len(cuda)} CUDA devices; "
                                f"this rank sees {torch.cuda.device_count()}")


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
