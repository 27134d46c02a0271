"""Which memory techniques a layout's stages use: the cheapest that make every stage fit.

The search space per layout (config ``planner.recompute`` / ``shard_optimizer`` /
``sequence_parallel``: ``auto`` lets the planner choose, a value forces it):

- a recompute mode per pipeline stage (none, selective, full; a colocated LLM stage 0 recomputes
  its vision tower in the same mode): chosen by the MILP (`dflop.planner.milp`), since a mode
  changes a stage's seconds as well as its bytes;
- optimizer sharding per module (over its data-parallel replicas, so only where dp > 1) and
  sequence parallelism for the LLM (only where tp > 1). Under the cost model both are free in time
  (a sharded module reduce-scatters gradients and all-gathers parameters: the bytes of the
  all-reduce it replaces; SP's reduce-scatter + all-gather are TP's all-reduce), so each layout is
  solved with both on wherever they apply, the leanest setting, and `settle` then switches off
  every one the chosen split does not need, and gives each stage the fastest mode it fits in.

So a technique is used only where a stage would not fit without it, and recompute only on the
stages that need it: under 1F1B the early stages hold more microbatches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dflop.costmodel.model import StepCosts, step_costs_on
from dflop.errors import UserError
from dflop.plan import RECOMPUTE_MODES, Layout
from dflop.planner.means import Granularity, ModuleMeans, module_means
from dflop.planner.screen import MemoryFloor
from dflop.planner.stages import StageModel, build_stage_model

AUTO = "auto"


@dataclass(frozen=True)
class TechniqueSpace:
    """What the search may choose: recompute modes (cheapest first) and whether optimizer sharding /
    sequence parallelism are chosen (``auto``), forced on (True) or off (False)."""

    modes: tuple[str, ...] = RECOMPUTE_MODES
    shard_optimizer: str | bool = AUTO
    sequence_parallel: str | bool = AUTO

    @classmethod
    def of(cls, recompute: str = AUTO, shard_optimizer: str | bool = AUTO,
           sequence_parallel: str | bool = AUTO) -> "TechniqueSpace":
        """From the config's planner keys (`dflop.config.PlannerSection`)."""
        if recompute != AUTO and recompute not in RECOMPUTE_MODES:
            raise UserError(f"planner.recompute must be auto or one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
        for key, value in (("shard_optimizer", shard_optimizer), ("sequence_parallel", sequence_parallel)):
            if value not in (AUTO, True, False):
                raise UserError(f"planner.{key} must be auto, true or false, got {value!r}")
        return cls(RECOMPUTE_MODES if recompute == AUTO else (recompute,), shard_optimizer, sequence_parallel)

    @property
    def can_shard(self) -> bool:
        return self.shard_optimizer is not False

    @property
    def can_sp(self) -> bool:
        return self.sequence_parallel is not False

    def leanest(self, dp_v: int, dp_l: int, tp_l: int) -> tuple[bool, bool, bool]:
        """(shard vision, shard llm, LLM SP): every technique on where it applies."""
        return self.can_shard and dp_v > 1, self.can_shard and dp_l > 1, self.can_sp and tp_l > 1

    def may_switch_off(self) -> tuple[bool, bool]:
        """(sharding, SP): whether `settle` may switch it off (not when forced on)."""
        return self.shard_optimizer == AUTO, self.sequence_parallel == AUTO


def settle(build, leanest: tuple[bool, bool, bool], n, space: TechniqueSpace,
           leanest_model: StageModel | None = None) -> tuple[StageModel, list[str]] | None:
    """The techniques split `n` runs with: every stage's fastest mode that fits under the leanest
    setting (a stage's memory depends on its own layers and mode only, so stages choose apart;
    modes are ordered fastest first), then sharding and SP switched off wherever the split still
    fits without them.

    build(shard_v, shard_l, sp) -> StageModel of the layout; leanest_model: ``build(*leanest)``
    when the caller has it already. Returns (StageModel of the chosen setting, [P] modes), or None
    when some stage fits in no mode.
    """
    sm = leanest_model if leanest_model is not None else build(*leanest)
    modes = sm.cheapest_fitting_modes(n)
    if modes is None:
        return None
    setting = tuple(leanest)
    off_shard, off_sp = space.may_switch_off()
    for index, allowed in ((2, off_sp), (1, off_shard), (0, off_shard)):  # SP, then LLM, then vision sharding
        if not (allowed and setting[index]):
            continue
        trial = tuple(False if i == index else v for i, v in enumerate(setting))
        candidate = build(*trial)
        if candidate.fits(n, modes):
            sm, setting = candidate, trial
    return sm, modes


@dataclass(frozen=True)
class TechniqueMeans:
    """The module means the search prices layouts with, per TP degree and technique setting.

    vision: {tp: ModuleMeans} with every recompute mode of the space; llm: {(tp, sequence
    parallel): ModuleMeans} likewise (SP entries only where tp > 1 and SP may be used);
    step_costs: the cost model's measured step costs (`CostModel.step_costs`), which a layout's
    stage model uses where they hold on its cluster (`CostModel.step_costs_on`).
    """

    vision: dict
    llm: dict
    space: TechniqueSpace
    dtype: str
    step_costs: StepCosts = StepCosts()
    profiled_on: str = ""
    _models: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # `stage_model`'s

    @classmethod
    def of(cls, cost, pool, shape, vision_tps, llm_tps, space: TechniqueSpace) -> "TechniqueMeans":
        vision = {t: module_means(cost, "vision", t, pool, shape.vision_layers, modes=space.modes)
                  for t in vision_tps}
        llm = {}
        for t in llm_tps:
            llm[(t, False)] = module_means(cost, "llm", t, pool, shape.llm_layers, modes=space.modes)
            if space.can_sp and t > 1:
                llm[(t, True)] = module_means(cost, "llm", t, pool, shape.llm_layers, modes=space.modes,
                                              sequence_parallel_hidden=shape.llm_hidden)
        return cls(vision, llm, space, cost.provenance.dtype, cost.step_costs, cost.provenance.device)

    def for_times(self) -> tuple[dict, dict]:
        """({tp: vision}, {tp: llm}) whose cheapest mode bounds every setting's seconds (SP and
        sharding cost no time in the model)."""
        return self.vision, {t: m for (t, sp), m in self.llm.items() if not sp}

    def floor(self) -> MemoryFloor:
        """The least memory of each module at each TP degree (`MemoryFloor`)."""
        vision = {t: _leanest(m) for t, m in self.vision.items()}
        llm = {t: _leanest(self.llm.get((t, True), m)) for (t, sp), m in self.llm.items() if not sp}
        return MemoryFloor(vision, llm, self.dtype, self.space.can_shard)

    def leanest(self, layout: Layout) -> tuple[bool, bool, bool]:
        dp_v = layout.dp_l if layout.colocated else layout.dp_v
        return self.space.leanest(dp_v, layout.dp_l, layout.tp_l)

    def stage_model(self, layout: Layout, setting: tuple[bool, bool, bool], *, cluster, global_batch: int,
                    transfer, granularity: Granularity = Granularity.none()) -> StageModel:
        """The `StageModel` of `layout` with (shard vision, shard llm, LLM SP) = `setting`.

        Built once per (layout, setting) and the same cluster, batch, transfers and granularity: the
        data-aware search and both data-blind baselines ask for many of the same models."""
        key = (layout, tuple(bool(x) for x in setting), global_batch)
        ctx = (cluster, transfer, granularity)
        hit = self._models.get(key)
        if hit is not None and all(a is b or a == b for a, b in zip(hit[0], ctx)):
            return hit[1]
        shard_v, shard_l, sp = setting
        sm = build_stage_model(layout, self.vision[layout.tp_v], self.llm[(layout.tp_l, bool(sp))],
                               cluster=cluster, global_batch=global_batch, transfer=transfer,
                               granularity=granularity, shard=(shard_v, shard_l), dtype=self.dtype,
                               step_costs=step_costs_on(self.step_costs, self.profiled_on, cluster.device))
        self._models[key] = (ctx, sm)
        return sm

    def fit(self, layout: Layout, n, leanest_model: StageModel | None = None, **kw) -> tuple[StageModel, list[str]] | None:
        """`settle` split `n` of `layout` (keywords: `stage_model`'s; leanest_model: the layout's
        model under `leanest`, when already built)."""
        return settle(lambda *setting: self.stage_model(layout, setting, **kw), self.leanest(layout), n, self.space,
                      leanest_model)


def _leanest(means: ModuleMeans) -> ModuleMeans:
    """`means` with only its leanest layer (the fewest activation bytes kept for backward), its
    transient the least of every mode's (recomputation keeps fewer bytes but holds more while a
    layer's backward reruns its forward), so that no mode needs less memory."""
    mode = min(means.modes, key=lambda m: (means.layers[m].act_mean_bytes, means.layers[m].act_max_bytes))
    layer = means.layers[mode].with_transient_floor(means.layers.values())
    return replace(means, layers={mode: layer})
