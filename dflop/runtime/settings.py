"""What the trainer reads from the config: its sections, typed, and what `dflop train`'s flags change."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dflop.config import ClusterSection, Config, DataSection, DatasetSpec, ModelSpec, SchedulerSection, TrainSection
from dflop.scheduler.policy import Policy

# `dflop train` flags (and benchmarks) that override one key of a section.
OVERRIDES = {"steps": "train", "overlap_grad_sync": "train", "policy": "scheduler", "pad_to_longest": "scheduler"}


@dataclass(frozen=True)
class TrainSettings:
    """The config sections a training run uses.

    adaptive_correction: whether the scheduler learns from measured stage times (not a config key:
    tests and benchmarks that compare runs switch it off).
    """

    seed: int
    model: ModelSpec
    data: DataSection
    train: TrainSection
    scheduler: SchedulerSection
    cluster: ClusterSection
    adaptive_correction: bool = True

    @classmethod
    def from_config(cls, cfg: Config, *, adaptive_correction: bool = True, **overrides) -> "TrainSettings":
        """From a `dflop.config.Config`; `overrides` (None = keep) set one key of a section (`OVERRIDES`)."""
        sections = {"train": cfg.train, "scheduler": cfg.scheduler}
        for key, value in overrides.items():
            if key not in OVERRIDES:
                raise TypeError(f"TrainSettings.from_config: cannot override {key!r} (known: {', '.join(OVERRIDES)})")
            if value is not None:
                name = OVERRIDES[key]
                sections[name] = dataclasses.replace(sections[name], **{key: value})
        return cls(cfg.seed, cfg.model, cfg.data, sections["train"], sections["scheduler"], cfg.cluster,
                   adaptive_correction)

    @property
    def datasets(self) -> tuple[DatasetSpec, ...]:
        return self.data.datasets

    @property
    def baseline(self) -> bool:
        """The data-blind comparison run: fixed-count microbatches, uniform layer split."""
        return Policy.of_config(self.scheduler).data_blind
