"""plan.yaml, the contract between the optimizer and the trainer: one type, one reader, one writer,
one validator, and the questions every stage asks of a layout.

A `Layout` is the discrete choice (placement, each module's TP/PP/DP degrees, microbatches), a
`Plan` adds how each module's layers split over its pipeline stages, and a `PlanFile` is plan.yaml
read back: the plan, its global batch, the data-blind baseline and everything else the optimizer
wrote (predictions, solver, cluster, inputs) as the raw mapping. Keys the trainer reads::

    vision: {tp: 1, pp: 1, dp: 2, layers_per_stage: [2]}
    llm:    {tp: 1, pp: 2, dp: 2, layers_per_stage: [1, 1]}
    placement: disjoint          # or colocated: the vision tower runs on the first LLM stage's ranks
    microbatches: 4
    global_batch_size: 16
    world_size: 6

Each module may also name its memory techniques (all off when absent, as in plans written before
they existed): ``recompute`` (one of none|selective|full per stage: activation recomputation),
``shard_optimizer`` (optimizer state and gradients sharded over the module's data-parallel
replicas, also with tp > 1; needs dp > 1) and ``sequence_parallel`` (the residual stream sharded along the
sequence between tensor-parallel regions; needs tp > 1; the LLM only)::

    vision: {tp: 1, pp: 1, dp: 2, layers_per_stage: [2], recompute: [selective], shard_optimizer: true}
    llm:    {tp: 2, pp: 2, dp: 2, layers_per_stage: [1, 1], recompute: [full, none], sequence_parallel: true}

The LLM's pipeline schedule (``llm.schedule``, ``llm.chunks``; absent in plans written before
them, which read as ``1f1b`` with one chunk): ``1f1b``, ``interleaved`` (Megatron-LM's interleaved
1F1B: the LLM cut into ``pp * chunks`` model chunks, chunk c on pipeline rank ``c mod pp``; needs
``pp >= 2``, ``chunks >= 2`` and ``microbatches`` a multiple of ``pp``; ``layers_per_stage`` and
``recompute`` then have ``pp * chunks`` entries in chunk order) or ``zb-h1`` (the backward split
into input and weight gradients, Qi et al. 2024). The vision tower always runs 1F1B::

    llm: {tp: 1, pp: 2, dp: 1, layers_per_stage: [1, 1, 1, 1], recompute: [none, none, none, none],
          schedule: interleaved, chunks: 2}

Placements:
- ``disjoint``: vision stages on ``tp_v * pp_v * dp_v`` ranks, then LLM stages on
  ``tp_l * pp_l * dp_l`` other ranks; one 1F1B pipeline of ``pp_v + pp_l`` stages.
- ``colocated``: the whole vision tower runs on the first LLM stage (as torchtitan does), so
  ``pp_v = 1``, ``tp_v = tp_l`` and ``dp_v = dp_l``; the pipeline has ``pp_l`` stages.

Every problem with a file is a one-line `UserError` naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from dflop.config import Config, ModelSpec
from dflop.errors import UserError
from dflop.finite import check_finite_document, check_finite_values
from dflop.io import read_yaml, write_text_atomic

PLACEMENTS = ("disjoint", "colocated")
MODULE_KEYS = ("tp", "pp", "dp", "layers_per_stage")
TECHNIQUE_KEYS = ("recompute", "shard_optimizer", "sequence_parallel")  # optional; off when absent
SCHEDULE_KEYS = ("schedule", "chunks")  # optional, the LLM only; 1f1b with one chunk when absent
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1")  # what a plan may name (dflop.sim also has gpipe)
RECOMPUTE_MODES = ("none", "selective", "full")
PLAN_KEYS = ("vision", "llm", "placement", "microbatches", "global_batch_size", "world_size")
RANK_ORDER = ("vision ranks first, then llm ranks; inside a module rank = first_rank + (stage * dp + replica) * tp "
              "+ tp_rank; colocated: the vision tower runs on llm stage 0's ranks")


def in_flight_1f1b(n_stages: int, n_microbatches: int) -> list[int]:
    """Microbatches whose activations stage k holds at the 1F1B peak: ``min(m, p - k)``.

    Stage 0 runs p forwards before its first backward; the last stage runs one at a time.
    """
    if n_stages < 1 or n_microbatches < 1:
        raise UserError(f"1F1B needs at least one stage and one microbatch, got {n_stages}, {n_microbatches}")
    return [min(n_microbatches, n_stages - k) for k in range(n_stages)]


def check_schedule(schedule: str, chunks: int, pp: int, m: int) -> str | None:
    """Why (schedule, chunks) cannot run an LLM pipeline of `pp` ranks and `m` microbatches, or None."""
    if schedule not in PIPELINE_SCHEDULES:
        return f"schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}"
    if schedule != "interleaved":
        return None if chunks == 1 else f"{schedule} runs one model chunk per rank, got chunks={chunks}"
    if chunks < 2:
        return f"interleaved needs chunks >= 2 (model chunks per pipeline rank), got {chunks}"
    if pp < 2:
        return f"interleaved needs pipeline parallelism (pp >= 2), got pp={pp}"
    if m % pp:
        return f"interleaved needs microbatches ({m}) to be a multiple of pp ({pp}), as Megatron-LM does"
    return None


def interleaved_rank_in_flight(rank: int, p: int, v: int, m: int) -> int:
    """Chunk activations LLM `rank` holds at its peak under interleaved 1F1B: Megatron-LM's warm-up
    forwards ``2 (p - rank - 1) + (v - 1) p`` plus one (all ``m v`` when ``m == p``), at most ``m v``.
    (`dflop.sim.schedules.interleaved_warmup` is the schedule's own count; the tests hold them equal.)"""
    if m == p:
        return m * v
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)


def interleaved_lead(p: int, v: int, m: int) -> int:
    """Microbatches in flight on LLM rank 0's first chunk at its peak under interleaved 1F1B (what
    the vision stages in front must keep up with): walks the rank's Megatron order, whose k-th
    forward (backward) is chunk ``(k mod p v) // p`` (reversed for backwards) of microbatch
    ``(k // p v) p + k mod p``."""
    warmup = m * v if m == p else min(2 * (p - 1) + (v - 1) * p, m * v)
    ops = [("F", k) for k in range(warmup)]
    for i in range(m * v - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", k) for k in range(m * v - warmup, m * v)]
    held = peak = 0
    for kind, k in ops:
        within = (k % (p * v)) // p
        chunk = within if kind == "F" else v - 1 - within
        if chunk == 0:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
    return peak


def schedule_in_flight(schedule: str, chunks: int, n_vision_stages: int, pp: int, m: int) -> list[float]:
    """[n_vision_stages + pp] microbatches of activations each stage's rank holds at its peak, vision
    stages first, in units of the stage's whole activations of one microbatch.

    - 1f1b: ``min(m, P - k)`` over the whole pipeline of P stages.
    - zb-h1: vision stages as 1F1B; every LLM stage ``min(m, pp)``: 1F1B's ``pp - s`` whose input
      gradient (B) is due plus the ``s`` whose weight gradient (W) it postpones, each counted as a
      whole microbatch of activations (W keeps the linear layers' inputs and output gradients, most
      of a layer's saved tensors: an upper bound).
    - interleaved: LLM rank r holds `interleaved_rank_in_flight` chunk activations, each 1/chunks of
      the rank's (chunks of equal layers; a rank's layers split over its chunks differ by one
      at most); vision stage k keeps ``min(m, lead + n_v - k)`` where lead is rank 0's first chunk's
      peak (`interleaved_lead`), the rule `dflop.sim` times them by.
    `tests/test_plan_schedule.py` holds these against the simulator's own counts.
    """
    n_v = n_vision_stages
    if schedule == "1f1b":
        return in_flight_1f1b(n_v + pp, m)  # ints, as before schedules
    why = check_schedule(schedule, chunks, pp, m)
    if why:
        raise ValueError(why)
    if schedule == "zb-h1":
        return [float(min(m, n_v + pp - k)) for k in range(n_v)] + [float(min(m, pp))] * pp
    lead = interleaved_lead(pp, chunks, m)
    return ([float(min(m, lead + n_v - k)) for k in range(n_v)]
            + [interleaved_rank_in_flight(r, pp, chunks, m) / chunks for r in range(pp)])


def uniform_layer_split(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) layer ranges, sizes differing by at most one (earlier stages larger):
    the data-blind split Megatron and torchtitan use."""
    if not 1 <= n_stages <= n_layers:
        raise UserError(f"cannot split {n_layers} layers into {n_stages} pipeline stages")
    base, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for stage in range(n_stages):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return list(zip(bounds[:-1], bounds[1:]))


def _even_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """`n` items in `parts` contiguous [start, stop) ranges, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return list(zip(bounds[:-1], bounds[1:]))


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
    schedule: str = "1f1b"  # the LLM's pipeline schedule (PIPELINE_SCHEDULES); vision runs 1F1B
    chunks: int = 1         # model chunks per LLM pipeline rank (v of interleaved 1F1B)

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.colocated and (self.pp_v != 1 or self.tp_v != self.tp_l or self.dp_v != self.dp_l):
            raise ValueError(f"colocated layout needs pp_v=1, tp_v=tp_l, dp_v=dp_l: {self}")
        why = check_schedule(self.schedule, self.chunks, self.pp_l, self.m)
        if why:
            raise ValueError(f"{why}: {self}")

    @property
    def colocated(self) -> bool:
        return self.placement == "colocated"

    @property
    def vision_gpus(self) -> int:
        """Ranks only the vision tower uses (0 when colocated); the LLM's first rank."""
        return 0 if self.colocated else self.tp_v * self.pp_v * self.dp_v

    @property
    def llm_gpus(self) -> int:
        return self.tp_l * self.pp_l * self.dp_l

    @property
    def world_size(self) -> int:
        return self.vision_gpus + self.llm_gpus

    @property
    def n_vision_stages(self) -> int:
        """Pipeline stages that run only vision (0 when colocated)."""
        return 0 if self.colocated else self.pp_v

    @property
    def n_stages(self) -> int:
        """Stages of the one 1F1B pipeline (vision stages first)."""
        return self.n_vision_stages + self.pp_l

    @property
    def vision_replicas(self) -> int:
        """Vision replicas a microbatch's images are shared over, as the scheduler balances them:
        1 when colocated (each LLM replica encodes its own bin's images), else dp_v."""
        return 1 if self.colocated else self.dp_v

    @property
    def n_bins(self) -> int:
        """Packed LLM rows of one step: m microbatches x dp_l replicas."""
        return self.m * self.dp_l

    @property
    def n_llm_chunks(self) -> int:
        """Entries of the LLM's layers_per_stage / recompute: pp_l x chunks, in chunk order."""
        return self.pp_l * self.chunks

    def in_flight(self) -> list[float]:
        """[n_stages] microbatches of activations each stage's rank holds at its peak under the
        layout's schedule, vision stages first (`schedule_in_flight`)."""
        return schedule_in_flight(self.schedule, self.chunks, self.n_vision_stages, self.pp_l, self.m)

    def with_schedule(self, schedule: str, chunks: int = 1) -> "Layout":
        """The same degrees and microbatches under another LLM pipeline schedule."""
        return replace(self, schedule=schedule, chunks=chunks)

    def describe_schedule(self) -> str:
        """"" for 1F1B, else ", interleaved 1F1B x2 chunks" or ", zb-h1"."""
        if self.schedule == "1f1b":
            return ""
        return f", interleaved 1F1B x{self.chunks} chunks" if self.schedule == "interleaved" else f", {self.schedule}"

    def describe(self) -> str:
        llm = f"llm tp{self.tp_l} pp{self.pp_l} dp{self.dp_l}"
        if self.colocated:
            return f"colocated ({llm}, vision on llm stage 0), m={self.m}{self.describe_schedule()}"
        return (f"disjoint (vision tp{self.tp_v} pp{self.pp_v} dp{self.dp_v} | {llm}), "
                f"m={self.m}{self.describe_schedule()}")


@dataclass(frozen=True)
class Techniques:
    """One module's memory techniques (module docstring): what the trainer applies, what the cost
    model charges. `recompute` has one mode per pipeline stage of the module."""

    recompute: tuple[str, ...]
    shard_optimizer: bool = False
    sequence_parallel: bool = False

    def __post_init__(self):
        object.__setattr__(self, "recompute", tuple(self.recompute))
        bad = [m for m in self.recompute if m not in RECOMPUTE_MODES]
        if bad:
            raise ValueError(f"recompute mode {bad[0]!r} is not one of {', '.join(RECOMPUTE_MODES)}")

    @classmethod
    def off(cls, n_stages: int) -> "Techniques":
        """No recomputation, nothing sharded: what a plan without technique keys means."""
        return cls(("none",) * n_stages)

    @property
    def any(self) -> bool:
        return self.shard_optimizer or self.sequence_parallel or any(m != "none" for m in self.recompute)

    def to_dict(self) -> dict:
        return {"recompute": list(self.recompute), "shard_optimizer": self.shard_optimizer,
                "sequence_parallel": self.sequence_parallel}

    def describe(self) -> str:
        parts = []
        if any(m != "none" for m in self.recompute):
            parts.append("recompute " + "/".join(self.recompute))
        if self.shard_optimizer:
            parts.append("sharded optimizer")
        if self.sequence_parallel:
            parts.append("sequence parallel")
        return ", ".join(parts) or "no memory techniques"


@dataclass(frozen=True)
class ModuleLayout:
    """One module's (vision tower or LLM) grid, how its layers split over its stages, and its
    memory techniques."""

    tp: int
    pp: int
    dp: int
    layers_per_stage: tuple[int, ...]
    techniques: Techniques | None = None  # None: off
    schedule: str | None = None  # the LLM's pipeline schedule; None for the vision tower (1F1B, not written)
    chunks: int = 1              # model chunks per rank: layers_per_stage has pp x chunks entries

    def __post_init__(self):
        if self.techniques is None:
            object.__setattr__(self, "techniques", Techniques.off(self.pp * self.chunks))

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

    def to_dict(self) -> dict:
        out = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "layers_per_stage": list(self.layers_per_stage),
               **self.techniques.to_dict()}
        if self.schedule is not None:
            out.update(schedule=self.schedule, chunks=self.chunks)
        return out


@dataclass(frozen=True)
class Plan:
    """A layout with its layer split: layers per vision stage and per LLM stage.

    vision_layers has one entry (all vision layers) in the colocated placement; llm_layers (and the
    LLM's recompute) one per model chunk, pp_l x chunks, in chunk order (chunk c on rank c mod pp_l).
    vision_techniques / llm_techniques: each module's memory techniques (None: off).
    source: the file it was read from, for error messages (not part of equality).
    """

    layout: Layout
    vision_layers: tuple[int, ...]
    llm_layers: tuple[int, ...]
    source: str = field(default="plan", compare=False, repr=False)
    vision_techniques: Techniques | None = None
    llm_techniques: Techniques | None = None

    def __post_init__(self):
        object.__setattr__(self, "vision_layers", tuple(int(n) for n in self.vision_layers))
        object.__setattr__(self, "llm_layers", tuple(int(n) for n in self.llm_layers))
        if len(self.vision_layers) != self.layout.pp_v or len(self.llm_layers) != self.layout.n_llm_chunks:
            raise ValueError(f"layer split {self.vision_layers} / {self.llm_layers} does not match {self.layout}")
        if min(self.vision_layers + self.llm_layers) < 0:
            raise ValueError(f"negative layer count in {self.vision_layers} / {self.llm_layers}")
        lay = self.layout
        for name, attr, pp, tp, dp in (("vision", "vision_techniques", lay.pp_v, lay.tp_v, lay.dp_v),
                                       ("llm", "llm_techniques", lay.n_llm_chunks, lay.tp_l, lay.dp_l)):
            tech = getattr(self, attr)
            if tech is None:
                object.__setattr__(self, attr, Techniques.off(pp))
            elif len(tech.recompute) != pp:
                raise ValueError(f"{name} recompute {list(tech.recompute)} needs one mode per stage ({pp})")
            elif tech.sequence_parallel and tp == 1:
                raise ValueError(f"{name} sequence parallelism needs tensor parallelism (tp > 1)")
            elif tech.shard_optimizer and dp == 1:
                raise ValueError(f"{name} optimizer sharding needs data-parallel replicas to shard over (dp > 1)")

    def with_techniques(self, vision: Techniques, llm: Techniques) -> "Plan":
        """The same plan with these memory techniques."""
        return Plan(self.layout, self.vision_layers, self.llm_layers, self.source, vision, llm)

    def with_forced_techniques(self, recompute: str = "none", shard_optimizer: bool = False,
                               sequence_parallel: bool = False) -> "Plan":
        """One recompute mode on every stage; optimizer sharding on each module with data-parallel
        replicas (dp > 1); sequence parallelism on the LLM where it has tensor parallelism (the
        trainer has no SP for the vision tower)."""
        lay = self.layout
        return self.with_techniques(Techniques((recompute,) * lay.pp_v, shard_optimizer and lay.dp_v > 1),
                                    Techniques((recompute,) * lay.n_llm_chunks, shard_optimizer and lay.dp_l > 1,
                                               sequence_parallel and lay.tp_l > 1))

    @classmethod
    def uniform(cls, layout: Layout, vision_layers: int, llm_layers: int) -> "Plan":
        """`layout` with each module's layers split uniformly (the data-blind baseline's split)."""
        def sizes(n: int, stages: int) -> tuple[int, ...]:
            return tuple(stop - start for start, stop in uniform_layer_split(n, stages))

        return cls(layout, sizes(vision_layers, layout.pp_v), sizes(llm_layers, layout.n_llm_chunks))

    def with_uniform_layers(self, vision_layers: int, llm_layers: int) -> "Plan":
        """The same layout with layers split uniformly (baseline mode of the trainer)."""
        plan = Plan.uniform(self.layout, vision_layers, llm_layers)
        return Plan(plan.layout, plan.vision_layers, plan.llm_layers, self.source,
                    self.vision_techniques, self.llm_techniques)

    # -- what the runtime asks -------------------------------------------------------------------

    @property
    def vision(self) -> ModuleLayout:
        lay = self.layout
        return ModuleLayout(lay.tp_v, lay.pp_v, lay.dp_v, self.vision_layers, self.vision_techniques)

    @property
    def llm(self) -> ModuleLayout:
        lay = self.layout
        return ModuleLayout(lay.tp_l, lay.pp_l, lay.dp_l, self.llm_layers, self.llm_techniques, lay.schedule,
                            lay.chunks)

    @property
    def schedule(self) -> str:
        return self.layout.schedule

    @property
    def llm_rank_layers(self) -> tuple[int, ...]:
        """[pp_l] LLM layers on each pipeline rank: the sum over its chunks (rank r: r, r + pp_l, ...)."""
        p = self.layout.pp_l
        return tuple(sum(self.llm_layers[r::p]) for r in range(p))

    def llm_rank_recompute(self) -> tuple[str, ...]:
        """[pp_l] each LLM rank's recompute mode; ValueError when a rank's chunks differ (the pricing
        prices a rank in one mode)."""
        p, modes = self.layout.pp_l, self.llm_techniques.recompute
        out = []
        for r in range(p):
            mine = set(modes[r::p])
            if len(mine) != 1:
                raise ValueError(f"llm rank {r}'s chunks have recompute modes {sorted(mine)}; pricing needs one per rank")
            out.append(mine.pop())
        return tuple(out)

    def with_schedule(self, schedule: str, chunks: int = 1) -> "Plan":
        """The same plan under another LLM schedule: with chunks > 1 each rank's layers (and its
        recompute mode) split over its chunks as evenly as possible, earlier chunks larger."""
        lay = self.layout.with_schedule(schedule, chunks)
        ranks, modes = self.llm_rank_layers, self.llm_rank_recompute()
        p = lay.pp_l
        layers, rec = [0] * (p * chunks), ["none"] * (p * chunks)
        for r in range(p):
            for k, (start, stop) in enumerate(_even_ranges(ranks[r], chunks)):
                layers[k * p + r], rec[k * p + r] = stop - start, modes[r]
        tech = self.llm_techniques
        return Plan(lay, self.vision_layers, tuple(layers), self.source, self.vision_techniques,
                    Techniques(tuple(rec), tech.shard_optimizer, tech.sequence_parallel))

    @property
    def placement(self) -> str:
        return self.layout.placement

    @property
    def colocated(self) -> bool:
        return self.layout.colocated

    @property
    def microbatches(self) -> int:
        return self.layout.m

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def n_vision_ranks(self) -> int:
        """Ranks that run only vision stages (0 when colocated)."""
        return self.layout.vision_gpus

    @property
    def n_stages(self) -> int:
        return self.layout.n_stages

    @property
    def vision_replicas(self) -> int:
        return self.layout.vision_replicas

    def stage_name(self, s: int) -> str:
        """'vision stage 0', 'llm stage 2', or 'llm stage 0 (with the vision tower)'."""
        n_v = self.layout.n_vision_stages
        if s < n_v:
            return f"vision stage {s}"
        suffix = " (with the vision tower)" if self.colocated and s == 0 else ""
        return f"llm stage {s - n_v}{suffix}"

    def check_world_size(self, launched: int) -> None:
        """The launcher must start exactly the plan's world size."""
        if launched != self.world_size:
            raise UserError(f"{self.source}: world_size is {self.world_size} but {launched} processes were "
                            f"launched (torchrun --nproc-per-node x nodes must equal the plan's world_size)")

    def check(self, model, cluster=None) -> None:
        """One-line UserError naming the file and the key unless this plan can train `model` on
        `cluster`: the one check of a plan against what it runs on, made where a plan enters (the
        launcher of `dflop train`, the trainer's model build, `dflop simulate`). plan.yaml's own keys
        (world size against the layout, ...) are checked when it is read.

        model: its layer counts and the TP degrees that split it evenly (``vision_layers``,
        ``llm_layers``, ``vision_tp_degrees`` (after zero-head padding), ``llm_tp_degrees``:
        a `dflop.models.info.ModelInfo` or `SplitLimits`, or the planner's `ModelShape`). The layer splits must cover
        its layers, the TP degrees split it, and the vision tower may not ask for sequence
        parallelism (the trainer has it for the LLM only).
        cluster: a `dflop.pricing.cluster.Cluster` the rank layout must fit and launch on
        (`Cluster.check_runs`); None: not checked (inside the launched workers).
        """
        for name, layout, n, ok in (("vision", self.vision, model.vision_layers, model.vision_tp_degrees),
                                    ("llm", self.llm, model.llm_layers, model.llm_tp_degrees)):
            if layout.n_layers != n:
                raise UserError(f"{self.source}: {name}.layers_per_stage {list(layout.layers_per_stage)} sums to "
                                f"{layout.n_layers} but the model has {n} {name} layers")
            if layout.tp not in ok:
                raise UserError(f"{self.source}: {name}.tp is {layout.tp}, which does not split the {name} model's "
                                f"heads and widths evenly (possible: {', '.join(map(str, ok))})")
        if self.vision_techniques.sequence_parallel:
            raise UserError(f"{self.source}: vision.sequence_parallel: sequence parallelism is implemented for the "
                            f"LLM only; set it to false for the vision tower")
        if cluster is not None:
            cluster.check_runs(self.layout, self.source)

    def describe(self) -> str:
        text = f"{self.layout.describe()}; vision layers {list(self.vision_layers)}, llm layers {list(self.llm_layers)}"
        for name, tech in (("vision", self.vision_techniques), ("llm", self.llm_techniques)):
            if tech.any:
                text += f"; {name}: {tech.describe()}"
        return text

    def to_dict(self, global_batch_size: int) -> dict:
        """The DESIGN keys (what the trainer reads) as plain data."""
        return {"vision": self.vision.to_dict(), "llm": self.llm.to_dict(), "placement": self.placement,
                "microbatches": self.microbatches, "global_batch_size": int(global_batch_size),
                "world_size": self.world_size}


@dataclass(frozen=True)
class PlanFile:
    """plan.yaml read back: the plan, the global batch it was made for, the data-blind baseline
    (None without one), the whole mapping (`doc`: predictions, solver, cluster, model, inputs) and
    the HF/LLaVA padded baseline (None without one; `baseline` is the Megatron-style packed one)."""

    plan: Plan
    global_batch_size: int
    baseline: Plan | None = None
    doc: Mapping[str, Any] = field(default_factory=dict, compare=False)
    source: str = "plan.yaml"
    padded_baseline: Plan | None = None

    def model_spec(self) -> ModelSpec:
        """The model the plan was made for (its ``model`` record: arch, vision, llm, weights; the
        rest of the section from the schema's defaults)."""
        record = self.doc.get("model")
        if not isinstance(record, Mapping):
            raise UserError(f"{self.source}: model: missing (which model was this plan made for?)")
        missing = [k for k in ("arch", "vision", "llm") if k not in record]
        if missing:
            raise UserError(f"{self.source}: model.{missing[0]} missing")
        section = {k: record[k] for k in ("arch", "vision", "llm", "weights") if k in record}
        try:
            return Config.from_dict({"model": section}).model
        except UserError as exc:
            raise UserError(f"{self.source}: model record: {exc}") from None

    def prediction(self, section: str | None = None) -> "Prediction | None":
        """The plan's ``predicted`` record (`section`: a baseline's); None when absent."""
        return Prediction.read(self.doc, section, self.source)

    def check_batch(self, global_batch_size: int, key: str = "train.global_batch_size") -> None:
        if global_batch_size != self.global_batch_size:
            raise UserError(f"{key} is {global_batch_size} but {self.source} was planned for "
                            f"{self.global_batch_size} (re-run optimize)")


@dataclass(frozen=True)
class Prediction:
    """plan.yaml's ``predicted`` record of one plan (the chosen one, or a baseline's): what the
    optimizer expects of it over its sampled global batches. Seconds per step, bytes per rank.

    The one writer (`to_dict`, called by `dflop.planner.planfile`) and reader (`read`, for
    `dflop compare-runs` and the report). Fields a hand-written or older file leaves out are None
    (memory: empty), so a reader asks only for what it needs.
    """

    step_mean_s: float | None = None
    step_p50_s: float | None = None
    step_p90_s: float | None = None
    mean_shape_step_s: float | None = None  # the MILP's mean-shape step (null for the padded baseline)
    utilisation: float | None = None
    samples_per_s: float | None = None
    memory_vision_bytes: tuple[int, ...] = ()  # [pp_v] peak per stage (empty when colocated)
    memory_llm_bytes: tuple[int, ...] = ()  # [pp_l]
    memory_limit_bytes: int | None = None
    batches: int | None = None

    def to_dict(self) -> dict:
        """The ``predicted`` mapping as plan.yaml holds it (key order is the file's)."""
        return {
            "step_s": {"mean": self.step_mean_s, "p50": self.step_p50_s, "p90": self.step_p90_s},
            "mean_shape_step_s": self.mean_shape_step_s,
            "utilisation": self.utilisation,
            "samples_per_s": self.samples_per_s,
            "memory_bytes": {"vision": list(self.memory_vision_bytes), "llm": list(self.memory_llm_bytes)},
            "memory_limit_bytes": self.memory_limit_bytes,
            "batches": self.batches,
        }

    @classmethod
    def read(cls, doc: Mapping[str, Any], section: str | None = None,
             source: str = "plan.yaml") -> "Prediction | None":
        """The ``predicted`` record of plan.yaml's mapping `doc` (`section`: ``baseline`` or
        ``padded_baseline`` for theirs); None when that record is absent. A one-line UserError
        naming `source` and the key for a record that is not a mapping or a step time that is not
        a finite number > 0 (the comparisons divide by them)."""
        where = f"{section}.predicted" if section else "predicted"
        owner = doc.get(section) if section else doc
        if not isinstance(owner, Mapping) or owner.get("predicted") is None:
            return None
        raw = owner["predicted"]
        steps = raw.get("step_s", {}) if isinstance(raw, Mapping) else None
        memory = raw.get("memory_bytes", {}) if isinstance(raw, Mapping) else None
        for key, value in (("", raw), (".step_s", steps), (".memory_bytes", memory)):
            if not isinstance(value, Mapping):
                raise UserError(f"{source}: {where}{key}: expected a mapping, got {value!r}")
        check_finite_values([(f"{where}.step_s.{k}", steps[k]) for k in ("mean", "p50", "p90")
                             if steps.get(k) is not None], source, positive=True)
        per_stage = {}
        for module in ("vision", "llm"):
            value = memory.get(module, ())
            if not isinstance(value, (list, tuple)):
                raise UserError(f"{source}: {where}.memory_bytes.{module}: expected a list (one number per stage), "
                                f"got {value!r}")
            per_stage[module] = tuple(value)
        return cls(steps.get("mean"), steps.get("p50"), steps.get("p90"), raw.get("mean_shape_step_s"),
                   raw.get("utilisation"), raw.get("samples_per_s"), per_stage["vision"],
                   per_stage["llm"], raw.get("memory_limit_bytes"), raw.get("batches"))


# -- reading and writing ---------------------------------------------------------------------------


def whole_number(value: Any, where: str, minimum: int = 1) -> int:
    """`value` when it is an integer >= `minimum` (not a bool, not a float); else a one-line
    UserError naming `where` (the file and key)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _module(raw: Any, where: str, llm: bool = False) -> ModuleLayout:
    """One module's section; the LLM's may name its schedule (`SCHEDULE_KEYS`; checked against the
    microbatches in `_plan`)."""
    if not isinstance(raw, Mapping):
        raise UserError(f"{where}: expected a mapping with keys {', '.join(MODULE_KEYS)}, got {raw!r}")
    missing = [k for k in MODULE_KEYS if k not in raw]
    if missing:
        raise UserError(f"{where}: missing key(s) {', '.join(missing)}")
    allowed = MODULE_KEYS + TECHNIQUE_KEYS + (SCHEDULE_KEYS if llm else ())
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        hint = " (the vision tower always runs 1F1B)" if unknown[0] in SCHEDULE_KEYS else ""
        raise UserError(f"{where}.{unknown[0]}: unknown key{hint} (allowed: {', '.join(allowed)})")
    tp, pp, dp = (whole_number(raw[k], f"{where}.{k}") for k in ("tp", "pp", "dp"))
    schedule, chunks = "1f1b", 1
    if llm:
        schedule = raw.get("schedule", "1f1b")
        if schedule not in PIPELINE_SCHEDULES:
            raise UserError(f"{where}.schedule: expected one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
        chunks = whole_number(raw.get("chunks", 1), f"{where}.chunks")
        if schedule != "interleaved" and chunks != 1:
            raise UserError(f"{where}.chunks: {schedule} runs one model chunk per rank (chunks: 1), got {chunks}")
        if schedule == "interleaved" and chunks < 2:
            raise UserError(f"{where}.chunks: interleaved needs at least 2 model chunks per rank, got {chunks}")
        if schedule == "interleaved" and pp < 2:
            raise UserError(f"{where}.schedule: interleaved needs pipeline parallelism (pp >= 2), got pp {pp}")
    n = pp * chunks
    what = "one per stage" if chunks == 1 else f"one per model chunk: pp x chunks = {pp} x {chunks}"
    layers = raw["layers_per_stage"]
    if not isinstance(layers, list) or len(layers) != n:
        raise UserError(f"{where}.layers_per_stage: expected a list of {n} layer counts ({what}), got {layers!r}")
    layers = tuple(whole_number(n, f"{where}.layers_per_stage[{i}]", minimum=0) for i, n in enumerate(layers))
    return ModuleLayout(tp, pp, dp, layers, _techniques(raw, where, n, tp, dp, what), schedule if llm else None,
                        chunks)


def _techniques(raw: Mapping, where: str, pp: int, tp: int, dp: int, what: str = "one per stage") -> Techniques:
    recompute = raw.get("recompute", ["none"] * pp)
    if not isinstance(recompute, list) or len(recompute) != pp:
        raise UserError(f"{where}.recompute: expected a list of {pp} modes ({what}), got {recompute!r}")
    for i, mode in enumerate(recompute):
        if mode not in RECOMPUTE_MODES:
            raise UserError(f"{where}.recompute[{i}]: expected one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    flags = {}
    for key in ("shard_optimizer", "sequence_parallel"):
        flags[key] = raw.get(key, False)
        if not isinstance(flags[key], bool):
            raise UserError(f"{where}.{key}: expected true or false, got {flags[key]!r}")
    if flags["sequence_parallel"] and tp == 1:
        raise UserError(f"{where}.sequence_parallel: needs tensor parallelism (tp > 1), but tp is 1")
    if flags["shard_optimizer"] and dp == 1:
        raise UserError(f"{where}.shard_optimizer: needs data-parallel replicas to shard over (dp > 1), but dp is 1")
    return Techniques(tuple(recompute), **flags)


def _plan(raw: Any, source: str, prefix: str = "") -> tuple[Plan, int]:
    """(plan, global batch) of one plan mapping: the top level, or the baseline section."""
    where = f"{source}: {prefix}"
    if not isinstance(raw, Mapping):
        raise UserError(f"{where.rstrip(': ')}: expected a mapping of plan keys, got {type(raw).__name__}")
    missing = [k for k in PLAN_KEYS if k not in raw]
    if missing:
        raise UserError(f"{where}missing key(s) {', '.join(missing)}")
    vision, llm = _module(raw["vision"], f"{where}vision"), _module(raw["llm"], f"{where}llm", llm=True)
    placement = raw["placement"]
    if placement not in PLACEMENTS:
        raise UserError(f"{where}placement: expected disjoint or colocated, got {placement!r}")
    m = whole_number(raw["microbatches"], f"{where}microbatches")
    batch = whole_number(raw["global_batch_size"], f"{where}global_batch_size")
    world = whole_number(raw["world_size"], f"{where}world_size")
    if placement == "colocated":
        if vision.pp != 1:
            raise UserError(f"{where}vision.pp is {vision.pp} but colocated placement runs the whole vision "
                            f"tower on the first LLM stage (vision.pp must be 1)")
        if (vision.dp, vision.tp) != (llm.dp, llm.tp):
            raise UserError(f"{where}colocated placement needs vision dp/tp equal to the LLM's "
                            f"(vision dp={vision.dp} tp={vision.tp}, llm dp={llm.dp} tp={llm.tp})")
        how = f"llm tp*pp*dp = {llm.tp}*{llm.pp}*{llm.dp}"
    else:
        how = (f"vision tp*pp*dp + llm tp*pp*dp = {vision.tp}*{vision.pp}*{vision.dp} + "
               f"{llm.tp}*{llm.pp}*{llm.dp}")
    if llm.schedule == "interleaved" and m % llm.pp:
        raise UserError(f"{where}microbatches: interleaved needs a multiple of llm.pp ({llm.pp}), as Megatron-LM "
                        f"does, got {m}")
    layout = Layout(placement, vision.tp, vision.pp, vision.dp, llm.tp, llm.pp, llm.dp, m, llm.schedule, llm.chunks)
    if world != layout.world_size:
        raise UserError(f"{where}world_size is {world} but the layout needs {layout.world_size} ranks ({how})")
    if batch < layout.n_bins:
        raise UserError(f"{where}global_batch_size {batch} cannot fill microbatches * llm.dp = "
                        f"{m} * {llm.dp} = {layout.n_bins} bins")
    return Plan(layout, vision.layers_per_stage, llm.layers_per_stage, source,
                vision.techniques, llm.techniques), batch


def plan_from_dict(raw: Any, source: str = "plan.yaml") -> PlanFile:
    """Validate plan data (a parsed plan.yaml); `source` names the file in errors."""
    if not isinstance(raw, Mapping):
        raise UserError(f"{source}: top level must be a mapping, got {type(raw).__name__}")
    check_finite_document(raw, source)  # YAML's .nan/.inf: the predictions simulate and compare-runs print
    plan, batch = _plan(raw, source)
    baseline = None
    if raw.get("baseline"):
        baseline, _ = _plan(raw["baseline"], source, "baseline.")
    padded = None
    if raw.get("padded_baseline"):  # optional (newer files)
        padded, _ = _plan(raw["padded_baseline"], source, "padded_baseline.")
    return PlanFile(plan, batch, baseline, dict(raw), source, padded)


def baseline_plan_doc(doc: Mapping[str, Any], source: str = "plan.yaml", *, padded: bool = False) -> dict:
    """plan.yaml's data-blind baseline as a plan document of its own (its ``baseline`` section, or
    with `padded` its ``padded_baseline``, at the top level, with the file's cluster, model and
    inputs records), so the trainer runs it as it runs the plan (`dflop train --baseline [--pad]`).
    The padded baseline has layouts of its own (padding needs more microbatches for the same memory)."""
    key = "padded_baseline" if padded else "baseline"
    section = doc.get(key)
    if not isinstance(section, Mapping) or not section:
        raise UserError(f"{source}: {key}: missing (re-run `dflop optimize` to get the data-blind baseline)")
    out = dict(section)
    for key in ("cluster", "model", "inputs"):
        if key in doc:
            out[key] = doc[key]
    return out


def read_plan(path: str | Path) -> PlanFile:
    """Read and validate plan.yaml."""
    raw = read_yaml(path, missing_hint="run `dflop optimize` first, or write one by hand")
    return plan_from_dict(raw, str(path))


def write_plan(doc: Mapping[str, Any], path: str | Path) -> None:
    """Write a plan mapping (at least the `Plan.to_dict` keys) atomically, keys in document order;
    checked by reading it back the way every stage reads it."""
    plan_from_dict(doc, str(path))
    header = "# DFLOP plan (dflop optimize); keys: docs/design.md and dflop/plan.py\n"
    write_text_atomic(path, header + yaml.safe_dump(dict(doc), sort_keys=False, default_flow_style=None, width=110))
