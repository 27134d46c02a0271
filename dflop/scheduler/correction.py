"""Adaptive correction of the cost model from measured stage times.

Predictions drift (other kernels, thermal limits, data the profile grid missed). The trainer
reports measured per-stage, per-microbatch times; each is a constant plus a sum over the bin's
(or microbatch's) samples, so a multiplicative factor per shape bucket (and one for the constant)
is a linear least-squares problem. We keep exponentially decayed normal equations per module
(vision, LLM), solve them with a ridge pull towards 1, and rescale costs with the factors. The
correction is switched on only when it pays: the step time it saves on the current batch (the
partition found with corrected costs versus the one found without, both judged with corrected
costs) must exceed the overhead of tracking it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from dflop.costmodel.types import BatchCosts
from dflop.scheduler.evaluate import simulate_times, stage_times
from dflop.scheduler.partition import greedy_partition


FACTOR_LIMIT = 8.0  # learned factors stay within [1/8, 8]


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
        ridge: pull of each factor towards 1, relative to the data's scale.
        overhead_s: declared seconds per step that collecting the measurements costs (e.g. event
            synchronisation); added to the measured bookkeeping time in the cost-benefit check.
        min_rel_gain: the gain must also exceed this share of the step time (noise guard).
        min_drift: factors all within this of 1 count as no drift (no partitions are compared).

    Learned state: ``factors_`` {"vision": [n_buckets + 1], "llm": [...]} (last = constant),
    ``n_obs_``, ``active`` (set by `decide`).
    """

    def __init__(self, n_buckets: int, *, decay: float = 0.95, ridge: float = 1e-5, overhead_s: float = 0.0,
                 min_rel_gain: float = 1e-3, min_drift: float = 0.02):
        self.n_buckets = int(n_buckets)
        self.decay, self.ridge, self.overhead_s, self.min_rel_gain = decay, ridge, overhead_s, min_rel_gain
        self.min_drift = min_drift
        dim = self.n_buckets + 1
        self._gram = {k: np.zeros((dim, dim)) for k in ("vision", "llm")}
        self._rhs = {k: np.zeros(dim) for k in ("vision", "llm")}
        self.factors_ = {k: np.ones(dim) for k in ("vision", "llm")}
        self.n_obs_ = 0
        self.active = False
        self._track_s = 0.0  # EMA of bookkeeping seconds per step

    #: Learned arrays by state-dict name -> the attribute holding {"vision": ..., "llm": ...}.
    _STATE_ARRAYS = {"gram": "_gram", "rhs": "_rhs", "factors": "factors_"}

    def state_dict(self) -> dict:
        """The learned state as plain JSON-able values (saved in training checkpoints)."""
        return {"n_buckets": self.n_buckets, "n_obs": self.n_obs_, "active": self.active, "track_s": self._track_s,
                **{f"{part}_{mod}": getattr(self, attr)[mod].tolist()
                   for part, attr in self._STATE_ARRAYS.items() for mod in ("vision", "llm")}}

    def load_state_dict(self, state: dict) -> bool:
        """Restore `state_dict()`'s output. False, with this object untouched, if the state was
        learned over other buckets or is malformed (missing keys, wrong shapes)."""
        dim = self.n_buckets + 1
        shapes = {"gram": (dim, dim), "rhs": (dim,), "factors": (dim,)}
        try:
            if int(state["n_buckets"]) != self.n_buckets:
                return False
            arrays = {(part, mod): np.asarray(state[f"{part}_{mod}"], dtype=np.float64)
                      for part in shapes for mod in ("vision", "llm")}
            scalars = int(state["n_obs"]), bool(state["active"]), float(state["track_s"])
        except (KeyError, TypeError, ValueError):
            return False
        if any(value.shape != shapes[part] for (part, _), value in arrays.items()):
            return False
        for (part, mod), value in arrays.items():
            getattr(self, self._STATE_ARRAYS[part])[mod] = value
        self.n_obs_, self.active, self._track_s = scalars
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
            a, y = np.vstack(rows[mod]), np.concatenate(ys[mod])
            self._gram[mod] = self.decay * self._gram[mod] + a.T @ a
            self._rhs[mod] = self.decay * self._rhs[mod] + a.T @ y
            g = self._gram[mod]
            lam = self.ridge * max(np.trace(g) / len(g), 1e-30)
            factors = np.linalg.solve(g + lam * np.eye(len(g)), self._rhs[mod] + lam)
            # A factor is a ratio of times: keep it positive and sane. Noisy measurements of
            # nearly collinear buckets can otherwise push one below zero (negative stage times).
            factors = np.where(np.isfinite(factors), factors, 1.0)
            self.factors_[mod] = np.clip(factors, 1.0 / FACTOR_LIMIT, FACTOR_LIMIT)
        self.n_obs_ += 1
        self._track(time.perf_counter() - t0)

    def _track(self, seconds: float) -> None:
        self._track_s = seconds if self.n_obs_ <= 1 else 0.9 * self._track_s + 0.1 * seconds

    def corrected(self, costs: BatchCosts, buckets) -> BatchCosts:
        """`costs` with the learned factors applied (whether or not the correction is active)."""
        buckets = self._check_buckets(buckets, costs.n_samples)
        fv, fl = self.factors_["vision"], self.factors_["llm"]
        sv, sl = fv[:-1][buckets][None, :], fl[:-1][buckets][None, :]
        return replace(costs,
                       vision_fwd=costs.vision_fwd * sv, vision_bwd=costs.vision_bwd * sv,
                       llm_fwd=costs.llm_fwd * sl, llm_bwd=costs.llm_bwd * sl,
                       vision_fwd_const=costs.vision_fwd_const * fv[-1],
                       vision_bwd_const=costs.vision_bwd_const * fv[-1],
                       llm_fwd_const=costs.llm_fwd_const * fl[-1], llm_bwd_const=costs.llm_bwd_const * fl[-1])

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
        drift = max(float(np.abs(f - 1).max()) for f in self.factors_.values())
        if self.n_obs_ == 0 or drift < self.min_drift:
            self.active = False
            return CorrectionDecision(0.0, self._track_s + self.overhead_s, False)
        gains, steps = [], []
        for c, b in zip(costs, buckets):
            fixed = self.corrected(c, b)
            plain = greedy_partition(c, m, dp_llm, dp_vision)
            tuned = greedy_partition(fixed, m, dp_llm, dp_vision)
            t_plain = simulate_times(stage_times(fixed, plain.microbatch, plain.replica, m, dp_llm, dp_vision),
                                     plain.order).step_s
            gains.append(t_plain - tuned.step_s)
            steps.append(tuned.step_s)
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
