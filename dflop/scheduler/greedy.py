"""2-D vector LPT and a move/swap local search on the bottleneck proxy.

Both work on `ScalarCosts`: each sample adds ``vision[i]`` seconds to its microbatch's vision
stage and ``llm[i]`` seconds to its bin's LLM stage. The proxy of an assignment is the largest of
all microbatch vision loads and all bin LLM loads (seconds on the bottleneck stage). Bins are
numbered ``b = j * dp_llm + r`` (microbatch ``j``, LLM replica ``r``). Everything here is
deterministic: ties go to the lowest index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.costmodel.types import BatchCosts
from dflop.scheduler.evaluate import ScalarCosts


class MemoryGuardError(ValueError):
    """A sample cannot be placed in any bin without exceeding a stage's memory limit."""


@dataclass(frozen=True)
class MemoryGuard:
    """Per-stage memory bytes of each sample and limits; bins (LLM) and microbatches (vision) must fit.

    llm_bytes: [pp_l, n] (`BatchCosts.llm_mem_bytes`: activations and the transient's share);
    llm_limit: [pp_l]; vision_bytes: [pp_v, n] already divided by dp_vision; vision_limit: [pp_v].
    ``active`` is False when every limit is infinite.
    """

    llm_bytes: np.ndarray
    llm_limit: np.ndarray
    vision_bytes: np.ndarray
    vision_limit: np.ndarray
    active: bool

    @classmethod
    def from_costs(cls, costs: BatchCosts, dp_vision: int) -> "MemoryGuard":
        active = bool(np.isfinite(costs.llm_mem_limit_bytes).any() or np.isfinite(costs.vision_mem_limit_bytes).any())
        return cls(np.asarray(costs.llm_mem_bytes, float), np.asarray(costs.llm_mem_limit_bytes, float),
                   np.asarray(costs.vision_mem_bytes, float) / dp_vision,
                   np.asarray(costs.vision_mem_limit_bytes, float), active)

    def check_samples(self, sample_ids=None) -> None:
        """Raise MemoryGuardError naming the first sample that exceeds a limit on its own."""
        for name, x, lim in (("LLM", self.llm_bytes, self.llm_limit), ("vision", self.vision_bytes, self.vision_limit)):
            over = (x > lim[:, None]).any(axis=0) if x.size else np.zeros(0, bool)
            if over.any():
                i = int(np.flatnonzero(over)[0])
                k = int(np.flatnonzero(x[:, i] > lim)[0])
                sid = sample_ids[i] if sample_ids is not None else f"index {i}"
                raise MemoryGuardError(
                    f"sample {sid}: needs {x[k, i]:.3g} bytes (activations and transient) on {name} stage {k}, "
                    f"more than its limit {lim[k]:.3g} on its own")


def _targets(sc: ScalarCosts, m: int, n_bins: int) -> tuple[float, float]:
    tv = float(sc.vision.sum()) / m
    tl = float(sc.llm.sum()) / n_bins
    return (tv if tv > 0 else 1.0), (tl if tl > 0 else 1.0)


def _weights(mb_weight, m: int, dp_llm: int) -> tuple[np.ndarray, np.ndarray]:
    w = np.ones(m) if mb_weight is None else np.asarray(mb_weight, dtype=np.float64)
    if w.shape != (m,) or (w <= 0).any():
        raise ValueError(f"mb_weight must be {m} positive numbers, got {w.tolist()}")
    return w, np.repeat(w, dp_llm)


def _bin_weights(mb_weight, m: int, dp_llm: int) -> tuple[np.ndarray, np.ndarray]:
    """(vision, LLM) weight of every bin; ``mb_weight`` is None, [m] (both modules) or [2, m]."""
    w = None if mb_weight is None else np.asarray(mb_weight, dtype=np.float64)
    if w is not None and w.shape == (2, m):
        if not (w > 0).all():
            raise ValueError(f"mb_weight must be positive, got {w.tolist()}")
        return np.repeat(w[0], dp_llm), np.repeat(w[1], dp_llm)
    w_bin = _weights(mb_weight, m, dp_llm)[1]
    return w_bin, w_bin


def greedy_2d(sc: ScalarCosts, m: int, dp_llm: int, guard: MemoryGuard, mb_weight=None) -> np.ndarray:
    """Vector LPT: samples by decreasing normalised size, each to the bin that least raises the
    bottleneck (ties: the bin whose normalised vision + LLM load is lowest).

    mb_weight: [m] relative capacity of each microbatch (default all 1): loads are compared
    divided by it, so a microbatch of weight 0.5 is filled to about half the others. [2, m]: a
    separate capacity for the vision load (row 0) and the LLM bin load (row 1) of each microbatch.
    Returns bin_of: [n] bin index of every sample.
    """
    return greedy_2d_many(sc, m, dp_llm, guard, [mb_weight])[0]


def greedy_2d_many(sc: ScalarCosts, m: int, dp_llm: int, guard: MemoryGuard, mb_weights) -> np.ndarray:
    """`greedy_2d` for several microbatch weightings at once: [K, n] bin_of, row k equal to
    ``greedy_2d(..., mb_weights[k])`` (None = all 1).

    The samples' order does not depend on the weighting, so the K runs advance in lockstep and
    every numpy call serves all of them: the per-sample Python overhead is paid once, not K times.
    """
    n_bins = m * dp_llm
    n_runs = len(mb_weights)
    weighted = any(w is not None for w in mb_weights)
    pairs = [_bin_weights(w, m, dp_llm) for w in mb_weights]
    two_d = any(wv is not wl for wv, wl in pairs)   # separate vision / LLM capacities
    tv, tl = _targets(sc, m, n_bins)
    size = np.maximum(sc.vision / tv, sc.llm / tl)
    order = np.argsort(-size, kind="stable")
    # Everything per bin is flat, [K * n_bins] with bin (k, b) at k * n_bins + b: numpy's per-call
    # overhead, which is what this loop costs, is lowest on 1-D arrays. The [K, ...] views are
    # made once, on the reused buffers.
    w_bin = np.concatenate([wl for _, wl in pairs])
    wv_bin = np.concatenate([wv for wv, _ in pairs]) if two_d else w_bin
    Vb = np.full(n_runs * n_bins, sc.vision_const)   # vision load of each bin's microbatch
    L = np.full(n_runs * n_bins, sc.llm_const)
    if two_d:
        tie = Vb / (tv * wv_bin) + L / (tl * w_bin)
        cur = np.maximum(Vb / wv_bin, L / w_bin).reshape(n_runs, n_bins).max(axis=1).tolist()
    else:
        tie = (Vb / tv + L / tl) / w_bin             # tie-break score, kept up to date
        cur = (max(sc.vision_const, sc.llm_const) / w_bin.reshape(n_runs, n_bins).min(axis=1)).tolist()
    cur_bins = np.repeat(cur, n_bins)                # each run's bottleneck, per bin
    if guard.active:
        mb_of_bin = np.arange(n_bins) // dp_llm
        mem_l = np.zeros((n_runs, guard.llm_bytes.shape[0], n_bins))
        mem_v = np.zeros((n_runs, guard.vision_bytes.shape[0], m))
        llm_limit, vision_limit = guard.llm_limit[None, :, None], guard.vision_limit[None, :, None]
    vision, llm = sc.vision.tolist(), sc.llm.tolist()
    key, with_llm, masked = (np.empty_like(L) for _ in range(3))
    ok = np.empty(L.shape, dtype=bool)
    key_runs, masked_runs = key.reshape(n_runs, n_bins), masked.reshape(n_runs, n_bins)
    picks = []
    for i in order.tolist():
        np.add(Vb, vision[i], out=key)
        np.add(L, llm[i], out=with_llm)
        if two_d:
            key /= wv_bin
            with_llm /= w_bin
            np.maximum(key, with_llm, out=key)
        else:
            np.maximum(key, with_llm, out=key)
            if weighted:
                key /= w_bin
        if guard.active:
            fits = ((mem_l + guard.llm_bytes[None, :, i:i + 1]) <= llm_limit).all(axis=1)
            fits &= ((mem_v + guard.vision_bytes[None, :, i:i + 1]) <= vision_limit).all(axis=1)[:, mb_of_bin]
            if not fits.any(axis=1).all():
                raise MemoryGuardError(f"sample index {i}: fits in no bin under the per-stage memory limits")
            key[~fits.reshape(-1)] = np.inf
        # Bins that keep the bottleneck where it is are all equally good: take the least loaded.
        np.less_equal(key, cur_bins, out=ok)
        masked.fill(np.inf)
        np.copyto(masked, tie, where=ok)
        picked = masked_runs.argmin(axis=1).tolist()
        # Per run, scalar updates: cheaper than fancy indexing for the few runs there are.
        for k in range(n_runs):
            base = k * n_bins
            b = picked[k]
            if masked[base + b] == np.inf:            # no such bin: the bottleneck must rise
                b = picked[k] = int(key_runs[k].argmin())
            if key[base + b] > cur[k]:
                cur[k] = key[base + b]
                cur_bins[base:base + n_bins] = cur[k]
            L[base + b] += llm[i]
            lo = base + b - b % dp_llm
            Vb[lo:lo + dp_llm] += vision[i]
            if guard.active:
                mem_l[k, :, b] += guard.llm_bytes[:, i]
                mem_v[k, :, b // dp_llm] += guard.vision_bytes[:, i]
        picks.append(picked)
        if two_d:
            np.divide(Vb, tv * wv_bin, out=tie)
            np.divide(L, tl * w_bin, out=with_llm)
            tie += with_llm
        else:
            np.divide(Vb, tv, out=tie)
            np.divide(L, tl, out=with_llm)
            tie += with_llm
            tie /= w_bin
    bin_of = np.empty((n_runs, len(size)), dtype=np.int64)
    bin_of[:, order] = np.array(picks, dtype=np.int64).reshape(len(picks), n_runs).T
    return bin_of


def proxy(sc: ScalarCosts, bin_of: np.ndarray, m: int, dp_llm: int) -> float:
    """Bottleneck-stage seconds of the busiest microbatch (vision) or bin (LLM)."""
    L = np.bincount(bin_of, weights=sc.llm, minlength=m * dp_llm) + sc.llm_const
    V = np.bincount(bin_of // dp_llm, weights=sc.vision, minlength=m) + sc.vision_const
    return float(max(L.max(), V.max()))


def _subset(items: np.ndarray, weight: np.ndarray, k: int) -> np.ndarray:
    """At most k of `items`, spread evenly over their weight ranks (big, medium and small ones)."""
    if len(items) <= k:
        return items
    ranked = items[np.argsort(-weight[items], kind="stable")]
    return ranked[np.linspace(0, len(ranked) - 1, k).round().astype(np.int64)]


def _largest_of(first: np.ndarray, *rest: np.ndarray) -> np.ndarray:
    """Element-wise maximum of arrays broadcasting to `first`'s shape (a new array of it), in place:
    np.maximum.reduce over a list stacks them into one more array first (the same values)."""
    out = np.array(first, dtype=np.float64)
    for x in rest:
        np.maximum(out, x, out=out)
    return out


def _all_rows(ok: np.ndarray) -> np.ndarray:
    """``ok.all(axis=0)``; with one row (one memory limit per module, the usual case) its view."""
    return ok[0] if ok.shape[0] == 1 else ok.all(axis=0)


def local_search(sc: ScalarCosts, bin_of: np.ndarray, m: int, dp_llm: int, guard: MemoryGuard, *,
                 mb_weight=None, max_iters: int = 400, n_sources: int = 24, n_partner_bins: int = 8,
                 tol: float = 2e-3) -> np.ndarray:
    """Repeatedly take the bottleneck (a bin's LLM load or a microbatch's vision load) and apply
    the move of one of its samples to another bin, or the swap with a sample in one of the
    lightest bins, that most lowers the largest load it touches. Stops when no move lowers it.

    Each accepted move strictly lowers the loads it touches below the current bottleneck, so the
    proxy never rises. Loads are compared divided by `mb_weight` as in `greedy_2d`. Stops early
    once the bottleneck is within `tol` of a lower bound on it.
    Returns a new bin_of.
    """
    bin_of = bin_of.copy()
    n_bins = m * dp_llm
    mb_of_bin = np.arange(n_bins) // dp_llm
    w_mb, w_bin = _weights(mb_weight, m, dp_llm)
    v, l = sc.vision, sc.llm
    L = np.bincount(bin_of, weights=l, minlength=n_bins) + sc.llm_const
    V = np.bincount(mb_of_bin[bin_of], weights=v, minlength=m) + sc.vision_const
    if guard.active:
        mem_l = np.stack([np.bincount(bin_of, weights=x, minlength=n_bins) for x in guard.llm_bytes])
        mem_v = np.stack([np.bincount(mb_of_bin[bin_of], weights=x, minlength=m) for x in guard.vision_bytes]) \
            if guard.vision_bytes.shape[0] else np.zeros((0, m))
    # No assignment can beat the weighted means or the heaviest sample in the lightest bin.
    floor = max(float(L.sum() / w_bin.sum()), float(V.sum() / w_mb.sum()),
                float((l.max(initial=0) + sc.llm_const) / w_bin.max()),
                float((v.max(initial=0) + sc.vision_const) / w_mb.max()))
    for _ in range(max_iters):
        b_max, j_max = int(np.argmax(L / w_bin)), int(np.argmax(V / w_mb))
        M = max(L[b_max] / w_bin[b_max], V[j_max] / w_mb[j_max])
        if M <= floor * (1 + tol):
            break
        if L[b_max] / w_bin[b_max] >= V[j_max] / w_mb[j_max]:
            src = _subset(np.flatnonzero(bin_of == b_max), l, n_sources)
        else:
            in_mb = np.flatnonzero((mb_of_bin[bin_of] == j_max) & (v > 0))
            src = _subset(in_mb, v, n_sources)
        if len(src) == 0:
            break
        bi, ji = bin_of[src], mb_of_bin[bin_of[src]]
        li, vi = l[src][:, None], v[src][:, None]

        # Moves: sample src[a] -> bin c.
        same = mb_of_bin[None, :] == ji[:, None]
        wi, wv = w_bin[bi][:, None], w_mb[ji][:, None]
        mv = _largest_of((L[None, :] + li) / w_bin[None, :], (L[bi][:, None] - li) / wi,
                         np.where(same, V[ji][:, None], V[ji][:, None] - vi) / wv,
                         np.where(same, V[ji][:, None] / wv, (V[mb_of_bin][None, :] + vi) / w_bin[None, :]))
        mv[np.arange(len(src)), bi] = np.inf
        if guard.active:
            ok = _all_rows((mem_l[:, None, :] + guard.llm_bytes[:, src][:, :, None]) <= guard.llm_limit[:, None, None])
            vfit = _all_rows((mem_v[:, None, :] + guard.vision_bytes[:, src][:, :, None]) <= guard.vision_limit[:, None, None])
            ok &= same | vfit[:, mb_of_bin]
            mv = np.where(ok, mv, np.inf)

        # Swaps: sample src[a] <-> sample q in one of the lightest bins or microbatches.
        light_mb = np.zeros(m, dtype=bool)
        light_mb[np.argsort(V / w_mb, kind="stable")[:2]] = True
        light = light_mb[mb_of_bin]
        light[np.argsort(L / w_bin, kind="stable")[:n_partner_bins]] = True
        light[bi] = False
        partners = np.flatnonzero(light[bin_of])
        sw = np.full((len(src), 0), np.inf)
        if len(partners):
            bq, jq = bin_of[partners], mb_of_bin[bin_of[partners]]
            dl = li - l[partners][None, :]
            dv = np.where(ji[:, None] == jq[None, :], 0.0, vi - v[partners][None, :])
            sw = _largest_of((L[bq][None, :] + dl) / w_bin[bq][None, :], (L[bi][:, None] - dl) / wi,
                             (V[ji][:, None] - dv) / wv, (V[jq][None, :] + dv) / w_mb[jq][None, :])
            if guard.active:
                da = guard.llm_bytes[:, src][:, :, None] - guard.llm_bytes[:, partners][:, None, :]
                ok = _all_rows((mem_l[:, bi][:, :, None] - da) <= guard.llm_limit[:, None, None])
                ok &= _all_rows((mem_l[:, bq][:, None, :] + da) <= guard.llm_limit[:, None, None])
                dva = guard.vision_bytes[:, src][:, :, None] - guard.vision_bytes[:, partners][:, None, :]
                dva = np.where((ji[:, None] == jq[None, :])[None], 0.0, dva)
                ok &= _all_rows((mem_v[:, ji][:, :, None] - dva) <= guard.vision_limit[:, None, None])
                ok &= _all_rows((mem_v[:, jq][:, None, :] + dva) <= guard.vision_limit[:, None, None])
                sw = np.where(ok, sw, np.inf)

        best_mv = mv.min() if mv.size else np.inf
        best_sw = sw.min() if sw.size else np.inf
        if min(best_mv, best_sw) >= M * (1 - 1e-9):
            break
        if best_mv <= best_sw:
            a, c = np.unravel_index(int(np.argmin(mv)), mv.shape)
            moves = [(int(src[a]), int(c))]
        else:
            a, q = np.unravel_index(int(np.argmin(sw)), sw.shape)
            i, k = int(src[a]), int(partners[q])
            moves = [(i, int(bin_of[k])), (k, int(bin_of[i]))]
        for i, c in moves:
            b = int(bin_of[i])
            L[b] -= l[i]
            L[c] += l[i]
            V[mb_of_bin[b]] -= v[i]
            V[mb_of_bin[c]] += v[i]
            if guard.active:
                mem_l[:, b] -= guard.llm_bytes[:, i]
                mem_l[:, c] += guard.llm_bytes[:, i]
                mem_v[:, mb_of_bin[b]] -= guard.vision_bytes[:, i]
                mem_v[:, mb_of_bin[c]] += guard.vision_bytes[:, i]
            bin_of[i] = c
    return bin_of


def lockstep_search(sc: ScalarCosts, bin_of: np.ndarray, m: int, dp_llm: int, *, max_iters: int = 1000,
                    n_sources: int = 32) -> np.ndarray:
    """Swap search on the lockstep estimate: sum over microbatches of T_j, where
    T_j = max(vision load of j, heaviest LLM bin of j).

    Replicas run each microbatch together (its vision output is shared and its vision backward
    waits for every replica), so when bins hold few samples a microbatch costs its heaviest bin,
    not the average one; min-max balancing ignores that. Each step takes the microbatch with the
    largest T_j and applies the swap of one of its samples with a sample of another microbatch
    that most lowers T_j1 + T_j2 without raising the largest T_j. Swaps keep every bin's sample
    count. No memory guard here: callers keep the result only if it passes the guard.
    """
    bin_of = bin_of.copy()
    n_bins = m * dp_llm
    mb_of_bin = np.arange(n_bins) // dp_llm
    v, l = sc.vision, sc.llm
    L = np.bincount(bin_of, weights=l, minlength=n_bins) + sc.llm_const
    V = np.bincount(mb_of_bin[bin_of], weights=v, minlength=m) + sc.vision_const
    all_items = np.arange(len(l))
    for _ in range(max_iters):
        Lm = L.reshape(m, dp_llm)
        top_r = np.argmax(Lm, axis=1)
        top1 = Lm[np.arange(m), top_r]
        second = np.partition(Lm, dp_llm - 2, axis=1)[:, dp_llm - 2] if dp_llm > 1 else np.full(m, -np.inf)
        T = np.maximum(V, top1)
        t_max = T.max()
        j1 = int(np.argmax(T))
        src = _subset(np.flatnonzero(mb_of_bin[bin_of] == j1), np.maximum(l, v), n_sources)
        others = all_items[mb_of_bin[bin_of] != j1]
        if len(src) == 0 or len(others) == 0:
            break
        b1, b2 = bin_of[src], bin_of[others]
        j2 = mb_of_bin[b2]
        # Heaviest other bin of each microbatch, excluding the bin that changes.
        excl1 = np.where(b1 % dp_llm == top_r[j1], second[j1], top1[j1])          # [k]
        excl2 = np.where(b2 % dp_llm == top_r[j2], second[j2], top1[j2])          # [q]
        dl = l[src][:, None] - l[others][None, :]
        dv = v[src][:, None] - v[others][None, :]
        t1 = np.maximum(V[j1] - dv, np.maximum(L[b1][:, None] - dl, excl1[:, None]))
        t2 = np.maximum(V[j2][None, :] + dv, np.maximum(L[b2][None, :] + dl, excl2[None, :]))
        delta = t1 + t2 - (T[j1] + T[j2])[None, :]
        delta[np.maximum(t1, t2) > t_max * (1 + 1e-12)] = np.inf
        a, q = np.unravel_index(int(np.argmin(delta)), delta.shape)
        if delta[a, q] >= -1e-9 * t_max:
            break
        i, k = int(src[a]), int(others[q])
        bi, bk = int(bin_of[i]), int(bin_of[k])
        L[bi] += l[k] - l[i]
        L[bk] += l[i] - l[k]
        V[mb_of_bin[bi]] += v[k] - v[i]
        V[mb_of_bin[bk]] += v[i] - v[k]
        bin_of[i], bin_of[k] = bk, bi
    return bin_of
