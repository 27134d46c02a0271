"""`Layout` (the discrete choices of a plan) and `Plan` (a layout plus its layer split).

Placements:
- ``disjoint``: vision stages on ``tp_v * pp_v * dp_v`` GPUs, then LLM stages on
  ``tp_l * pp_l * dp_l`` other GPUs; one 1F1B pipeline of ``pp_v + pp_l`` stages.
- ``colocated``: the whole vision tower runs on the first LLM stage (as torchtitan does), so
  ``pp_v = 1``, ``tp_v = tp_l`` and ``dp_v = dp_l``; the pipeline has ``pp_l`` stages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dflop.costmodel.memory import in_flight_1f1b

PLACEMENTS = ("disjoint", "colocated")


@dataclass(frozen=True)
class Layout:
    """Degrees of both modules, the placement and the microbatch count m of one candidate plan."""

    placement: str
    tp_v: int
    pp_v: int
    dp_v: int
    tp_l: int
    pp_l: int
    dp_l: int
    m: int

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.colocated and (self.pp_v != 1 or self.tp_v != self.tp_l or self.dp_v != self.dp_l):
            raise ValueError(f"colocated layout needs pp_v=1, tp_v=tp_l, dp_v=dp_l: {self}")

    @property
    def colocated(self) -> bool:
        return self.placement == "colocated"

    @property
    def vision_gpus(self) -> int:
        """GPUs only the vision tower uses (0 when colocated)."""
        return 0 if self.colocated else self.tp_v * self.pp_v * self.dp_v

    @property
    def llm_gpus(self) -> int:
        return self.tp_l * self.pp_l * self.dp_l

    @property
    def world_size(self) -> int:
        return self.vision_gpus + self.llm_gpus

    @property
    def vision_first_rank(self) -> int:
        return 0

    @property
    def llm_first_rank(self) -> int:
        return self.vision_gpus

    @property
    def n_vision_stages(self) -> int:
        """Pipeline stages that run only vision (0 when colocated)."""
        return 0 if self.colocated else self.pp_v

    @property
    def n_stages(self) -> int:
        return self.n_vision_stages + self.pp_l

    def in_flight(self) -> list[int]:
        """[n_stages] microbatches each stage holds at the 1F1B peak, vision stages first."""
        return in_flight_1f1b(self.n_stages, self.m)

    def describe(self) -> str:
        llm = f"llm tp{self.tp_l} pp{self.pp_l} dp{self.dp_l}"
        if self.colocated:
            return f"colocated ({llm}, vision on llm stage 0), m={self.m}"
        return f"disjoint (vision tp{self.tp_v} pp{self.pp_v} dp{self.dp_v} | {llm}), m={self.m}"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """A layout with its layer split: layers per vision stage and per LLM stage.

    vision_layers has one entry (all vision layers) in the colocated placement.
    """

    layout: Layout
    vision_layers: tuple[int, ...]
    llm_layers: tuple[int, ...]

    def __post_init__(self):
        if len(self.vision_layers) != self.layout.pp_v or len(self.llm_layers) != self.layout.pp_l:
            raise ValueError(f"layer split {self.vision_layers} / {self.llm_layers} does not match {self.layout}")
        if min(self.vision_layers + self.llm_layers) < 0:
            raise ValueError(f"negative layer count in {self.vision_layers} / {self.llm_layers}")

    def describe(self) -> str:
        return (f"{self.layout.describe()}; vision layers {list(self.vision_layers)}, "
                f"llm layers {list(self.llm_layers)}")
