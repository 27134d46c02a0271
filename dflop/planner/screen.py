"""Score every layout of the search space at once: exact memory feasibility and a lower bound.

A layout's MILP (`dflop.planner.milp`) is only worth solving if some layer split fits in memory
and its objective could beat the plans already found. Both questions have cheap exact answers
over whole arrays of layouts:

- Memory: each stage's constraints only bound its own layer count, ``n_s <= cap_s``, so a split
  exists iff every ``cap_s >= 1`` and ``sum_s min(cap_s, L) >= L`` per module. The caps are those
  of the leanest memory-technique setting (`MemoryFloor`): a layout is dropped only when no
  setting fits; the MILP then chooses the techniques.
- Lower bound on the MILP objective: ``sum_s t_s`` does not depend on the split (layers move
  between stages, their time does not change) and ``max_s t_s`` is at least the module's total over
  its stages and at least one layer plus the heavier extras, so
  ``(m - 1) * max(T_v, T_l) + sum_s t_s + 2 (P - 1) * latency`` never exceeds the MILP optimum.

Layouts are generated per module and joined: the LLM side (tp_l, pp_l, dp_l, m) once, then for each
vision (tp_v, pp_v) the disjoint vision side takes every GPU the LLM leaves (``dp_v`` as large as
fits, at most one vision replica per tile of the mean microbatch: more would idle). The colocated
placement uses the largest ``dp_l`` that fits the cluster and the global batch (more replicas only
shrink the bins). Either way only layouts `Cluster.launchable` allows are kept (whole nodes, LLM
TP groups inside a node). Layouts of one group (placement, tp_v, pp_v, tp_l, pp_l, m) differ only
in their dp split; `ScreenResult.groups` summarises each group for candidates.parquet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dflop.costmodel.memory import sharded_state_scale
from dflop.plan import Layout
from dflop.pricing.cluster import Cluster
from dflop.planner.means import Granularity, ModuleMeans
from dflop.planner.stages import TransferMeans
from dflop.pricing.stage import modules_state_of, one_stage_state
from dflop.pricing.cluster import links

LAYOUT_COLUMNS = ("colocated", "tp_v", "pp_v", "dp_v", "tp_l", "pp_l", "dp_l", "m")


@dataclass(frozen=True)
class SearchSpace:
    """What the screen enumerates (all validated by `dflop.planner.space`).

    vision_tp / llm_tp: admissible TP degrees (dividing heads, inside a node, profiled);
    colocated_tp: LLM TP degrees the vision tower can share in the colocated placement (empty
    when that placement is not searched); shared_tp: the same whatever the placements (for the
    data-blind baseline's colocated layouts); microbatches: candidate m; placements: subset
    of ("disjoint", "colocated").
    """

    vision_tp: tuple[int, ...]
    llm_tp: tuple[int, ...]
    colocated_tp: tuple[int, ...]
    shared_tp: tuple[int, ...]
    microbatches: tuple[int, ...]
    placements: tuple[str, ...]
    vision_layers: int
    llm_layers: int
    global_batch: int
    mean_tiles: float  # tiles per sample, mean over the data


@dataclass(frozen=True)
class ScreenResult:
    """Feasible layouts with their lower bounds, best first, and one summary row per group.

    layouts: DataFrame with LAYOUT_COLUMNS + ``bound_s`` (the best `keep` feasible layouts);
    groups: DataFrame, one row per (colocated, tp_v, pp_v, tp_l, pp_l, m) with ``n_layouts``,
    ``n_fit`` (memory-feasible), ``bound_s`` and the dp_v/dp_l of its best feasible layout (NaN
    when none), ``llm_fits`` / ``vision_fits`` (whether any of its layouts fits on that side).
    n_layouts / n_feasible: totals over the space.
    """

    layouts: pd.DataFrame
    groups: pd.DataFrame
    n_layouts: int
    n_feasible: int


@dataclass
class _Side:
    """Arrays of one module side of many layouts (filled by `_llm_side`)."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    m: np.ndarray
    nu: np.ndarray
    layer_s: np.ndarray  # one layer's seconds per microbatch
    extras_s: np.ndarray  # first + last extras (and the colocated vision tower) per microbatch
    max_extra_s: np.ndarray  # the heavier of the first-stage and last-stage fixed terms
    fits: np.ndarray
    bottleneck_s: np.ndarray  # smallest bottleneck of a split within the memory caps (0 where none fits)

    def take(self, index) -> "_Side":
        return _Side(*(getattr(self, f)[index] for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class MemoryFloor:
    """The least memory any setting of the memory techniques leaves a stage (`technique_choice`):
    the modules' layers in their leanest recompute mode (the LLM's sequence-parallel where it may
    be), the training state sharded over the replicas where sharding may be used. A layout no
    setting fits is rejected here; the others are fitted exactly by the MILP.

    vision / llm: {tp: ModuleMeans} whose `layer` is the leanest; shard: whether sharding may be used.
    """

    vision: dict
    llm: dict
    dtype: str = "float32"
    shard: bool = False

    def state_scale(self, dp):
        dp = np.asarray(dp, dtype=np.float64)
        return sharded_state_scale(self.dtype, dp) if self.shard else np.ones_like(dp)

    @classmethod
    def none(cls, vision: dict, llm: dict) -> "MemoryFloor":
        """No techniques: the means as they are."""
        return cls(vision, llm)


def module_fits(means: ModuleMeans, n_layers: int, memory: float, *, nu, heaviest_share, pp, in_flight,
                tower: ModuleMeans | None = None, return_caps: bool = False, state_scale=1.0):
    """[rows] whether some split of `n_layers` layers (>= 1 per stage) fits in `memory` bytes.

    nu, heaviest_share, pp: [rows]; in_flight: [rows, P] microbatches stage k holds (P >= pp.max());
    tower: the vision tower's means when the first stage also holds it whole, on `nu` samples (the
    colocated placement). Same memory model as `dflop.planner.stages._stage_coeffs`, on a [rows,
    stages] grid: the training state of each kind of stage (first, last, both, neither) from
    `dflop.pricing.stage.one_stage_state` at 0 and 1 layers, as the stage model takes it; the layer
    is `means.layer` (pass lean means for the least memory); state_scale: [rows] or scalar
    fraction of the training state held (optimizer sharding). With return_caps, also the [rows, P]
    most layers each stage holds (0 past the last stage).
    """
    nu, share = np.asarray(nu, dtype=np.float64)[:, None], np.asarray(heaviest_share, dtype=np.float64)[:, None]
    pp = np.asarray(pp)[:, None]
    k = np.arange(in_flight.shape[1])[None, :]
    first, last, valid = (k == 0), (k == pp - 1), (k < pp)
    F, H, Ly = means.first, means.last, means.layer
    scale = np.asarray(state_scale, dtype=np.float64).reshape(-1, 1) if np.ndim(state_scale) else float(state_scale)
    static, layer_static = _state_grid(means, tower, first, last)
    act_mean = first * F.act_mean(nu) + last * H.act_mean(nu)
    act_max = first * F.act_heaviest(share) + last * H.act_heaviest(share)
    # the largest transient of the stage's parts (its layer's on every stage)
    t_mean = np.maximum.reduce([Ly.transient_mean(nu) + 0.0 * first, first * F.transient_mean(nu),
                                last * H.transient_mean(nu)])
    t_max = np.maximum.reduce([Ly.transient_heaviest(share) + 0.0 * first, first * F.transient_heaviest(share),
                               last * H.transient_heaviest(share)])
    if tower is not None:
        extra = tower.whole()
        act_mean = act_mean + first * extra.act_mean(nu)
        act_max = act_max + first * extra.act_heaviest(1.0)
        t_mean = np.maximum(t_mean, first * extra.transient_mean(nu))
        t_max = np.maximum(t_max, first * extra.transient_heaviest(1.0))
    f = in_flight
    static, layer_static = scale * static, scale * layer_static
    caps = np.minimum(_cap(memory - static - f * act_mean - t_mean, layer_static + f * Ly.act_mean(nu)),
                      _cap(memory - static - f * act_max - t_max, layer_static + f * Ly.act_heaviest(share)))
    caps = np.where(valid, np.clip(caps, 0, n_layers), 0)
    ok = (caps.sum(axis=1) >= n_layers) & np.where(valid, caps >= 1, True).all(axis=1)
    return (ok, caps) if return_caps else ok


def _state_grid(means: ModuleMeans, tower: ModuleMeans | None, first: np.ndarray, last: np.ndarray):
    """(fixed, per-layer) training state bytes of every stage of a [rows, stages] grid, by its kind
    (`first` / `last` masks): `one_stage_state` at 0 layers and what 1 layer adds, the colocated
    `tower` on the first stage (the numbers `stage_state_lines` gives the stage model)."""
    vision = means if means.module == "vision" else tower
    state_of = modules_state_of(vision.state if vision is not None else None, means.state)
    fixed, layer = np.zeros(np.broadcast(first, last).shape), np.zeros(np.broadcast(first, last).shape)
    for f, l in ((False, False), (True, False), (False, True), (True, True)):
        held = [one_stage_state(state_of, means.module, n, f, l, tower.n_layers if f and tower is not None else None)[0]
                for n in (0, 1)]
        at0, at1 = (s.static_bytes for s in held)
        kind = (first == f) & (last == l)
        fixed, layer = np.where(kind, at0, fixed), np.where(kind, at1 - at0, layer)
    return fixed, layer


def min_bottleneck_s(caps: np.ndarray, n_layers: int, layer_s, first_s, last_s, pp, *, iters: int = 40) -> np.ndarray:
    """[rows] a lower bound (within 1e-9 relative) of the smallest bottleneck over splits within `caps`.

    Stage k of a row runs ``fixed_k + layer_s * n_k`` seconds (fixed: first-stage extras on stage 0,
    last-stage extras on the last; transfers left out, so it stays a lower bound). A bottleneck T is
    reachable iff ``sum_k min(caps_k, floor((T - fixed_k) / layer_s)) >= n_layers``; bisection on T.
    """
    pp = np.asarray(pp)[:, None]
    k = np.arange(caps.shape[1])[None, :]
    fixed = np.where(k == 0, first_s[:, None], 0.0) + np.where(k == pp - 1, last_s[:, None], 0.0)
    lam = np.asarray(layer_s, dtype=np.float64)[:, None]
    lo = np.zeros(len(caps))
    hi = (fixed.max(axis=1) + n_layers * lam[:, 0]) * (1 + 1e-12) + 1e-15
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        count = np.clip(np.floor((mid[:, None] - fixed) / lam), 0, caps).sum(axis=1)
        reach = count >= n_layers
        hi = np.where(reach, mid, hi)
        lo = np.where(reach, lo, mid)
    return lo


def _cap(room, per_layer):
    """floor(room / per_layer); inf when a layer costs nothing and room >= 0, -1 when room < 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(per_layer > 0, np.floor(room / np.where(per_layer > 0, per_layer, 1.0)),
                        np.where(room >= 0, np.inf, -1.0))


def _llm_side(space: SearchSpace, llm: dict[int, ModuleMeans], vision: dict[int, ModuleMeans], cluster: Cluster,
              colocated: bool, granularity: Granularity, floor: MemoryFloor) -> _Side:
    """Every LLM side (tp_l, pp_l, dp_l, m) of one placement, with its times and memory feasibility.

    Sorted by (tp_l, pp_l, m, dp_l) so that a group's layouts are contiguous.
    """
    W, B = cluster.world_size, space.global_batch
    tps = space.colocated_tp if colocated else space.llm_tp
    cols = {k: [] for k in ("tp", "pp", "dp", "m")}
    for t in tps:
        for p in range(1, space.llm_layers + 1):
            max_dp = (W - (0 if colocated else 1)) // (t * p)
            if max_dp < 1:
                break
            for mb in space.microbatches:
                hi = min(max_dp, B // mb)
                if hi < 1:
                    continue
                dps = cluster.launchable_dps(t * p, hi, t)[:1] if colocated else np.arange(1, hi + 1)
                if len(dps) == 0:
                    continue
                for key, val in (("tp", t), ("pp", p), ("m", mb)):
                    cols[key].append(np.full(len(dps), val))
                cols["dp"].append(dps)
    tp, pp, dp, m = (np.concatenate(cols[k]) if cols[k] else np.zeros(0, dtype=np.int64) for k in ("tp", "pp", "dp", "m"))
    order = np.lexsort((dp, m, pp, tp))
    tp, pp, dp, m = tp[order], pp[order], dp[order], m[order]
    nu = B / (m * dp)
    tnu = granularity.nu_time(nu, m)
    layer_s, extras_s, max_extra_s, first_s, last_s = (np.zeros(len(tp)) for _ in range(5))
    for t in np.unique(tp):
        rows = np.flatnonzero(tp == t)
        mm = llm[int(t)]
        first = mm.first.time_s(tnu[rows])
        if colocated:
            first = first + vision[int(t)].whole().time_s(tnu[rows])
        last = mm.last.time_s(tnu[rows])
        layer_s[rows] = mm.layer.time_s(tnu[rows])
        extras_s[rows] = first + last
        first_s[rows], last_s[rows] = first, last
        max_extra_s[rows] = np.where(pp[rows] == 1, first + last, np.maximum(first, last))
    fits = np.zeros(len(tp), dtype=bool)
    bottleneck = np.zeros(len(tp))  # stays 0 (unused) where nothing fits
    # [rows, stages] grids per TP degree and band of pp (1, 2, 3-4, 5-8, ...): a grid as wide as
    # the deepest pipeline of the degree would be mostly masked-out columns (and the answers do
    # not depend on the width: columns past a row's pp are masked, and the sums are of whole numbers)
    band = np.ceil(np.log2(np.maximum(pp, 1))).astype(np.int64)
    for t, b in sorted(set(zip(tp.tolist(), band.tolist()))):
        rows = np.flatnonzero((tp == t) & (band == b))
        in_flight = np.minimum(m[rows, None], pp[rows, None] - np.arange(int(pp[rows].max()))[None, :])
        ok, caps = module_fits(floor.llm[int(t)], space.llm_layers, cluster.gpu_memory_bytes, nu=nu[rows],
                               heaviest_share=np.ones(len(rows)), pp=pp[rows], in_flight=in_flight,
                               tower=floor.vision[int(t)] if colocated else None, return_caps=True,
                               state_scale=floor.state_scale(dp[rows]))
        fits[rows] = ok
        sel = rows[ok]
        if len(sel):
            bottleneck[sel] = min_bottleneck_s(caps[ok], space.llm_layers, layer_s[sel], first_s[sel], last_s[sel],
                                               pp[sel])
    return _Side(tp, pp, dp, m, nu, layer_s, extras_s, max_extra_s, fits, bottleneck)


def _bound(m, p_total, t_vision, t_llm, sum_s, latency):
    return (m - 1) * np.maximum(t_vision, t_llm) + sum_s + 2 * (p_total - 1) * latency


def _group_summary(colocated: bool, tp_v, pp_v, side: _Side, dp_v, fits, bound, vision_fits) -> dict:
    """Columns of one summary row per run of equal (tp_l, pp_l, m) in `side` (contiguous by construction)."""
    n = len(side.tp)
    key = np.stack([side.tp, side.pp, side.m])
    starts = np.flatnonzero(np.r_[True, (key[:, 1:] != key[:, :-1]).any(axis=0)])
    counts = np.diff(np.r_[starts, n])
    group_of = np.repeat(np.arange(len(starts)), counts)
    masked = np.where(fits, bound, np.inf)
    best_idx = np.lexsort((masked, group_of))[starts]  # argmin of each group (runs are contiguous)
    has = np.isfinite(masked[best_idx])
    return {
        "colocated": np.full(len(starts), colocated),
        "tp_v": np.broadcast_to(tp_v, n)[starts], "pp_v": np.broadcast_to(pp_v, n)[starts],
        "tp_l": side.tp[starts], "pp_l": side.pp[starts], "m": side.m[starts],
        "n_layouts": counts, "n_fit": np.add.reduceat(fits.astype(np.int64), starts),
        "bound_s": np.where(has, masked[best_idx], np.nan),
        "dp_v": np.where(has, np.broadcast_to(dp_v, n)[best_idx], -1),
        "dp_l": np.where(has, side.dp[best_idx], -1),
        "llm_fits": np.logical_or.reduceat(side.fits, starts),
        "vision_fits": np.logical_or.reduceat(np.broadcast_to(vision_fits, n), starts),
    }


def _best_rows(colocated: bool, tp_v, pp_v, dp_v, side: _Side, fits, bound, keep: int) -> dict:
    """Layout columns of the (at most) `keep` feasible rows with the smallest bounds."""
    n = len(side.tp)
    idx = np.flatnonzero(fits)
    if len(idx) > keep:
        idx = idx[np.argpartition(bound[idx], keep - 1)[:keep]]
    return {"colocated": np.full(len(idx), colocated), "tp_v": np.broadcast_to(tp_v, n)[idx],
            "pp_v": np.broadcast_to(pp_v, n)[idx], "dp_v": np.broadcast_to(dp_v, n)[idx], "tp_l": side.tp[idx],
            "pp_l": side.pp[idx], "dp_l": side.dp[idx], "m": side.m[idx], "bound_s": bound[idx]}


def _concat(parts: list[dict], columns) -> pd.DataFrame:
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=np.float64 if c == "bound_s" else np.int64) for c in columns})
    return pd.DataFrame({c: np.concatenate([p[c] for p in parts]) for c in columns})


def screen(space: SearchSpace, vision: dict[int, ModuleMeans], llm: dict[int, ModuleMeans], cluster: Cluster,
           transfer: TransferMeans, *, keep: int = 256, granularity: Granularity = Granularity.none(),
           floor: MemoryFloor | None = None) -> ScreenResult:
    """Memory feasibility and MILP lower bound of every layout; the best `keep` feasible ones.

    vision / llm: the means times are bounded with; floor: the least memory of each module (default:
    the same means, no memory techniques)."""
    floor = floor or MemoryFloor.none(vision, llm)
    B, W, lat = space.global_batch, cluster.world_size, cluster.p2p_latency_s
    kept: list[dict] = []
    groups: list[dict] = []
    n_layouts = n_feasible = 0

    if "colocated" in space.placements and space.colocated_tp:
        side = _llm_side(space, llm, vision, cluster, colocated=True, granularity=granularity, floor=floor)
        link = links(cluster, colocated=True, tp_v=side.tp, pp_v=1, dp_v=side.dp, tp_l=side.tp, pp_l=side.pp,
                     dp_l=side.dp)
        hops = 2 * (side.pp - 1) * side.nu * transfer.llm_hop_bytes / link.llm_hop_bps
        total = space.llm_layers * side.layer_s + side.extras_s + hops
        t_llm = np.maximum.reduce([total / side.pp, side.layer_s + side.max_extra_s, side.bottleneck_s])
        bound = _bound(side.m, side.pp, 0.0, t_llm, total, lat)
        if len(side.tp):
            n_layouts += len(side.tp)
            n_feasible += int(side.fits.sum())
            groups.append(_group_summary(True, side.tp, 1, side, side.dp, side.fits, bound, True))
            kept.append(_best_rows(True, side.tp, 1, side.dp, side, side.fits, bound, keep))

    if "disjoint" in space.placements and space.vision_tp:
        full = _llm_side(space, llm, vision, cluster, colocated=False, granularity=granularity, floor=floor)
        tiles_per_mb = B / full.m * space.mean_tiles
        dp_v_cap = np.maximum(1, np.floor(tiles_per_mb)).astype(np.int64)
        m_index = np.searchsorted(np.array(space.microbatches), full.m)
        llm_ranks = full.tp * full.pp * full.dp
        free = W - llm_ranks
        launchable_dp = {}  # vision GPUs per replica (tv * pv) -> dp_v per LLM side: equal products, equal dp_v
        for tv in space.vision_tp:
            vm = vision[tv]
            table = _VisionTable(space, floor.vision[tv], tv, W, cluster.gpu_memory_bytes, floor)
            for pv in range(1, space.vision_layers + 1):
                if tv * pv not in launchable_dp:
                    launchable_dp[tv * pv] = cluster.largest_launchable_vision_dp(
                        np.minimum(free // (tv * pv), dp_v_cap), tv * pv, llm_ranks, full.tp)
                dp_v_all = launchable_dp[tv * pv]
                sel = np.flatnonzero(dp_v_all >= 1)
                if len(sel) == 0:
                    if (free // (tv * pv)).max(initial=0) < 1:
                        break  # more vision stages only need more GPUs
                    continue  # none launchable here; another stage count may be
                side = full.take(sel)
                dp_v = dp_v_all[sel]
                nu_v = B / (side.m * dp_v)
                v_fits = table.fits(pv, dp_v, m_index[sel], side.pp, side.m)
                fits = side.fits & v_fits
                link = links(cluster, colocated=False, tp_v=tv, pp_v=pv, dp_v=dp_v, tp_l=side.tp, pp_l=side.pp,
                             dp_l=side.dp)
                v_first, v_last = vm.first.time_s(nu_v), vm.last.time_s(nu_v)
                v_layer = vm.layer.time_s(nu_v)
                v_hops = 2 * (pv - 1) * nu_v * transfer.vision_hop_bytes / link.vision_hop_bps
                features = (nu_v + side.nu) * transfer.feature_bytes / link.vision_to_llm_bps
                l_hops = 2 * (side.pp - 1) * side.nu * transfer.llm_hop_bytes / link.llm_hop_bps
                v_total = space.vision_layers * v_layer + v_first + v_last
                l_total = space.llm_layers * side.layer_s + side.extras_s
                t_v = np.maximum(v_total / pv, v_layer + (v_first + v_last if pv == 1 else np.maximum(v_first, v_last)))
                t_l = np.maximum.reduce([l_total / side.pp, side.layer_s + side.max_extra_s, side.bottleneck_s])
                bound = _bound(side.m, pv + side.pp, t_v, t_l, v_total + l_total + v_hops + features + l_hops, lat)
                n_layouts += len(sel)
                n_feasible += int(fits.sum())
                groups.append(_group_summary(False, tv, pv, side, dp_v, fits, bound, v_fits))
                kept.append(_best_rows(False, tv, pv, dp_v, side, fits, bound, keep))

    layouts = _concat(kept, (*LAYOUT_COLUMNS, "bound_s"))
    layouts = layouts.sort_values(["bound_s", *LAYOUT_COLUMNS], kind="stable").head(keep).reset_index(drop=True)
    group_columns = ("colocated", "tp_v", "pp_v", "tp_l", "pp_l", "m", "n_layouts", "n_fit", "bound_s", "dp_v",
                     "dp_l", "llm_fits", "vision_fits")
    return ScreenResult(layouts, _concat(groups, group_columns), n_layouts, n_feasible)


class _VisionTable:
    """Vision-side memory feasibility of every (pp_v, dp_v, m), for any LLM pipeline after it.

    Vision stage k holds ``min(m, pp_v + a - k)`` microbatches with ``a = min(pp_l, m)``, so more
    LLM stages can only add memory: the table keeps, per (pp_v, dp_v, m), the largest ``a`` that
    still fits (0: none), found by bisection over a. Built once per vision TP degree.
    """

    def __init__(self, space: SearchSpace, vm: ModuleMeans, tp: int, world: int, memory: float, floor: MemoryFloor):
        self.a_max = {}
        ms = np.array(space.microbatches)
        for pv in range(1, space.vision_layers + 1):
            max_dp = world // (tp * pv)
            if max_dp < 1:
                break
            dp, m = (x.ravel() for x in np.meshgrid(np.arange(1, max_dp + 1), ms, indexing="ij"))
            nu = space.global_batch / (m * dp)

            def fits(a):
                in_flight = np.minimum(m[:, None], pv + a[:, None] - np.arange(pv)[None, :])
                return module_fits(vm, space.vision_layers, memory, nu=nu, heaviest_share=1.0 / dp,
                                   pp=np.full(len(dp), pv), in_flight=in_flight, state_scale=floor.state_scale(dp))

            lo, hi = np.zeros(len(dp), dtype=np.int64), m.copy()  # invariant: fits(lo) or lo == 0; answer in [lo, hi]
            ok_hi = fits(hi)
            lo[ok_hi] = hi[ok_hi]
            while np.any(lo < hi):
                mid = np.where(lo < hi, (lo + hi + 1) // 2, hi)
                ok = fits(mid)
                lo = np.where((lo < hi) & ok, mid, lo)
                hi = np.where((lo < hi) & ~ok, mid - 1, hi)
            self.a_max[pv] = lo.reshape(max_dp, len(ms))

    def fits(self, pv: int, dp_v: np.ndarray, m_index: np.ndarray, llm_pp: np.ndarray, m: np.ndarray) -> np.ndarray:
        return np.minimum(llm_pp, m) <= self.a_max[pv][dp_v - 1, m_index]


def layout_of(row) -> Layout:
    """The `Layout` of a row of `ScreenResult.layouts` (or of candidates.parquet)."""
    return Layout("colocated" if bool(row.colocated) else "disjoint", int(row.tp_v), int(row.pp_v), int(row.dp_v),
                  int(row.tp_l), int(row.pp_l), int(row.dp_l), int(row.m))
