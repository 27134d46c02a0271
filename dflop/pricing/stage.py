"""A stage's fixed terms: the training state every stage of a layout holds and the tail it pays.

The one composition for `Pricing` (at a plan's split) and the planner's linear stage model
(`dflop.planner.stages.build_stage_model`, whose ``fixed + per_layer * n`` state and tail
coefficients are this composition at 0 and at 1 layer per stage, `stage_state_lines`):

- which parts a stage holds, and their training state and optimizer seconds: the cost model's
  stage terms (`CostModel.vision_stage_terms` / `llm_stage_terms`: the layers, the first- and
  last-stage extras, a tied head's weight once beside the embedding), through a `StateOf`;
- the colocated vision tower, whole, on LLM stage 0 (`stage_state`);
- the tail after the stage's last backward (`stage_tails`: gradient sync and optimizer step,
  `dflop.pricing.tail.stage_tails_s`, plus the step's extras, `step_extras_s`).

A new term of a stage's state or tail is added here (or in the cost model's stage terms) once, and
both sides move (`tests/planner/test_stage_model_agrees_with_pricing.py`). Bytes per rank; seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dflop.costmodel.model import CostModel, StageMemory, StepCosts
from dflop.plan import Layout
from dflop.pricing.cluster import Cluster, Links
from dflop.pricing.tail import stage_tails_s, step_extras_s

# (module "vision" | "llm", layers, holds the first-stage extras, holds the last-stage extras) ->
# (training state of one rank of such a stage, unsharded; its optimizer seconds, NaN: unmeasured)
StateOf = Callable[[str, int, bool, bool], tuple[StageMemory, float]]


@dataclass(frozen=True)
class StageState:
    """[P] per stage of a layout (vision stages first), one rank, unsharded: training state bytes
    (parameters, gradients, optimizer state), gradient bytes (what its data-parallel all-reduce
    moves), parameter bytes (what a sharded stage all-gathers) and optimizer seconds
    (`StageTerms.optimizer_s`; NaN where a part was not measured)."""

    static_bytes: np.ndarray
    grad_bytes: np.ndarray
    param_bytes: np.ndarray
    optimizer_s: np.ndarray

    def at(self, per_layer: "StageState", n) -> "StageState":
        """``self + per_layer * n`` (n: [P] layers or a scalar): a line's value at a split. An
        unmeasured per-layer optimizer (NaN) makes the optimizer seconds NaN at 0 layers too, so
        the tail prices the module's every stage on the bytes line at any split, as `Pricing` does."""
        n = np.asarray(n, dtype=np.float64)
        return StageState(self.static_bytes + per_layer.static_bytes * n, self.grad_bytes + per_layer.grad_bytes * n,
                          self.param_bytes + per_layer.param_bytes * n, self.optimizer_s + per_layer.optimizer_s * n)

    def __sub__(self, other: "StageState") -> "StageState":
        return StageState(self.static_bytes - other.static_bytes, self.grad_bytes - other.grad_bytes,
                          self.param_bytes - other.param_bytes, self.optimizer_s - other.optimizer_s)


def module_state_of(cost: CostModel, module: str, tp: int) -> Callable[[int, bool, bool], tuple[StageMemory, float]]:
    """(layers, first, last) -> (state, optimizer seconds) of a `module` ("vision" or "llm") stage
    at `tp`, from `cost`'s stage terms; cached per question (the planner asks the same few for
    every layout)."""
    terms_of = cost.vision_stage_terms if module == "vision" else cost.llm_stage_terms
    sample = [0] if module == "vision" else [1]  # the state does not depend on the samples

    @lru_cache(maxsize=None)
    def state(n_layers: int, first: bool, last: bool) -> tuple[StageMemory, float]:
        terms = terms_of(sample, n_layers=n_layers, first=first, last=last, tp=tp)
        return terms.static, terms.optimizer_s

    return state


def cost_state_of(cost: CostModel, tp_v: int, tp_l: int) -> StateOf:
    """The `StateOf` of `cost`, the vision tower at `tp_v` and the LLM at `tp_l`."""
    return modules_state_of(module_state_of(cost, "vision", tp_v), module_state_of(cost, "llm", tp_l))


def modules_state_of(vision, llm) -> StateOf:
    """The `StateOf` asking `vision` or `llm` ((layers, first, last) -> state, `module_state_of`)."""
    return lambda module, n_layers, first, last: (vision if module == "vision" else llm)(n_layers, first, last)


def stage_state(layout: Layout, state_of: StateOf, vision_layers: Sequence[int], llm_layers: Sequence[int]) -> StageState:
    """[P] state of every stage of `layout` holding these layers: ``vision_layers`` per vision stage
    (colocated: one entry, the whole tower, which LLM stage 0 holds beside its own), ``llm_layers``
    per LLM pipeline rank (an interleaved rank's chunks together)."""
    pp_l = len(llm_layers)
    vision = [] if layout.colocated else \
        [one_stage_state(state_of, "vision", n, k == 0, k == len(vision_layers) - 1) for k, n in enumerate(vision_layers)]
    tower = vision_layers[0] if layout.colocated else None
    llm = [one_stage_state(state_of, "llm", n, j == 0, j == pp_l - 1, tower if j == 0 else None)
           for j, n in enumerate(llm_layers)]
    return StageState(*(np.array(values, dtype=np.float64) for values in zip(
        *((s.static_bytes, s.grad_bytes, s.param_bytes, optim) for s, optim in vision + llm))))


def one_stage_state(state_of: StateOf, module: str, n_layers: int, first: bool, last: bool,
                    tower_layers: int | None = None) -> tuple[StageMemory, float]:
    """(state, optimizer seconds) of one stage of `module` (`stage_state`'s rule, for the planner's
    screen, which asks it per kind of stage): with `tower_layers`, the first LLM stage of a
    colocated layout, which also holds the vision tower whole."""
    static, optim = state_of(module, int(n_layers), bool(first), bool(last))
    if tower_layers is not None:
        v_static, v_optim = state_of("vision", int(tower_layers), True, True)
        static, optim = static + v_static, optim + v_optim
    return static, optim


def stage_state_lines(layout: Layout, state_of: StateOf, vision_layers: int) -> tuple[StageState, StageState]:
    """(fixed, per_layer): `stage_state` with 0 layers on every stage of a module, and what one more
    layer on every stage adds (the state at 1 layer less that at 0). `vision_layers`: the tower's
    layers, held whole in the fixed part of a colocated LLM stage 0."""
    n_v, pp_l = layout.n_vision_stages, layout.pp_l
    tower = (vision_layers,) if layout.colocated else None
    fixed = stage_state(layout, state_of, tower or (0,) * n_v, (0,) * pp_l)
    one = stage_state(layout, state_of, tower or (1,) * n_v, (1,) * pp_l)
    return fixed, one - fixed


def stage_tails(layout: Layout, state: StageState, *, shard: tuple, tied_grad_bytes: float, link: Links,
                cluster: Cluster, measured: StepCosts) -> np.ndarray:
    """[P] seconds every stage spends after its last backward: its gradient sync and optimizer step
    (`stage_tails_s` on `state`; `shard`: (vision, llm) state sharded over the replicas, colocated:
    the LLM's for both) and the step's extras (`step_extras_s`: world all-reduces, the tied
    embedding's pair sum). Affine in the state (the planner evaluates it at 0 and 1 layers)."""
    tails = stage_tails_s(layout, state.grad_bytes, state.param_bytes, state.optimizer_s, shard=shard,
                          tied_grad_bytes=tied_grad_bytes, link=link, cluster=cluster, measured=measured)
    return tails + step_extras_s(layout, tied_grad_bytes, cluster=cluster, measured=measured)
