"""The one object that owns the parallel layout: which rank runs what, and the process groups.

Two grids share the world (docs/design.md): the vision tower's (pp_v x dp_v x tp_v) and the LLM's
(pp_l x dp_l x tp_l). Inside a grid the rank is ``offset + (stage * dp + replica) * tp + tp_rank``
(TP innermost, so a TP group sits on neighbouring ranks, i.e. inside a node). Disjoint placement:
vision ranks [0, V) then LLM ranks [V, world); colocated placement: the vision tower runs on the
ranks of LLM stage 0 with the LLM's dp and tp (vision pp = 1).

The 1F1B chain sees one pipeline of ``pp_v + pp_l`` stages (disjoint; vision first) or ``pp_l``
stages (colocated; vision inside stage 0). Every replica of a stage runs the same schedule. Under
interleaved 1F1B (``llm.chunks`` = v > 1) LLM stage r holds the model chunks r, r + pp_l, ...
(`rank_chunks`), and chunk c sends to the stage of chunk c + 1 (`chunk_rank`): the last stage's
chunks feed the first stage's next ones. The embedding stays on stage 0 and the head on the last.

Model and schedule code ask this object for ranks and groups; they never build groups themselves.
The arithmetic (`rank_of`, roles, peers) needs no process group, so it is unit-tested directly;
`Topology.create_groups` is the collective part (NCCL on CUDA, gloo on CPU, the same code).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist

from dflop.models.tensor_parallel import TPGroup
from dflop.plan import ModuleLayout, Plan

VISION, LLM = "vision", "llm"


@dataclass(frozen=True)
class StageRole:
    """This rank's place in one module's grid."""

    module: str  # "vision" | "llm"
    stage: int
    n_stages: int
    replica: int
    n_replicas: int
    tp_rank: int
    tp: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1


@dataclass
class Groups:
    """Process groups this rank belongs to (None where the group would have one rank)."""

    vision_tp: object = None
    vision_dp: object = None
    llm_tp: object = None
    llm_dp: object = None
    tied_embedding: object = None  # first + last LLM stage of one (replica, tp rank), when pp_l > 1


class Topology:
    """Ranks, roles and groups of one plan (see module docstring)."""

    def __init__(self, plan: Plan, rank: int, world_size: int, *, tied_embeddings: bool = False):
        plan.check_world_size(world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.tied_embeddings = tied_embeddings
        self.groups = Groups()
        self.vision_role = self._role(VISION)
        self.llm_role = self._role(LLM)

    @cached_property
    def peers(self) -> tuple["Topology", ...]:
        """Every rank's Topology (arithmetic only, no process groups), built once: what rank 0
        reads other ranks' measurements with."""
        return tuple(self if r == self.rank else Topology(self.plan, r, self.world_size,
                                                          tied_embeddings=self.tied_embeddings)
                     for r in range(self.world_size))

    # -- arithmetic --------------------------------------------------------------------------

    def layout(self, module: str) -> ModuleLayout:
        return self.plan.vision if module == VISION else self.plan.llm

    def _offset(self, module: str) -> int:
        return self.plan.n_vision_ranks if module == LLM else 0

    def rank_of(self, module: str, stage: int, replica: int, tp_rank: int) -> int:
        """Global rank of (stage, replica, tp_rank) in `module`'s grid."""
        if module == VISION and self.plan.colocated:
            if stage != 0:
                raise ValueError(f"colocated vision has one stage, asked for stage {stage}")
            return self.rank_of(LLM, 0, replica, tp_rank)
        lay = self.layout(module)
        if not (0 <= stage < lay.pp and 0 <= replica < lay.dp and 0 <= tp_rank < lay.tp):
            raise ValueError(f"{module} (stage {stage}, replica {replica}, tp {tp_rank}) outside "
                             f"pp={lay.pp} dp={lay.dp} tp={lay.tp}")
        return self._offset(module) + (stage * lay.dp + replica) * lay.tp + tp_rank

    def _role(self, module: str) -> StageRole | None:
        lay = self.layout(module)
        if module == VISION and self.plan.colocated:
            llm = self._role(LLM)
            if llm is None or llm.stage != 0:
                return None
            return StageRole(VISION, 0, 1, llm.replica, lay.dp, llm.tp_rank, lay.tp)
        local = self.rank - self._offset(module)
        if not 0 <= local < lay.n_ranks:
            return None
        tp_rank = local % lay.tp
        replica = (local // lay.tp) % lay.dp
        stage = local // (lay.tp * lay.dp)
        return StageRole(module, stage, lay.pp, replica, lay.dp, tp_rank, lay.tp)

    @property
    def n_pipeline_stages(self) -> int:
        """Stages of the 1F1B chain: pp_v + pp_l (disjoint) or pp_l (colocated)."""
        return self.plan.n_stages

    @property
    def pipeline_stage(self) -> int:
        """This rank's position in the 1F1B chain."""
        if self.llm_role is not None:
            return self.llm_role.stage + self.plan.layout.n_vision_stages
        return self.vision_role.stage

    @property
    def vision_tp(self) -> TPGroup:
        return self._tp_group(self.vision_role, self.groups.vision_tp, self.groups.vision_dp)

    @property
    def llm_tp(self) -> TPGroup:
        return self._tp_group(self.llm_role, self.groups.llm_tp, self.groups.llm_dp)

    def _tp_group(self, role: StageRole, tp_group, dp_group) -> TPGroup:
        """A module sharded over its replicas (``shard_optimizer``, dp > 1) with tp > 1 gets the
        stage's (dp, tp) rank grid: its TP then lives on a 2-D mesh FSDP2 can shard over."""
        if not (self.layout(role.module).techniques.shard_optimizer and role.tp > 1 and dp_group is not None):
            return TPGroup(role.tp_rank, role.tp, tp_group)
        grid = tuple(tuple(self.rank_of(role.module, role.stage, r, t) for t in range(role.tp))
                     for r in range(role.n_replicas))
        return TPGroup(role.tp_rank, role.tp, tp_group, dp_group, grid)

    # -- peers for point-to-point ------------------------------------------------------------

    def prev_rank(self, role: StageRole) -> int:
        """The rank feeding this stage's input within its module (same replica and tp rank)."""
        return self.rank_of(role.module, role.stage - 1, role.replica, role.tp_rank)

    def next_rank(self, role: StageRole) -> int:
        return self.rank_of(role.module, role.stage + 1, role.replica, role.tp_rank)

    @property
    def llm_chunks(self) -> int:
        """LLM model chunks per pipeline rank (v of interleaved 1F1B; 1 otherwise)."""
        return self.plan.layout.chunks

    def chunk_rank(self, role: StageRole, chunk: int) -> int:
        """The rank running LLM model chunk (virtual stage) `chunk` for `role`'s replica and tp
        rank: chunk c runs on LLM stage c mod pp (rank r holds chunks r, r + pp, ...)."""
        return self.rank_of(LLM, chunk % self.plan.llm.pp, role.replica, role.tp_rank)

    def rank_chunks(self, role: StageRole) -> list[int]:
        """The virtual stages of the LLM chunks `role`'s rank holds, by local chunk index."""
        pp = self.plan.llm.pp
        return [k * pp + role.stage for k in range(self.llm_chunks)]

    def feature_destinations(self) -> dict[int, list[int]]:
        """Last vision stage: LLM replica -> first-LLM-stage ranks this rank sends features to.

        LLM tp rank u receives from vision tp rank u % tp_v (so every receiver has one sender).
        """
        role, tp_v = self.vision_role, self.plan.vision.tp
        return {r: [self.rank_of(LLM, 0, r, u) for u in range(self.plan.llm.tp) if u % tp_v == role.tp_rank]
                for r in range(self.plan.llm.dp)}

    def feature_source(self, vision_replica: int) -> int:
        """First LLM stage: the rank of `vision_replica` that sends this rank its features."""
        last = self.plan.vision.pp - 1
        return self.rank_of(VISION, last, vision_replica, self.llm_role.tp_rank % self.plan.vision.tp)

    def feature_grad_destinations(self) -> dict[int, list[int]]:
        """First LLM stage: vision replica -> last-vision-stage ranks this rank sends gradients to."""
        last, tp_l = self.plan.vision.pp - 1, self.plan.llm.tp
        return {v: [self.rank_of(VISION, last, v, t) for t in range(self.plan.vision.tp) if t % tp_l == self.llm_role.tp_rank]
                for v in range(self.plan.vision.dp)}

    def feature_grad_source(self, llm_replica: int) -> int:
        """Last vision stage: the rank of `llm_replica` that sends this rank its feature gradients."""
        return self.rank_of(LLM, 0, llm_replica, self.vision_role.tp_rank % self.plan.llm.tp)

    # -- process groups ----------------------------------------------------------------------

    def _group_ranks(self) -> list[tuple[str, list[int]]]:
        """Every group of the layout (same list on every rank, so creation order matches)."""
        out = []
        modules = (LLM,) if self.plan.colocated else (VISION, LLM)
        for module in modules:
            lay = self.layout(module)
            for stage in range(lay.pp):
                for replica in range(lay.dp):
                    out.append((f"{module}_tp", [self.rank_of(module, stage, replica, t) for t in range(lay.tp)]))
                for t in range(lay.tp):
                    out.append((f"{module}_dp", [self.rank_of(module, stage, r, t) for r in range(lay.dp)]))
        lay = self.plan.llm
        if self.tied_embeddings and lay.pp > 1:
            for replica in range(lay.dp):
                for t in range(lay.tp):
                    out.append(("tied_embedding", [self.rank_of(LLM, 0, replica, t),
                                                   self.rank_of(LLM, lay.pp - 1, replica, t)]))
        return out

    def create_groups(self) -> None:
        """Create every process group (collective: all ranks call it in the same order)."""
        for name, ranks in self._group_ranks():
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks and group is not None:
                setattr(self.groups, name, group)
        if self.plan.colocated:
            self.groups.vision_tp, self.groups.vision_dp = self.groups.llm_tp, self.groups.llm_dp

    def describe(self) -> str:
        parts = []
        for role in (self.vision_role, self.llm_role):
            if role is not None:
                parts.append(f"{role.module} stage {role.stage}/{role.n_stages} replica {role.replica}/"
                             f"{role.n_replicas} tp {role.tp_rank}/{role.tp}")
        return f"rank {self.rank}: " + "; ".join(parts)
