"""Per-stage costs of a layout as linear functions of the layers on each stage (mean shapes).

For one layout every stage ``s`` has ``value_s = fixed_s + per_layer_s * n_s`` for its time per
microbatch (forward + backward, seconds), its backward, its peak memory (bytes) and its gradient
bytes, where ``n_s`` is the number of layers the stage runs. The first stage of a module also holds
that module's first-stage extras, the last its last-stage extras, and in the colocated placement
the first LLM stage holds the whole vision tower. Transfers are charged to the receiving stage
(see `dflop.pricing.cluster`).

Memory of a stage (bytes per rank) is its training state plus ``in_flight`` microbatches of
activations (1F1B peak) plus the largest transient of the modules it runs on one microbatch (the
layers' one layer's, so it sits in the per-stage term: every stage holds at least one layer), and
must fit for two microbatches: the mean one (``nu`` mean samples) and one holding the heaviest
sample of the data (vision: its share per vision replica).

The pipeline step under mean shapes (`StageModel.objective_s`) is the 1F1B formula with
identical microbatches on heterogeneous stages, ``sum_s t_s + (m - 1) max_s t_s``, plus the
gradient all-reduce left over after the pipeline drains (stage ``s`` finishes its backwards about
``sum_{s' < s} b_s'`` before stage 0), plus ``2 (P - 1)`` hop latencies. It is an upper bound of
the simulated step of identical microbatches and tighter than the reference's
``(m + P - 1) max_s t_s``; the simulation over sampled batches makes the final choice.

Everything here broadcasts over numpy arrays so the search can score many layouts at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cached_property, lru_cache, reduce

import numpy as np

from dflop.costmodel.memory import sharded_state_scale
from dflop.costmodel.model import StepCosts
from dflop.plan import Layout, Plan, Techniques
from dflop.planner.means import Granularity, ModuleMeans, PartMeans
from dflop.pricing.cluster import Cluster, Links, links
from dflop.pricing.pool import Pool, TransferSizes
from dflop.pricing.pricing import stage_transfers
from dflop.pricing.stage import StageState, modules_state_of, stage_state_lines, stage_tails


@dataclass(frozen=True)
class StageCoeffs:
    """``fixed + per_layer * n`` coefficients of stages (arrays or scalars; seconds and bytes)."""

    time_fixed: np.ndarray
    time_layer: np.ndarray
    bwd_fixed: np.ndarray
    bwd_layer: np.ndarray
    mem_mean_fixed: np.ndarray
    mem_mean_layer: np.ndarray
    mem_max_fixed: np.ndarray
    mem_max_layer: np.ndarray
    grad_fixed: np.ndarray
    grad_layer: np.ndarray
    optim_fixed: np.ndarray  # seconds of the optimizer on the stage's parameters (NaN: not measured)
    optim_layer: np.ndarray

    def max_layers(self, memory_bytes):
        """Most layers each stage can hold within `memory_bytes` (may be negative: not even 0 fit)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            caps = [np.where(layer > 0, np.floor((memory_bytes - fixed) / np.where(layer > 0, layer, 1.0)),
                             np.where(fixed <= memory_bytes, np.inf, -1.0))
                    for fixed, layer in ((self.mem_mean_fixed, self.mem_mean_layer),
                                         (self.mem_max_fixed, self.mem_max_layer))]
        return np.minimum(*caps)


@dataclass(frozen=True)
class TransferMeans:
    """Mean bytes per sample that cross each kind of hop (see `TransferSizes`)."""

    feature_bytes: float  # vision features into the LLM (vision tokens x LLM hidden)
    llm_hop_bytes: float  # LLM hidden states between LLM stages (sequence tokens x hidden)
    vision_hop_bytes: float  # vision hidden states between vision stages (tiles x tile bytes)

    @classmethod
    def of(cls, pool: Pool, sizes: TransferSizes) -> "TransferMeans":
        return cls(float(pool.vision_tokens.mean()) * sizes.llm_token_bytes,
                   float(pool.seq_len.mean()) * sizes.llm_token_bytes,
                   float(pool.n_tiles.mean()) * sizes.vision_tile_bytes)


@dataclass(frozen=True)
class StageModel:
    """Linear per-stage costs of one layout (stages in pipeline order, vision first).

    is_vision: [P]; by_mode: {recompute mode: coefficients [P] with every stage in that mode},
    modes cheapest in time first (a colocated LLM stage 0 runs the vision tower in its own mode
    too: a stage is recomputed as a whole); ar_fixed / ar_layer: [P] seconds of each stage's tail
    after its last backward (``fixed + per_layer * n``: gradient sync, optimizer step and the
    step's world all-reduces, as `Pricing.allreduce_s` charges them); vision_layers / llm_layers: layers of each module (the colocated
    vision tower is inside LLM stage 0's fixed terms); memory_bytes: the per-GPU limit;
    shard: (vision, llm) whether the coefficients hold the optimizer state sharded over the
    module's replicas; sequence_parallel: whether the LLM layers run sequence-parallel.

    A split is ``n`` ([P] layers) and ``modes`` ([P] mode names, None: the cheapest everywhere).
    """

    layout: Layout
    is_vision: np.ndarray
    by_mode: Mapping
    ar_fixed: np.ndarray
    ar_layer: np.ndarray
    vision_layers: int
    llm_layers: int
    latency_s: float
    memory_bytes: float
    shard: tuple = (False, False)
    sequence_parallel: bool = False

    @property
    def n_stages(self) -> int:
        return len(self.is_vision)

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(self.by_mode)

    def coeffs_of(self, modes=None) -> StageCoeffs:
        """Coefficients with stage s in ``modes[s]`` (None: every stage in the cheapest mode).

        A mix of modes is selected stage by stage from the per-mode arrays, once per mix (the search
        asks a layout's memory and objective of one mix several times)."""
        if modes is None:
            return self.by_mode[self.modes[0]]
        modes = tuple(modes)
        if len(set(modes)) == 1:
            return self.by_mode[modes[0]]
        mixed = self.__dict__.setdefault("_mixed", {})  # frozen: a cache beside the fields, like cached_property
        if modes not in mixed:
            used = sorted(set(modes), key=self.modes.index)
            pick, stages = np.array([used.index(m) for m in modes]), np.arange(self.n_stages)
            mixed[modes] = StageCoeffs(*(np.stack([getattr(self.by_mode[m], f.name) for m in used])[pick, stages]
                                         for f in fields(StageCoeffs)))
        return mixed[modes]

    @property
    def coeffs(self) -> StageCoeffs:
        return self.coeffs_of(None)

    @cached_property
    def lean(self) -> StageCoeffs:
        """Per coefficient the smallest over the modes: memory no choice of modes goes below."""
        def least(arrays):  # np.minimum pairwise: np.min over a list cost more in call overhead than in work
            return reduce(np.minimum, arrays) if len(arrays) > 1 else np.array(arrays[0], dtype=np.float64)

        return StageCoeffs(**{f.name: least([getattr(c, f.name) for c in self.by_mode.values()])
                              for f in fields(StageCoeffs)})

    def stage_time_s(self, n, modes=None) -> np.ndarray:
        """[P] forward + backward seconds per microbatch of each stage holding n[s] layers."""
        c = self.coeffs_of(modes)
        return c.time_fixed + c.time_layer * np.asarray(n)

    def memory_at(self, n, modes=None) -> np.ndarray:
        """[P] peak bytes per rank (the larger of the mean and heaviest-sample microbatches)."""
        n, c = np.asarray(n), self.coeffs_of(modes)
        return np.maximum(c.mem_mean_fixed + c.mem_mean_layer * n, c.mem_max_fixed + c.mem_max_layer * n)

    def allreduce_at(self, n) -> np.ndarray:
        return self.ar_fixed + self.ar_layer * np.asarray(n)

    def objective_s(self, n, modes=None) -> float:
        """Mean-shape step seconds of the split n (module docstring)."""
        n, c = np.asarray(n), self.coeffs_of(modes)
        t = c.time_fixed + c.time_layer * n
        bwd = c.bwd_fixed + c.bwd_layer * n
        ahead = np.concatenate([[0.0], np.cumsum(bwd)[:-1]])
        tail = max(0.0, float(np.max(self.allreduce_at(n) - ahead)))
        m, p = self.layout.m, self.n_stages
        return float((m - 1) * t.max() + t.sum() + tail + 2 * (p - 1) * self.latency_s)

    def fits(self, n, modes=None) -> bool:
        return bool(np.all(self.memory_at(n, modes) <= self.memory_bytes))

    def lean_memory_at(self, n) -> np.ndarray:
        """[P] `memory_at` with every coefficient at its leanest over the modes (a floor)."""
        n, c = np.asarray(n), self.lean
        return np.maximum(c.mem_mean_fixed + c.mem_mean_layer * n, c.mem_max_fixed + c.mem_max_layer * n)

    def max_layers(self) -> np.ndarray:
        """[P] most layers each stage can hold in memory in its leanest mode."""
        return self.lean.max_layers(self.memory_bytes)

    def cheapest_fitting_modes(self, n) -> list[str] | None:
        """[P] per stage the fastest mode in which it fits with n[s] layers (stages are independent
        once the split is fixed); None when some stage fits in no mode."""
        fit = {m: self.memory_at(n, [m] * self.n_stages) <= self.memory_bytes for m in self.modes}
        out = []
        for s in range(self.n_stages):
            mode = next((m for m in self.modes if fit[m][s]), None)
            if mode is None:
                return None
            out.append(mode)
        return out

    def plan(self, n, modes=None) -> Plan:
        """The `Plan` of split n ([P] layers per stage) with its memory techniques."""
        n = [int(x) for x in n]
        modes = list(modes) if modes is not None else [self.modes[0]] * self.n_stages
        lay = self.layout
        pp_v = lay.n_vision_stages
        if lay.colocated:  # the vision tower runs in LLM stage 0's mode; its state shards with the LLM's
            vision = Techniques((modes[0],), self.shard[1])
        else:
            vision = Techniques(tuple(modes[:pp_v]), self.shard[0])
        llm = Techniques(tuple(modes[pp_v:]), self.shard[1], self.sequence_parallel)
        return Plan(lay, (self.vision_layers,) if lay.colocated else tuple(n[:pp_v]), tuple(n[pp_v:]),
                    vision_techniques=vision, llm_techniques=llm)

    def split_of(self, plan: Plan) -> np.ndarray:
        """[P] layers per stage of a plan (inverse of `plan`; an LLM rank's chunks summed)."""
        vision = () if self.layout.colocated else plan.vision_layers
        return np.array(vision + plan.llm_rank_layers)

    def modes_of(self, plan: Plan) -> list[str]:
        """[P] recompute mode per stage of a plan (inverse of `plan`)."""
        vision = () if self.layout.colocated else plan.vision_techniques.recompute
        return list(vision + plan.llm_rank_recompute())


class _ModeCoeffs(Mapping):
    """{recompute mode: StageCoeffs}, each computed on first use: the search builds a layout's model
    once per technique setting, and a setting tried only to see whether the split still fits
    without it reads one or two of the modes (`technique_choice.settle`)."""

    def __init__(self, modes: tuple[str, ...], compute):
        self._modes, self._compute, self._done = tuple(modes), compute, {}

    def __getitem__(self, mode: str) -> "StageCoeffs":
        if mode not in self._modes:
            raise KeyError(mode)
        if mode not in self._done:
            self._done[mode] = self._compute(mode)
        return self._done[mode]

    def __iter__(self):
        return iter(self._modes)

    def __len__(self) -> int:
        return len(self._modes)


def build_stage_model(layout: Layout, vision: ModuleMeans, llm: ModuleMeans, *, cluster: Cluster,
                      global_batch: int, transfer: TransferMeans,
                      granularity: Granularity = Granularity.none(), shard: tuple = (False, False),
                      dtype: str = "float32", step_costs: StepCosts = StepCosts()) -> StageModel:
    """The `StageModel` of a layout, from the module means at its TP degrees (the LLM's priced
    sequence-parallel or not), with each module's optimizer state sharded over its replicas where
    `shard` (vision, llm) says so (`dtype`: the training dtype, for the state's bytes).

    granularity: effective samples per LLM bin for times (default: the mean, nu);
    step_costs: the cost model's measured step costs on this cluster's device
    (`CostModel.step_costs_on`): the tails and links then price as `Pricing` does.
    """
    lay, B = layout, global_batch
    shard = (bool(shard[1]), bool(shard[1])) if lay.colocated else (bool(shard[0]), bool(shard[1]))
    modes = tuple(md for md in llm.modes if md in vision.modes)
    if not modes:
        raise ValueError(f"vision modes {vision.modes} and llm modes {llm.modes} share none")
    link = links(cluster, colocated=lay.colocated, tp_v=lay.tp_v, pp_v=lay.pp_v, dp_v=lay.dp_v,
                 tp_l=lay.tp_l, pp_l=lay.pp_l, dp_l=lay.dp_l, p2p=step_costs.p2p)
    # the state and the tail: `Pricing`'s composition at 0 and 1 layers per stage (`dflop.pricing.stage`)
    state, per_layer = _state_lines(lay, vision, llm)
    by_mode = _ModeCoeffs(modes, lambda md: _stage_coeffs(lay, vision, llm, link, B, transfer, granularity, shard,
                                                          dtype, md, state, per_layer))
    n_v = lay.n_vision_stages

    def tail(n):
        return stage_tails(lay, state.at(per_layer, n), shard=shard, tied_grad_bytes=llm.tied.grad_bytes, link=link,
                           cluster=cluster, measured=step_costs)

    ar_fixed = tail(0.0)
    ar_layer = tail(1.0) - ar_fixed
    return StageModel(layout=lay, is_vision=np.r_[np.ones(n_v, dtype=bool), np.zeros(lay.pp_l, dtype=bool)],
                      by_mode=by_mode, ar_fixed=ar_fixed, ar_layer=ar_layer,
                      vision_layers=vision.n_layers, llm_layers=llm.n_layers, latency_s=float(link.p2p_latency_s),
                      memory_bytes=cluster.gpu_memory_bytes, shard=shard,
                      sequence_parallel=llm.sequence_parallel)


_STATE_LINES: dict[tuple, tuple[StageState, StageState]] = {}


def _state_lines(lay: Layout, vision: ModuleMeans, llm: ModuleMeans) -> tuple[StageState, StageState]:
    """`stage_state_lines` of `lay`, cached read-only per what it reads: the placement, the stage
    counts, the modules' state functions (`ModuleMeans.state`, one per module and TP degree) and
    the tower's layers, not the DP degrees nor m; a search builds thousands of stage models over a
    few dozen such keys. (Bounded: cleared when full.)"""
    key = (lay.colocated, lay.n_vision_stages, lay.pp_l, vision.state, llm.state, vision.n_layers)
    lines = _STATE_LINES.get(key)
    if lines is None:
        lines = stage_state_lines(lay, modules_state_of(vision.state, llm.state), vision.n_layers)
        for line in lines:
            for a in (line.static_bytes, line.grad_bytes, line.param_bytes, line.optimizer_s):
                a.setflags(write=False)
        if len(_STATE_LINES) >= 1024:
            _STATE_LINES.clear()
        _STATE_LINES[key] = lines
    return lines


@lru_cache(maxsize=4096)
def _state_scale(dtype: str, dp: int) -> float:
    """`sharded_state_scale` of one replica count as a float, cached: a search builds thousands of stage
    models over a few hundred replica counts, and numpy's call overhead was most of the cost."""
    return float(sharded_state_scale(dtype, dp))


def _stage_coeffs(lay: Layout, vision: ModuleMeans, llm: ModuleMeans, link: Links, B: int,
                  transfer: TransferMeans, granularity: Granularity, shard: tuple, dtype: str,
                  mode: str, state: StageState, per_layer: StageState) -> StageCoeffs:
    """[P] coefficients of every stage of `lay` with all its layers in recompute `mode`.

    Per stage (`_stage_row`): the module's layer, first and last parts at the stage's microbatch
    (`_PartScalars`), the vision tower on a colocated LLM stage 0, the training state (`state` +
    `per_layer` * n, `dflop.pricing.stage.stage_state_lines`) scaled by sharding, the in-flight
    microbatches' activations, and the transfers added to the times (`stage_transfers`, where
    `Pricing` places them too).
    Evaluated stage by stage on Python floats: the search builds thousands of these for layouts of a
    few stages, where numpy's per-call overhead cost more than the arithmetic.
    `tests/planner/test_stage_coeffs_fast.py` holds it bit for bit against a whole-array numpy form.
    """
    m = lay.m
    in_flight = [float(f) for f in lay.in_flight()]
    n_v, pp_l = lay.n_vision_stages, lay.pp_l
    rows = []
    nu_v = B / (m * lay.dp_v)
    nu_l = B / (m * lay.dp_l)
    v_hop = v_out = 0.0
    if n_v:
        v_hop = nu_v * transfer.vision_hop_bytes / float(link.vision_hop_bps)
        v_out = nu_v * transfer.feature_bytes / float(link.vision_to_llm_bps)
    l_hop = nu_l * transfer.llm_hop_bytes / float(link.llm_hop_bps)
    l_in = 0.0 if lay.colocated else nu_l * transfer.feature_bytes / float(link.vision_to_llm_bps)
    fwd_s, bwd_s = stage_transfers(lay, vision_hop=v_hop, vision_features=v_out, llm_hop=l_hop, llm_features=l_in)
    # per stage (fixed, per layer) of (state bytes, gradient bytes, optimizer seconds), as floats
    states = list(zip(zip(state.static_bytes.tolist(), per_layer.static_bytes.tolist()),
                      zip(state.grad_bytes.tolist(), per_layer.grad_bytes.tolist()),
                      zip(state.optimizer_s.tolist(), per_layer.optimizer_s.tolist())))
    if n_v:
        scale = _state_scale(dtype, lay.dp_v) if shard[0] else 1.0
        parts = _PartScalars.of(vision.layers[mode or vision.modes[0]], nu_v, 1.0 / lay.dp_v, nu_v), \
            _PartScalars.of(vision.first, nu_v, 1.0 / lay.dp_v, nu_v), _PartScalars.of(vision.last, nu_v, 1.0 / lay.dp_v, nu_v)
        for k in range(n_v):
            rows.append(_stage_row(*parts, None, float(k == 0), float(k == n_v - 1), 0.0, in_flight[k], scale,
                                   fwd_s[k], bwd_s[k], states[k]))
    tnu = float(granularity.nu_time(nu_l, m))
    scale = _state_scale(dtype, lay.dp_l) if shard[1] else 1.0
    # colocated: the whole vision tower rides on LLM stage 0
    extra = _PartScalars.of(vision.whole(mode), nu_l, 1.0, tnu) if lay.colocated else None
    parts = (_PartScalars.of(llm.layers[mode or llm.modes[0]], nu_l, 1.0, tnu), _PartScalars.of(llm.first, nu_l, 1.0, tnu),
             _PartScalars.of(llm.last, nu_l, 1.0, tnu))
    for j in range(pp_l):
        rows.append(_stage_row(*parts, extra, float(j == 0), float(j == pp_l - 1), float(j == 0), in_flight[n_v + j],
                               scale, fwd_s[n_v + j], bwd_s[n_v + j], states[n_v + j]))
    table = np.array(rows, dtype=np.float64).T  # [fields, P]
    return StageCoeffs(*table)


@dataclass(frozen=True)
class _PartScalars:
    """A part's costs on one stage's microbatch (the `PartMeans` expressions, on Python floats):
    seconds (fwd + bwd, bwd) and bytes (activations of the mean and of the heaviest-sample
    microbatch, and the largest transient on either microbatch; the state is the stage's,
    `dflop.pricing.stage`)."""

    time: float
    bwd: float
    act_mean: float
    act_heaviest: float
    transient_mean: float
    transient_heaviest: float

    @classmethod
    def of(cls, part: PartMeans, nu: float, heaviest_share: float, time_nu: float) -> "_PartScalars":
        return cls(part.time_s(time_nu), part.bwd_s(time_nu), part.act_mean(nu), part.act_heaviest(heaviest_share),
                   part.transient_mean(nu), part.transient_heaviest(heaviest_share))


def _stage_row(layer: _PartScalars, first_part: _PartScalars, last_part: _PartScalars, extra: _PartScalars | None,
               first: float, last: float, extra_on: float, in_flight: float, scale: float, fwd_s: float,
               bwd_s: float, state: tuple) -> tuple[float, ...]:
    """One stage's `StageCoeffs` values in field order (the transfers `fwd_s` / `bwd_s` added last);
    `state`: the stage's (fixed, per-layer) pairs of state bytes, gradient bytes and optimizer
    seconds (`_stage_coeffs`); the largest transient of its parts (its layer's whatever their
    count) in its fixed memory."""
    F, H = first_part, last_part
    (f_static, l_static), (f_grad, l_grad), (f_optim, l_optim) = state
    f_time, f_bwd = first * F.time + last * H.time, first * F.bwd + last * H.bwd
    f_mean, f_max = first * F.act_mean + last * H.act_mean, first * F.act_heaviest + last * H.act_heaviest
    t_mean = max(layer.transient_mean, first * F.transient_mean, last * H.transient_mean)
    t_max = max(layer.transient_heaviest, first * F.transient_heaviest, last * H.transient_heaviest)
    if extra is not None:
        E = extra
        f_time, f_bwd = f_time + extra_on * E.time, f_bwd + extra_on * E.bwd
        f_mean, f_max = f_mean + extra_on * E.act_mean, f_max + extra_on * E.act_heaviest
        t_mean, t_max = max(t_mean, extra_on * E.transient_mean), max(t_max, extra_on * E.transient_heaviest)
    return (f_time + fwd_s + bwd_s, layer.time, f_bwd + bwd_s, layer.bwd,
            scale * f_static + in_flight * f_mean + t_mean, scale * l_static + in_flight * layer.act_mean,
            scale * f_static + in_flight * f_max + t_max, scale * l_static + in_flight * layer.act_heaviest,
            f_grad, l_grad, f_optim, l_optim)


def min_peak_split(sm: StageModel) -> tuple[np.ndarray, np.ndarray]:
    """The split with the smallest largest stage memory, and its [P] memory (bytes per rank).

    Each stage's memory grows with its layers, so giving every next layer to the stage whose
    memory after taking it is smallest minimises the maximum (per module, >= 1 layer per stage).
    Used to explain how far a layout is from fitting, so every stage is in its leanest mode.
    """
    n = np.ones(sm.n_stages, dtype=np.int64)
    for is_vision, total in ((True, sm.vision_layers), (False, sm.llm_layers)):
        stages = np.flatnonzero(sm.is_vision == is_vision)
        if len(stages) == 0:
            continue
        for _ in range(total - len(stages)):
            after = sm.lean_memory_at(n + 1)[stages]
            n[stages[int(np.argmin(after))]] += 1
    return n, sm.lean_memory_at(n)


def split_bound_s(sm: StageModel) -> float:
    """Lower bound of `objective_s` over the splits that fit in memory (inf when none does).

    Within a module every stage has the same seconds per layer, so the smallest bottleneck under
    the per-stage memory caps is reached by giving each next layer to the stage that is fastest
    after taking it among those with room left (water-filling, exact for min-max of increasing
    functions under upper bounds); the sum of stage times does not depend on the split, and the
    all-reduce tail is at least 0. Equal to the MILP optimum whenever that split has no tail.
    With recompute modes: memory caps of the leanest mode, times of the fastest (still a bound).
    """
    caps = sm.max_layers()
    if np.any(caps < 1):
        return float("inf")
    n = np.ones(sm.n_stages, dtype=np.int64)
    for is_vision, total in ((True, sm.vision_layers), (False, sm.llm_layers)):
        stages = np.flatnonzero(sm.is_vision == is_vision)
        if len(stages) == 0:
            continue
        heap = [(float(sm.coeffs.time_fixed[s] + 2 * sm.coeffs.time_layer[s]), int(s)) for s in stages if caps[s] >= 2]
        heapq.heapify(heap)
        for _ in range(total - len(stages)):
            if not heap:
                return float("inf")
            _, s = heapq.heappop(heap)
            n[s] += 1
            if n[s] < caps[s]:
                heapq.heappush(heap, (float(sm.coeffs.time_fixed[s] + (n[s] + 1) * sm.coeffs.time_layer[s]), s))
    t = sm.stage_time_s(n)
    return float((sm.layout.m - 1) * t.max() + t.sum() + 2 * (sm.n_stages - 1) * sm.latency_s)
