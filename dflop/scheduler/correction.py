"""Adaptive correction of the cost model from measured stage times.

Predictions drift (other kernels, thermal limits, data the profile grid missed). The trainer
reports measured per-stage, per-microbatch times; each is a constant plus a sum over the bin's
(or microbatch's) samples, so a multiplicative factor per shape bucket (and one for the constant)
is a linear least-squares problem. We keep exponentially decayed normal equations per module
(vision, LLM) and rescale costs with the factors.

The factors are a MAP estimate under a prior that each bucket's factor lies near the module's
level (the one factor that best explains all its measurements) with a relative spread
`PRIOR_SPREAD`: a ridge towards the level whose strength is the measurements' noise over the
prior's variance (sigma^2 / (spread * level)^2), sigma^2 estimated from the fit's own residuals.
Why: a step gives only 2 x m x dp equations for 25 unknowns, buckets share bins (collinear), and CPU
stage times swing by tens of percent; a fit pulled towards 1 only numerically (an earlier ridge of
1e-5) sent rarely seen buckets to whatever factor the noise gave them, and the corrected step
prediction of the next batch far off. With exact measurements sigma^2 = 0 and every bucket is learned
exactly; with noisy ones a bucket keeps its own factor only as far as its evidence outweighs the
noise, and an unseen bucket takes the level.

Stages of one module can drift apart (a stage's rank on a slower or busier core, a stage that
holds the LM head): with ``per_stage`` each stage k of a module also gets a scale s_k, so stage k
costs s_k * f[bucket] * prediction. The bucket factors f stay shared by the module's stages (a layer
split gives every stage the same shape dependence, and a bucket seen rarely still inherits its
stage's scale). The bilinear fit alternates the two linear least-squares problems on per-stage
decayed normal equations, each with its ridge towards 1, and normalises the scales to a
data-weighted mean of 1 so f keeps the module's level. With one stage it is the plain fit. A
module-wide factor cannot represent a drift on one stage of two: it splits the difference and
both stages stay wrong (tests/scheduler/test_correction.py measures by how much).

The correction is switched on only when it pays: the step time it saves on the current batch (the
partition found with corrected costs versus the one found without, both judged with corrected
costs) must exceed the overhead of tracking it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from dflop.costmodel.types import BatchCosts
from dflop.scheduler.evaluate import simulate_times, stage_times
from dflop.scheduler.greedy import MemoryGuardError
from dflop.scheduler.partition import greedy_partition


FACTOR_LIMIT = 8.0  # learned factors stay within [1/8, 8]
#: Prior relative spread of a bucket's factor around its module's level (module docstring): a
#: shape class 50 % off the rest of the module is plausible, 3x needs clear evidence.
PRIOR_SPREAD = 0.5
#: Steps at the start of a run that neither the correction learns from nor the steady-state
#: comparisons count (`dflop.runtime.metrics.prediction_agreement`): they pay warm-up (allocator
#: growth, thread pools, first collectives, the loader's first batch), many times a later step.
WARMUP_STEPS = 2


@dataclass(frozen=True)
class ShapeBuckets:
    """Buckets by tiles and sequence length: bucket = tile_bucket * n_seq_buckets + seq_bucket.

    tile_edges / seq_edges: ascending lower edges; a value x falls in the last edge <= x.
    Defaults separate text (0 tiles), 1 tile, small/large AnyRes grids, videos (11-32 frames) and
    longer inputs; and short / medium / long / very long sequences.
    """

    tile_edges: tuple[int, ...] = (0, 1, 2, 5, 11, 33)
    seq_edges: tuple[int, ...] = (0, 1024, 4096, 8192)

    @property
    def n_buckets(self) -> int:
        return len(self.tile_edges) * len(self.seq_edges)

    def assign(self, n_tiles, seq_len) -> np.ndarray:
        """[n] bucket id of each sample."""
        t = np.searchsorted(np.asarray(self.tile_edges), np.asarray(n_tiles), side="right") - 1
        s = np.searchsorted(np.asarray(self.seq_edges), np.asarray(seq_len), side="right") - 1
        if (t < 0).any() or (s < 0).any():
            raise ValueError("n_tiles and seq_len must be >= the first bucket edges")
        return t * len(self.seq_edges) + s


@dataclass(frozen=True)
class MeasuredTimes:
    """Measured seconds of one step, by microbatch id (same layout as `StageTimes`).

    vision_fwd, vision_bwd: [pp_v, m]; llm_fwd, llm_bwd: [dp_llm, pp_l, m].
    """

    vision_fwd: np.ndarray
    vision_bwd: np.ndarray
    llm_fwd: np.ndarray
    llm_bwd: np.ndarray


@dataclass(frozen=True)
class CorrectionDecision:
    """gain_s: step seconds the correction saves on the checked batch; overhead_s: seconds per
    step it costs (measured tracking time + declared measurement cost); active: gain > overhead."""

    gain_s: float
    overhead_s: float
    active: bool


def _clip(factors):
    """Factors as ratios of times: finite, within [1/FACTOR_LIMIT, FACTOR_LIMIT] (NaN -> 1)."""
    factors = np.where(np.isfinite(factors), factors, 1.0)
    return np.clip(factors, 1.0 / FACTOR_LIMIT, FACTOR_LIMIT)


def _design(costs_x: np.ndarray, groups: np.ndarray, n_groups: int, buckets: np.ndarray,
            n_buckets: int, const: float, scale: float = 1.0) -> np.ndarray:
    """[n_groups, n_buckets + 1]: per group, predicted seconds per bucket, then the constant."""
    a = np.bincount(groups * n_buckets + buckets, weights=costs_x / scale,
                    minlength=n_groups * n_buckets).reshape(n_groups, n_buckets)
    return np.hstack([a, np.full((n_groups, 1), const)])


class AdaptiveCorrection:
    """Learns per-bucket multiplicative factors for vision and LLM costs from measurements.

    Args:
        n_buckets: number of shape buckets (e.g. ``ShapeBuckets().n_buckets``).
        decay: weight of past observations per new one (forgetting for drift that moves).
        ridge: numerical floor of the pull of each factor towards 1, relative to the data's scale
            (the statistical pull towards the module's level is `PRIOR_SPREAD`'s, module docstring).
        overhead_s: declared seconds per step that collecting the measurements costs (e.g. event
            synchronisation); added to the measured bookkeeping time in the cost-benefit check.
        min_rel_gain: the gain must also exceed this share of the step time (noise guard).
        min_drift: factors all within this of 1 count as no drift (no partitions are compared).

        per_stage: learn a scale per pipeline stage on top of the module's bucket factors (module
            docstring); False: one factor set per module for all its stages.

    Learned state: ``factors_`` {"vision": [n_buckets + 1], "llm": [...]} (last = constant),
    ``stage_scales_`` {"vision": [pp_v], "llm": [pp_l]} (empty before the first observation),
    ``n_obs_``, ``active`` (set by `decide`), ``step_overhead_s_`` (`observe_step`).
    """

    def __init__(self, n_buckets: int, *, decay: float = 0.95, ridge: float = 1e-5, overhead_s: float = 0.0,
                 min_rel_gain: float = 1e-3, min_drift: float = 0.02, per_stage: bool = True):
        self.n_buckets = int(n_buckets)
        self.decay, self.ridge, self.overhead_s, self.min_rel_gain = decay, ridge, overhead_s, min_rel_gain
        self.min_drift, self.per_stage = min_drift, per_stage
        dim = self.n_buckets + 1
        # Per-stage decayed normal equations: [pp, dim, dim] and [pp, dim] (pp known at the first
        # step), and per stage the decayed sum of squared measurements and count of rows (the fit's
        # residual noise, module docstring).
        self._gram = {k: np.zeros((0, dim, dim)) for k in ("vision", "llm")}
        self._rhs = {k: np.zeros((0, dim)) for k in ("vision", "llm")}
        self._yy = {k: np.zeros(0) for k in ("vision", "llm")}
        self._rows = {k: np.zeros(0) for k in ("vision", "llm")}
        self.factors_ = {k: np.ones(dim) for k in ("vision", "llm")}
        self.stage_scales_ = {k: np.ones(0) for k in ("vision", "llm")}
        self.n_obs_ = 0
        self.active = False
        self._track_s = 0.0  # EMA of bookkeeping seconds per step
        self.step_overhead_s_ = 0.0
        self._overhead_w = 0.0  # decayed count of the steps behind step_overhead_s_

    #: Learned arrays by state-dict name -> the attribute holding {"vision": ..., "llm": ...}.
    _STATE_ARRAYS = {"gram": "_gram", "rhs": "_rhs", "yy": "_yy", "rows": "_rows", "factors": "factors_",
                     "stage_scales": "stage_scales_"}

    def state_dict(self) -> dict:
        """The learned state as plain JSON-able values (saved in training checkpoints)."""
        return {"n_buckets": self.n_buckets, "n_obs": self.n_obs_, "active": self.active, "track_s": self._track_s,
                "step_overhead_s": self.step_overhead_s_, "overhead_weight": self._overhead_w,
                **{f"{part}_{mod}": getattr(self, attr)[mod].tolist()
                   for part, attr in self._STATE_ARRAYS.items() for mod in ("vision", "llm")}}

    def load_state_dict(self, state: dict) -> bool:
        """Restore `state_dict()`'s output. False, with this object untouched, if the state was
        learned over other buckets or is malformed (missing keys, wrong shapes, a state saved before
        per-stage learning or before the noise terms)."""
        dim = self.n_buckets + 1
        try:
            if int(state["n_buckets"]) != self.n_buckets:
                return False
            arrays = {(part, mod): np.asarray(state[f"{part}_{mod}"], dtype=np.float64)
                      for part in self._STATE_ARRAYS for mod in ("vision", "llm")}
            scalars = (int(state["n_obs"]), bool(state["active"]), float(state["track_s"]),
                       float(state["step_overhead_s"]), float(state["overhead_weight"]))
        except (KeyError, TypeError, ValueError):
            return False
        for (part, mod), value in arrays.items():  # JSON keeps no shape for an empty array (pp still unknown)
            if value.size == 0 and part in ("gram", "rhs"):
                arrays[(part, mod)] = value.reshape((0, dim, dim) if part == "gram" else (0, dim))
        for mod in ("vision", "llm"):
            pp = arrays[("stage_scales", mod)].shape[0] if arrays[("stage_scales", mod)].ndim == 1 else -1
            shapes = {"gram": (pp, dim, dim), "rhs": (pp, dim), "yy": (pp,), "rows": (pp,), "factors": (dim,),
                      "stage_scales": (pp,)}
            if any(arrays[(part, mod)].shape != shape for part, shape in shapes.items()):
                return False
        for (part, mod), value in arrays.items():
            getattr(self, self._STATE_ARRAYS[part])[mod] = value
        self.n_obs_, self.active, self._track_s, self.step_overhead_s_, self._overhead_w = scalars
        return True

    def _check_buckets(self, buckets: np.ndarray, n: int) -> np.ndarray:
        buckets = np.asarray(buckets, dtype=np.int64)
        if buckets.shape != (n,) or (buckets < 0).any() or (buckets >= self.n_buckets).any():
            raise ValueError(f"buckets must be {n} ids in [0, {self.n_buckets}), got shape {buckets.shape}")
        return buckets

    def observe(self, costs: BatchCosts, partition, buckets, measured: MeasuredTimes) -> None:
        """Add one step's measurements. `costs` are the uncorrected predictions the step's
        samples had; `partition` the Partition it ran with."""
        t0 = time.perf_counter()
        buckets = self._check_buckets(buckets, costs.n_samples)
        m, dp, dpv, nb = partition.m, partition.dp_llm, partition.dp_vision, self.n_buckets
        bins = partition.microbatch * dp + partition.replica
        rows = {"vision": [], "llm": []}
        ys = {"vision": [], "llm": []}
        for k in range(costs.pp_llm):
            for x, c, meas in ((costs.llm_fwd[k], costs.llm_fwd_const[k], measured.llm_fwd[:, k, :]),
                               (costs.llm_bwd[k], costs.llm_bwd_const[k], measured.llm_bwd[:, k, :])):
                rows["llm"].append(_design(x, bins, m * dp, buckets, nb, c))
                ys["llm"].append(np.asarray(meas).T.reshape(-1))  # [m, dp] -> bin order j * dp + r
        for k in range(costs.pp_vision):
            for x, c, meas in ((costs.vision_fwd[k], costs.vision_fwd_const[k], measured.vision_fwd[k]),
                               (costs.vision_bwd[k], costs.vision_bwd_const[k], measured.vision_bwd[k])):
                rows["vision"].append(_design(x, partition.microbatch, m, buckets, nb, c, scale=dpv))
                ys["vision"].append(np.asarray(meas))
        for mod in ("vision", "llm"):
            if not rows[mod]:
                continue
            pp = len(rows[mod]) // 2  # rows come per stage: forward, then backward
            if self._gram[mod].shape[0] != pp:  # first step (or the layout changed): start afresh
                dim = nb + 1
                self._gram[mod], self._rhs[mod] = np.zeros((pp, dim, dim)), np.zeros((pp, dim))
                self._yy[mod], self._rows[mod] = np.zeros(pp), np.zeros(pp)
                self.stage_scales_[mod] = np.ones(pp)
            for k in range(pp):
                a = np.vstack(rows[mod][2 * k:2 * k + 2])
                y = np.concatenate(ys[mod][2 * k:2 * k + 2])
                self._gram[mod][k] = self.decay * self._gram[mod][k] + a.T @ a
                self._rhs[mod][k] = self.decay * self._rhs[mod][k] + a.T @ y
                self._yy[mod][k] = self.decay * self._yy[mod][k] + y @ y
                self._rows[mod][k] = self.decay * self._rows[mod][k] + len(y)
            self._solve(mod)
        self.n_obs_ += 1
        self._track(time.perf_counter() - t0)

    def _solve(self, mod: str, iterations: int = 30) -> None:
        """Refit `mod`'s bucket factors and stage scales from its normal equations (module
        docstring): the ridge towards the level and the stage scales (alternating least squares,
        from the last fit) are iterated to a fixed point."""
        grams, rhss = self._gram[mod], self._rhs[mod]
        pp, dim = grams.shape[0], grams.shape[1]
        scales = self.stage_scales_[mod].copy() if self.per_stage else np.ones(pp)
        factors, lam = self.factors_[mod], 0.0
        for _ in range(iterations):
            g = np.einsum("k,kij->ij", scales ** 2, grams)
            b = scales @ rhss
            floor = self.ridge * max(np.trace(g) / dim, 1e-30)
            level = float(_clip(b.sum() / g.sum())) if g.sum() > 0 else 1.0
            # A factor is a ratio of times: keep it positive and sane. Noisy measurements of
            # nearly collinear buckets can otherwise push one below zero (negative stage times).
            factors = _clip(np.linalg.solve(g + (lam + floor) * np.eye(dim), b + (lam + floor) * level))
            new_lam = self._noise_variance(mod, scales, factors, g, lam + floor, level) / (PRIOR_SPREAD * level) ** 2
            new = scales
            if self.per_stage and pp > 1:
                energy = np.einsum("i,kij,j->k", factors, grams, factors)  # sum of squared predictions per stage
                mu = self.ridge * np.maximum(energy, 1e-30)
                new = np.clip((rhss @ factors + mu) / (energy + mu), 1.0 / FACTOR_LIMIT, FACTOR_LIMIT)
                norm = float(energy @ new / energy.sum()) if energy.sum() > 0 else 1.0
                new, factors = new / norm, factors * norm  # weighted mean scale 1: f keeps the module's level
            done = np.abs(new - scales).max(initial=0.0) < 1e-9 and abs(new_lam - lam) <= 1e-6 * max(lam, new_lam, floor)
            scales, lam = new, new_lam
            if done:
                break
        self.factors_[mod] = _clip(factors)
        self.stage_scales_[mod] = scales

    def _noise_variance(self, mod: str, scales: np.ndarray, factors: np.ndarray, g: np.ndarray, lam: float,
                        level: float) -> float:
        """sigma^2: the decayed mean squared residual of one measured op under the fit `factors`,
        over the rows left after the fit's effective parameters (trace of its hat matrix). With
        no rows to spare (the first steps: fewer ops than seen buckets), the residual of the
        level alone, which cannot overfit."""
        grams, rhss, yy = self._gram[mod], self._rhs[mod], self._yy[mod]
        n = float(self._rows[mod].sum())

        def rss(f: np.ndarray) -> float:
            return float(np.sum(yy - 2 * scales * (rhss @ f) + scales ** 2 * np.einsum("i,kij,j->k", f, grams, f)))

        p_eff = float(np.trace(np.linalg.solve(g + lam * np.eye(g.shape[0]), g)))
        if n - p_eff >= 1.0:
            return max(rss(factors), 0.0) / (n - p_eff)
        return max(rss(np.full_like(factors, level)), 0.0) / max(n - 1.0, 1.0)

    def observe_step(self, step_s: float, simulated_s: float) -> None:
        """Add one step's wall seconds and its partition's 1F1B simulation with the corrected stage
        costs: ``step_overhead_s_`` is their decayed mean difference, what the step pays outside
        the stages' compute (optimizer, gradient sync, data wait, Python between ops) as far as
        the cost model leaves it out. It moves no partition (it is the same for all); it completes
        the corrected prediction of the step."""
        self._overhead_w = self.decay * self._overhead_w + 1.0
        self.step_overhead_s_ += (float(step_s) - float(simulated_s) - self.step_overhead_s_) / self._overhead_w

    def _track(self, seconds: float) -> None:
        self._track_s = seconds if self.n_obs_ <= 1 else 0.9 * self._track_s + 0.1 * seconds

    def corrected(self, costs: BatchCosts, buckets) -> BatchCosts:
        """`costs` with the learned factors applied (whether or not the correction is active)."""
        buckets = self._check_buckets(buckets, costs.n_samples)
        fv, fl = self.factors_["vision"], self.factors_["llm"]
        kv, kl = self.stage_multipliers(costs.pp_vision, "vision"), self.stage_multipliers(costs.pp_llm, "llm")
        sv, sl = kv[:, None] * fv[:-1][buckets][None, :], kl[:, None] * fl[:-1][buckets][None, :]
        return replace(costs,
                       vision_fwd=costs.vision_fwd * sv, vision_bwd=costs.vision_bwd * sv,
                       llm_fwd=costs.llm_fwd * sl, llm_bwd=costs.llm_bwd * sl,
                       vision_fwd_const=costs.vision_fwd_const * kv * fv[-1],
                       vision_bwd_const=costs.vision_bwd_const * kv * fv[-1],
                       llm_fwd_const=costs.llm_fwd_const * kl * fl[-1], llm_bwd_const=costs.llm_bwd_const * kl * fl[-1],
                       llm_chunks=None if costs.llm_chunks is None else costs.llm_chunks.scaled(sl, kl * fl[-1]))

    def stage_multipliers(self, pp: int, mod: str) -> np.ndarray:
        """[pp] learned scale of each of `mod`'s stages (ones before it has seen this many stages)."""
        scales = self.stage_scales_[mod]
        return scales if scales.shape == (pp,) else np.ones(pp)

    def apply(self, costs: BatchCosts, buckets) -> BatchCosts:
        """Corrected costs if the correction is active, else `costs` unchanged."""
        if not self.active:
            return costs
        t0 = time.perf_counter()
        out = self.corrected(costs, buckets)
        self._track_s += time.perf_counter() - t0
        return out

    def decide(self, costs, buckets, m: int, dp_llm: int, dp_vision: int) -> CorrectionDecision:
        """Cost-benefit check on one batch or a list of batches (`costs` and `buckets` both lists);
        sets and returns whether the correction is active.

        gain = mean over the batches of step(partition from uncorrected costs) - step(partition
        from corrected costs), both simulated with the corrected costs: what ignoring the drift
        costs per step. Several batches average out the heuristics' own noise.
        """
        if isinstance(costs, BatchCosts):
            costs, buckets = [costs], [buckets]
        drift = max(float(np.abs(f - 1).max(initial=0.0)) for f in (*self.factors_.values(),
                                                                    *self.stage_scales_.values()))
        if self.n_obs_ == 0 or drift < self.min_drift:
            self.active = False
            return CorrectionDecision(0.0, self._track_s + self.overhead_s, False)
        gains, steps = [], []
        for c, b in zip(costs, buckets):
            fixed = self.corrected(c, b)
            try:
                plain = greedy_partition(c, m, dp_llm, dp_vision)
                tuned = greedy_partition(fixed, m, dp_llm, dp_vision)
            except MemoryGuardError:
                # The greedy path alone cannot place this batch under memory limits as tight as a
                # plan near its limit has (the service's full portfolio can): no evidence either way.
                continue
            t_plain = simulate_times(stage_times(fixed, plain.microbatch, plain.replica, m, dp_llm, dp_vision),
                                     plain.order).step_s
            gains.append(t_plain - tuned.step_s)
            steps.append(tuned.step_s)
        if not gains:
            self.active = False
            return CorrectionDecision(0.0, self._track_s + self.overhead_s, False)
        gain = float(np.mean(gains))
        overhead = self._track_s + self.overhead_s
        self.active = bool(gain > overhead and gain > self.min_rel_gain * float(np.mean(steps)))
        return CorrectionDecision(gain, float(overhead), self.active)


def relative_error(costs: BatchCosts, partition, measured: MeasuredTimes) -> float:
    """Mean |predicted - measured| / measured over every stage op of one step."""
    st = stage_times(costs, partition.microbatch, partition.replica, partition.m, partition.dp_llm, partition.dp_vision)
    pred = np.concatenate([st.vision_fwd.ravel(), st.vision_bwd.ravel(), st.llm_fwd.ravel(), st.llm_bwd.ravel()])
    meas = np.concatenate([np.ravel(measured.vision_fwd), np.ravel(measured.vision_bwd),
                           np.ravel(measured.llm_fwd), np.ravel(measured.llm_bwd)])
    return float(np.mean(np.abs(pred - meas) / np.maximum(meas, 1e-12)))
