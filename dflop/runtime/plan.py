"""plan.yaml: the parallel layout the trainer runs (DESIGN.md §4), loaded into frozen dataclasses.

Keys the trainer reads::

    vision: {tp: 1, pp: 1, dp: 2, layers_per_stage: [2]}
    llm:    {tp: 1, pp: 2, dp: 2, layers_per_stage: [1, 1]}
    placement: disjoint          # or colocated: the vision tower runs on the first LLM stage's ranks
    microbatches: 4
    global_batch_size: 16
    world_size: 6

Other keys the optimizer writes (``predicted``, ``baseline``, solver status, ...) are kept in
``Plan.extra`` and not interpreted here. Ranks: disjoint placement puts the vision ranks first
(tp_v * pp_v * dp_v of them), then the LLM ranks; colocated placement has only the LLM ranks and
needs vision pp = 1 and the LLM's dp and tp. Every problem is a one-line `UserError` naming the
file and key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

import yaml

from dflop.errors import UserError
from dflop.io import read_yaml, write_text_atomic

MODULE_KEYS = ("tp", "pp", "dp", "layers_per_stage")
TOP_KEYS = ("vision", "llm", "placement", "microbatches", "global_batch_size", "world_size")


class Placement(str, Enum):
    DISJOINT = "disjoint"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class ModuleLayout:
    """One module's (vision tower or LLM) 3-D grid and how its layers split over the pipeline."""

    tp: int
    pp: int
    dp: int
    layers_per_stage: tuple[int, ...]

    @property
    def n_ranks(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def n_layers(self) -> int:
        return sum(self.layers_per_stage)

    def layer_ranges(self) -> list[tuple[int, int]]:
        """[start, stop) layer range of every stage, in stage order."""
        bounds = [0]
        for n in self.layers_per_stage:
            bounds.append(bounds[-1] + n)
        return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class Plan:
    """The layout of one training run (see module docstring)."""

    vision: ModuleLayout
    llm: ModuleLayout
    placement: Placement
    microbatches: int
    global_batch_size: int
    world_size: int
    source: str = "plan.yaml"
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def colocated(self) -> bool:
        return self.placement is Placement.COLOCATED

    @property
    def n_vision_ranks(self) -> int:
        """Ranks that run only vision stages (0 when colocated)."""
        return 0 if self.colocated else self.vision.n_ranks

    def check_world_size(self, launched: int) -> None:
        """The launcher must start exactly the plan's world size."""
        if launched != self.world_size:
            raise UserError(f"{self.source}: world_size is {self.world_size} but {launched} processes were "
                            f"launched (torchrun --nproc-per-node x nodes must equal the plan's world_size)")

    def check_model(self, vision_layers: int, llm_layers: int) -> None:
        """layers_per_stage must cover the model's layers exactly."""
        for name, layout, n in (("vision", self.vision, vision_layers), ("llm", self.llm, llm_layers)):
            if layout.n_layers != n:
                raise UserError(f"{self.source}: {name}.layers_per_stage {list(layout.layers_per_stage)} sums to "
                                f"{layout.n_layers} but the model has {n} {name} layers")

    def with_uniform_layers(self, vision_layers: int, llm_layers: int) -> "Plan":
        """The same grid with layers split uniformly (baseline mode: data-blind layer split)."""
        from dflop.models.stages import uniform_layer_split

        def uniform(layout: ModuleLayout, n: int) -> ModuleLayout:
            sizes = tuple(stop - start for start, stop in uniform_layer_split(n, layout.pp))
            return ModuleLayout(layout.tp, layout.pp, layout.dp, sizes)

        return Plan(uniform(self.vision, vision_layers), uniform(self.llm, llm_layers), self.placement,
                    self.microbatches, self.global_batch_size, self.world_size, self.source, self.extra)

    def to_dict(self) -> dict:
        """The DESIGN keys as plain data (for writing a plan.yaml)."""
        def module(layout: ModuleLayout) -> dict:
            return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "layers_per_stage": list(layout.layers_per_stage)}

        return {"vision": module(self.vision), "llm": module(self.llm), "placement": self.placement.value,
                "microbatches": self.microbatches, "global_batch_size": self.global_batch_size,
                "world_size": self.world_size}


def _positive_int(value: Any, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _module(raw: Any, source: str, name: str) -> ModuleLayout:
    where = f"{source}: {name}"
    if not isinstance(raw, Mapping):
        raise UserError(f"{where}: expected a mapping with keys {', '.join(MODULE_KEYS)}, got {raw!r}")
    missing = [k for k in MODULE_KEYS if k not in raw]
    if missing:
        raise UserError(f"{where}: missing key(s) {', '.join(missing)}")
    unknown = sorted(set(raw) - set(MODULE_KEYS))
    if unknown:
        raise UserError(f"{where}.{unknown[0]}: unknown key (allowed: {', '.join(MODULE_KEYS)})")
    tp, pp, dp = (_positive_int(raw[k], f"{where}.{k}") for k in ("tp", "pp", "dp"))
    layers = raw["layers_per_stage"]
    if not isinstance(layers, list) or len(layers) != pp:
        raise UserError(f"{where}.layers_per_stage: expected a list of {pp} layer counts (one per stage), got {layers!r}")
    layers = tuple(_positive_int(n, f"{where}.layers_per_stage[{i}]", minimum=0) for i, n in enumerate(layers))
    return ModuleLayout(tp, pp, dp, layers)


def plan_from_dict(raw: Any, source: str = "plan.yaml") -> Plan:
    """Validate plan data (a parsed plan.yaml); `source` names the file in errors."""
    if not isinstance(raw, Mapping):
        raise UserError(f"{source}: top level must be a mapping, got {type(raw).__name__}")
    missing = [k for k in TOP_KEYS if k not in raw]
    if missing:
        raise UserError(f"{source}: missing key(s) {', '.join(missing)}")
    vision, llm = _module(raw["vision"], source, "vision"), _module(raw["llm"], source, "llm")
    try:
        placement = Placement(raw["placement"])
    except ValueError:
        raise UserError(f"{source}: placement: expected disjoint or colocated, got {raw['placement']!r}") from None
    microbatches = _positive_int(raw["microbatches"], f"{source}: microbatches")
    batch = _positive_int(raw["global_batch_size"], f"{source}: global_batch_size")
    world = _positive_int(raw["world_size"], f"{source}: world_size")

    if placement is Placement.COLOCATED:
        if vision.pp != 1:
            raise UserError(f"{source}: vision.pp is {vision.pp} but colocated placement runs the whole vision "
                            f"tower on the first LLM stage (vision.pp must be 1)")
        if (vision.dp, vision.tp) != (llm.dp, llm.tp):
            raise UserError(f"{source}: colocated placement needs vision dp/tp equal to the LLM's "
                            f"(vision dp={vision.dp} tp={vision.tp}, llm dp={llm.dp} tp={llm.tp})")
        expected = llm.n_ranks
        how = f"llm tp*pp*dp = {llm.tp}*{llm.pp}*{llm.dp}"
    else:
        expected = vision.n_ranks + llm.n_ranks
        how = (f"vision tp*pp*dp + llm tp*pp*dp = {vision.tp}*{vision.pp}*{vision.dp} + "
               f"{llm.tp}*{llm.pp}*{llm.dp}")
    if world != expected:
        raise UserError(f"{source}: world_size is {world} but the layout needs {expected} ranks ({how})")
    if batch < microbatches * llm.dp:
        raise UserError(f"{source}: global_batch_size {batch} cannot fill microbatches * llm.dp = "
                        f"{microbatches} * {llm.dp} = {microbatches * llm.dp} bins")
    extra = {k: v for k, v in raw.items() if k not in TOP_KEYS}
    return Plan(vision, llm, placement, microbatches, batch, world, source, extra)


def load_plan(path: str | Path) -> Plan:
    """Read and validate plan.yaml."""
    raw = read_yaml(path, missing_hint="run the optimize stage or write one by hand")
    return plan_from_dict(raw, str(path))


def write_plan(plan: Plan, path: str | Path) -> None:
    """Write the DESIGN keys of `plan` as YAML (atomic)."""
    write_text_atomic(path, yaml.safe_dump(plan.to_dict(), sort_keys=False))
