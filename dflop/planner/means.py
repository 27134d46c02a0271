"""The data's shapes and each module part's costs averaged over them (what the search optimises).

Every fitted cost is a per-microbatch constant plus a sum of per-sample terms
(`dflop.costmodel.types`), so the mean time of a microbatch of ``nu`` samples drawn from the data
is exactly ``const + nu * mean per-sample term``. `PartMeans` keeps those two numbers for one part
(one layer, or the first/last-stage extras) of one module at one TP degree, and the largest single
sample's activation bytes, which any microbatch holding that sample must fit; and the same three
numbers of each of its modules' transient bytes, of which a stage holds only the largest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import reduce

import numpy as np

from dflop.costmodel.model import CostModel, StageTerms
from dflop.errors import UserError
from dflop.plan import RECOMPUTE_MODES
from dflop.pricing.pool import Pool
from dflop.pricing.stage import module_state_of


@dataclass(frozen=True)
class PartMeans:
    """One part of a module at one TP degree: per-microbatch constants and per-sample means.

    Seconds (forward, backward) and bytes (activations kept until the backward, per rank);
    act_max_bytes is the largest single sample's activation bytes; static_bytes is parameters +
    gradients + optimizer state, grad_bytes the gradients alone (what the all-reduce moves);
    optimizer_s the optimizer step's seconds on its parameters (`StageTerms.optimizer_s`, NaN
    when not measured).

    transients: one (constant, mean per sample, largest sample) line per module of the part, its
    transient bytes (`dflop.costmodel.model.StageMemory`); a stage holds the largest of its parts'
    lines, not their sum, so parts added together keep every line and scaled ones keep theirs (k
    layers run one after another).
    """

    fwd_const_s: float = 0.0
    bwd_const_s: float = 0.0
    fwd_mean_s: float = 0.0
    bwd_mean_s: float = 0.0
    act_const_bytes: float = 0.0
    act_mean_bytes: float = 0.0
    act_max_bytes: float = 0.0
    static_bytes: float = 0.0
    grad_bytes: float = 0.0
    optimizer_s: float = 0.0
    transients: tuple = ()

    @classmethod
    def from_terms(cls, terms: StageTerms) -> "PartMeans":
        """The part whose one module's terms these are (its transient line is then exact)."""
        return cls(
            fwd_const_s=terms.fwd_const_s, bwd_const_s=terms.bwd_const_s,
            fwd_mean_s=float(np.mean(terms.fwd_s)), bwd_mean_s=float(np.mean(terms.bwd_s)),
            act_const_bytes=terms.act_const_bytes, act_mean_bytes=float(np.mean(terms.act_bytes)),
            act_max_bytes=float(np.max(terms.act_bytes)),
            static_bytes=terms.static.static_bytes, grad_bytes=terms.static.grad_bytes,
            optimizer_s=terms.optimizer_s,
            transients=((float(terms.transient_const_bytes), float(np.mean(terms.transient_bytes)),
                         float(np.max(terms.transient_bytes))),),
        )

    def time_s(self, nu):
        """Forward + backward seconds on a microbatch of `nu` samples (mean shapes)."""
        return self.fwd_const_s + self.bwd_const_s + nu * (self.fwd_mean_s + self.bwd_mean_s)

    def bwd_s(self, nu):
        return self.bwd_const_s + nu * self.bwd_mean_s

    def act_mean(self, nu):
        """Activation bytes of a microbatch of `nu` mean samples."""
        return self.act_const_bytes + nu * self.act_mean_bytes

    def act_heaviest(self, share=1.0):
        """Activation bytes of a microbatch holding `share` of the heaviest sample."""
        return self.act_const_bytes + share * self.act_max_bytes

    def transient_mean(self, nu):
        """The largest transient bytes of the part's modules on a microbatch of `nu` mean samples."""
        return _largest([c + nu * mean for c, mean, _ in self.transients], nu)

    def transient_heaviest(self, share=1.0):
        """The same on a microbatch holding `share` of the heaviest sample (as `act_heaviest`)."""
        return _largest([c + share * top for c, _, top in self.transients], share)

    def __add__(self, other: "PartMeans") -> "PartMeans":
        return PartMeans(*(a + b for a, b in zip(_values(self), _values(other))),
                         transients=self.transients + other.transients)

    def scaled(self, k: float) -> "PartMeans":
        return PartMeans(*(k * a for a in _values(self)), transients=self.transients)

    def with_transient_floor(self, parts) -> "PartMeans":
        """This part with one transient line, each number the least of `parts`' lines (a floor of
        any of their transients: `dflop.planner.technique_choice`'s leanest layer)."""
        lines = [line for part in parts for line in part.transients]
        return replace(self, transients=(tuple(min(values) for values in zip(*lines)),) if lines else ())


def _largest(values: list, like):
    """The element-wise largest of `values` (Python floats stay floats: the planner's stage model
    evaluates these per stage on floats); 0 (shaped like `like`) when there is none."""
    if not values:
        return 0.0 * like
    if isinstance(like, float) or np.ndim(like) == 0:  # the float test first: np.ndim costs more than max
        return max(values)
    return reduce(np.maximum, values)


def _values(p: PartMeans) -> tuple[float, ...]:
    return (p.fwd_const_s, p.bwd_const_s, p.fwd_mean_s, p.bwd_mean_s, p.act_const_bytes, p.act_mean_bytes,
            p.act_max_bytes, p.static_bytes, p.grad_bytes, p.optimizer_s)


@dataclass(frozen=True)
class ModuleMeans:
    """A module (vision tower or LLM) at one TP degree: one layer, the first-stage extras
    (vision embeddings / token embeddings) and the last-stage extras (projector / norm, head, loss).

    layers: one layer under each recompute mode the search may use, cheapest in time first
    (none, selective, full); sequence_parallel: whether these LLM layers run sequence-parallel
    (their activations are priced so); tied: the training state a stage holding both the first and
    the last parts holds once, not twice (a tied LM head: `CostModel.tied_llm_state`; else zeros);
    state: (layers, first, last) -> (training state, optimizer seconds) of a stage of the module
    (`dflop.pricing.stage.module_state_of`: the stage model's state and tails come from the one
    composition `Pricing` uses, `dflop.pricing.stage`).
    """

    module: str
    tp: int
    n_layers: int
    layers: dict
    first: PartMeans
    last: PartMeans
    sequence_parallel: bool = False
    tied: PartMeans = PartMeans()
    state: Callable = field(default=None, repr=False, compare=False)

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(self.layers)

    @property
    def layer(self) -> PartMeans:
        """The layer in the cheapest mode (the fastest; what time bounds use)."""
        return self.layers[self.modes[0]]

    def whole(self, mode: str | None = None) -> PartMeans:
        """The whole module on one stage (what the colocated first LLM stage carries)."""
        return self.layers[mode or self.modes[0]].scaled(self.n_layers) + self.first + self.last + self.tied.scaled(-1.0)


def module_means(cost: CostModel, module: str, tp: int, pool: Pool, n_layers: int, *,
                 modes: tuple[str, ...] = ("none",), sequence_parallel_hidden: int = 0) -> ModuleMeans:
    """`ModuleMeans` of "vision" or "llm" at `tp` over the pool's samples, with its layer under each
    of `modes` the cost model can price (a profile from before the profiler measured the recompute
    modes prices none: the others are left out, or the one-line error when none is left) and, for
    the LLM, sequence-parallel when `sequence_parallel_hidden` > 0 and tp > 1."""
    if module == "vision":
        sizes, terms, extra = pool.n_tiles, cost.vision_stage_terms, {}
    elif module == "llm":
        sizes, terms = pool.seq_len, cost.llm_stage_terms
        extra = {"sequence_parallel_hidden": sequence_parallel_hidden} if sequence_parallel_hidden and tp > 1 else {}
    else:
        raise ValueError(f"module must be 'vision' or 'llm', got {module!r}")

    def part(n, first, last, mode="none"):
        return PartMeans.from_terms(terms(sizes, n_layers=n, first=first, last=last, tp=tp, recompute=mode, **extra))

    layers, error = {}, None
    for mode in (m for m in RECOMPUTE_MODES if m in modes):
        try:
            layers[mode] = part(1, False, False, mode)
        except UserError as exc:
            error = exc
    if not layers:
        raise error or UserError(f"no recompute mode to price among {list(modes)}")
    tied = PartMeans()
    if module == "llm":
        state = cost.tied_llm_state(tp)
        tied = PartMeans(static_bytes=state.static_bytes, grad_bytes=state.grad_bytes,
                         optimizer_s=cost.tied_llm_optimizer_s(tp))
    return ModuleMeans(module, int(tp), int(n_layers), layers, first=part(0, True, False), last=part(0, False, True),
                       sequence_parallel=bool(extra), tied=tied, state=module_state_of(cost, module, tp))


@dataclass(frozen=True)
class Granularity:
    """Effective samples per LLM bin for stage *times*: the data's heaviest samples cannot be split.

    A bin holding the heaviest of the B/m samples of its microbatch takes at least as long as that
    sample, so the microbatch's bottleneck bin costs at least ``max(nu, E[max of B/m costs] / mean)``
    mean samples (nu = samples per bin). The expectation is over random microbatches of the data
    (order statistics with replacement). Memory keeps its own heaviest-sample bound.

    ratio: {m: E[max per-sample LLM cost among B/m samples] / mean per-sample cost}.
    """

    ratio: dict

    @classmethod
    def of(cls, sample_cost: np.ndarray, global_batch: int, microbatches) -> "Granularity":
        x = np.sort(np.asarray(sample_cost, dtype=np.float64))
        n, mean = len(x), float(np.mean(sample_cost))
        grid = np.arange(n + 1) / n
        ratio = {}
        for m in microbatches:
            k = max(1, int(global_batch) // int(m))
            weights = np.diff(grid ** k)  # P(the max of k draws is the i-th smallest)
            ratio[int(m)] = float(weights @ x) / mean if mean > 0 else 0.0
        return cls(ratio)

    @classmethod
    def none(cls) -> "Granularity":
        return cls({})

    def nu_time(self, nu, m):
        """Effective samples per bin for times (same shape as nu; m scalar or array)."""
        if not self.ratio:
            return nu
        if np.ndim(m) == 0:
            return np.maximum(nu, self.ratio.get(int(m), 0.0))
        values, index = np.unique(np.asarray(m), return_inverse=True)  # the screen passes every layout's m
        floor = np.array([self.ratio.get(int(mm), 0.0) for mm in values], dtype=np.float64)[index.reshape(np.shape(m))]
        return np.maximum(nu, floor)
