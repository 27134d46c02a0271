"""Simulator against closed forms (DESIGN §7) and against an independent fixed-point reference."""

import numpy as np
import pytest

from dflop.sim import plot_gantt, simulate, simulate_dp, simulate_dp_steps


@pytest.mark.parametrize("p,m", [(1, 1), (1, 5), (2, 1), (3, 3), (4, 8), (5, 2), (8, 32)])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (0.3, 0.3), (2.0, 0.5)])
def test_1f1b_equal_microbatches_closed_form(p, m, f, b):
    result = simulate(np.full((p, m), f), np.full((p, m), b), schedule="1f1b")
    assert result.step_s == pytest.approx((m + p - 1) * (f + b), rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (6, 4)])
def test_gpipe_closed_form(seed, p, m):
    rng = np.random.default_rng(seed)
    F, B = rng.uniform(0.1, 3.0, m), rng.uniform(0.1, 5.0, m)
    result = simulate(np.tile(F, (p, 1)), np.tile(B, (p, 1)), schedule="gpipe")
    expected = F.sum() + B.sum() + (p - 1) * (F.max() + B.max())
    assert result.step_s == pytest.approx(expected, rel=1e-12)


def test_gpipe_equal_with_p2p_latency():
    p, m, f, b, lat = 4, 6, 1.0, 2.0, 0.25
    result = simulate(np.full((p, m), f), np.full((p, m), b), schedule="gpipe", p2p_s=lat)
    # Flow shop with transfer lag: the first microbatch reaches the last stage after (p-1)(f+lat)
    # and its gradients return after (p-1)(b+lat); the rest stream in back to back.
    assert result.step_s == pytest.approx(m * (f + b) + (p - 1) * (f + b + 2 * lat))


@pytest.mark.parametrize("seed", range(20))
def test_1f1b_never_below_lower_bounds(seed):
    rng = np.random.default_rng(seed)
    p, m = int(rng.integers(2, 7)), int(rng.integers(1, 12))
    F = rng.lognormal(0, 0.7, m)
    B = F * rng.uniform(1.5, 2.5, m)
    order = rng.permutation(m)
    result = simulate(np.tile(F, (p, 1)), np.tile(B, (p, 1)), order=order)
    t = F + B
    bound = max(t.sum() + (p - 1) * (F[order[0]] + B[order[-1]]), p * t.max())
    assert result.step_s >= bound - 1e-9


# ---- independent reference: Bellman-Ford style fixed point on the schedule's constraints ----

def _reference_1f1b_order(stage, p, m):
    warm = min(p - stage - 1, m)
    seq = [("F", j) for j in range(warm)]
    for i in range(m - warm):
        seq += [("F", warm + i), ("B", i)]
    return seq + [("B", j) for j in range(m - warm, m)]


def _reference_step(vf, vb, lf, lb, lat):
    """Relax start times until no constraint is violated (no topological sort involved)."""
    n_vis, m = vf.shape
    n_rep, n_llm, _ = lf.shape
    p = n_vis + n_llm
    devices = [("v", s, 0) for s in range(n_vis)] + [
        ("l", s, r) for s in range(n_llm) for r in range(n_rep)]

    def dur(dev, kind, j):
        mod, s, r = dev
        if mod == "v":
            return (vf if kind == "F" else vb)[s, j]
        return (lf if kind == "F" else lb)[r, s, j]

    def stage(dev):
        return dev[1] if dev[0] == "v" else n_vis + dev[1]

    def devices_of(g):
        return [d for d in devices if stage(d) == g]

    end = {(d, k, j): 0.0 for d in devices for k in "FB" for j in range(m)}
    changed = True
    while changed:
        changed = False
        for d in devices:
            prev_end = 0.0
            for kind, j in _reference_1f1b_order(stage(d), p, m):
                ready = prev_end
                g = stage(d)
                if kind == "F" and g > 0:
                    src = devices_of(g - 1)
                    if len(src) == len(devices_of(g)):
                        src = [s for s in src if s[2] == d[2]]
                    ready = max([ready] + [end[(s, "F", j)] + lat for s in src])
                if kind == "B" and g < p - 1:
                    src = devices_of(g + 1)
                    if len(src) == len(devices_of(g)):
                        src = [s for s in src if s[2] == d[2]]
                    ready = max([ready] + [end[(s, "B", j)] + lat for s in src])
                if kind == "B" and g == p - 1:
                    ready = max(ready, end[(d, "F", j)])
                e = ready + dur(d, kind, j)
                if e > end[(d, kind, j)] + 1e-15:
                    end[(d, kind, j)] = e
                    changed = True
                prev_end = end[(d, kind, j)]
    return max(end.values())


@pytest.mark.parametrize("seed", range(8))
def test_heterogeneous_dp_matches_reference(seed):
    rng = np.random.default_rng(seed)
    n_vis, n_llm, n_rep, m = int(rng.integers(0, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 7))
    vf = rng.uniform(0.1, 2.0, (n_vis, m))
    lf = rng.uniform(0.1, 2.0, (n_rep, n_llm, m))
    vb, lb = 2 * vf * rng.uniform(0.8, 1.2, vf.shape), 2 * lf * rng.uniform(0.8, 1.2, lf.shape)
    lat = float(rng.choice([0.0, 0.05]))
    result = simulate_dp(vf, vb, lf, lb, p2p_s=lat)
    assert result.makespan_s == pytest.approx(_reference_step(vf, vb, lf, lb, lat), rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_batched_steps_match_reference_per_candidate(seed):
    """C candidates (own times, own order) in one pass == the fixed-point reference of each, and
    == simulate_dp bit for bit (the portfolio compares candidates by exact step)."""
    rng = np.random.default_rng(100 + seed)
    n_vis, n_llm, n_rep, m = int(rng.integers(0, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 7))
    n_cand = int(rng.integers(1, 6))
    vf = rng.uniform(0.1, 2.0, (n_cand, n_vis, m))
    lf = rng.uniform(0.1, 2.0, (n_cand, n_rep, n_llm, m))
    vb, lb = 2 * vf * rng.uniform(0.8, 1.2, vf.shape), 2 * lf * rng.uniform(0.8, 1.2, lf.shape)
    orders = np.stack([rng.permutation(m) for _ in range(n_cand)])
    lat = float(rng.choice([0.0, 0.05]))
    allreduce = rng.uniform(0.0, 0.3, n_vis + n_llm)
    steps = simulate_dp_steps(vf, vb, lf, lb, orders, p2p_s=lat)
    with_ar = simulate_dp_steps(vf, vb, lf, lb, orders, p2p_s=lat, allreduce_s=allreduce)
    for c, o in enumerate(orders):
        ref = _reference_step(vf[c][:, o], vb[c][:, o], lf[c][..., o], lb[c][..., o], lat)
        assert steps[c] == pytest.approx(ref, rel=1e-12)
        assert steps[c] == simulate_dp(vf[c], vb[c], lf[c], lb[c], p2p_s=lat, order=o).step_s
        assert with_ar[c] == simulate_dp(vf[c], vb[c], lf[c], lb[c], p2p_s=lat, order=o, allreduce_s=allreduce).step_s
    with pytest.raises(ValueError, match="permutations"):
        simulate_dp_steps(vf, vb, lf, lb, np.zeros((n_cand, m), dtype=int) if m > 1 else orders[:, :0])


def test_dp_coupling_never_faster_than_independent_replicas():
    rng = np.random.default_rng(3)
    m = 8
    vf = rng.uniform(0.2, 0.5, (1, m))
    lf = rng.uniform(0.2, 2.0, (4, 3, m))
    coupled = simulate_dp(vf, 2 * vf, lf, 2 * lf)
    alone = [simulate(np.vstack([vf, lf[r]]), np.vstack([2 * vf, 2 * lf[r]])).step_s for r in range(4)]
    assert coupled.step_s >= max(alone) - 1e-12
    same = simulate_dp(vf, 2 * vf, np.repeat(lf[:1], 4, axis=0), np.repeat(2 * lf[:1], 4, axis=0))
    one = simulate(np.vstack([vf, lf[0]]), np.vstack([2 * vf, 2 * lf[0]]))
    assert same.step_s == pytest.approx(one.step_s, rel=1e-12)


def test_order_busy_idle_and_allreduce():
    rng = np.random.default_rng(0)
    p, m = 3, 5
    fwd, bwd = rng.uniform(0.5, 1.5, (p, m)), rng.uniform(1.0, 3.0, (p, m))
    order = np.array([3, 0, 4, 1, 2])
    a = simulate(fwd, bwd, order=order, allreduce_s=[0.1, 0.2, 0.3])
    b = simulate(fwd[:, order], bwd[:, order])
    assert a.makespan_s == pytest.approx(b.makespan_s)
    np.testing.assert_allclose(a.fwd_start[:, order], b.fwd_start)
    np.testing.assert_allclose(a.busy_s, fwd.sum(1) + bwd.sum(1))
    np.testing.assert_allclose(a.idle_s, a.makespan_s - a.busy_s)
    last_b = a.bwd_end.max(axis=1)
    assert a.step_s == pytest.approx(max(last_b + [0.1, 0.2, 0.3]))
    # Every op on a row is serial and never overlaps another on the same row.
    for row in range(p):
        ops = sorted(zip(np.r_[a.fwd_start[row], a.bwd_start[row]], np.r_[a.fwd_end[row], a.bwd_end[row]]))
        assert all(e0 <= s1 + 1e-12 for (_, e0), (s1, _) in zip(ops, ops[1:]))


def test_bad_input_errors():
    with pytest.raises(ValueError, match="order must be a permutation"):
        simulate(np.ones((2, 3)), np.ones((2, 3)), order=[0, 0, 1])
    with pytest.raises(ValueError, match="schedule"):
        simulate(np.ones((2, 3)), np.ones((2, 3)), schedule="zb")
    with pytest.raises(ValueError, match="non-negative"):
        simulate(-np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"\[S, M\]"):
        simulate(np.ones(3), np.ones(3))


def test_gantt_png(tmp_path):
    import matplotlib.image as mpimg

    rng = np.random.default_rng(1)
    vf, lf = rng.uniform(0.5, 1.0, (1, 6)), rng.uniform(0.5, 1.0, (2, 2, 6))
    path = plot_gantt(simulate_dp(vf, 2 * vf, lf, 2 * lf), tmp_path / "step.png")
    img = mpimg.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 400
    # Both bar colours are present (forward blue #4C72B0, backward orange #DD8452).
    rgb = (img[..., :3] * 255).round().astype(int).reshape(-1, 3)
    assert ((np.abs(rgb - [0x4C, 0x72, 0xB0]).sum(1)) < 6).any()
    assert ((np.abs(rgb - [0xDD, 0x84, 0x52]).sum(1)) < 6).any()


def test_batched_steps_reuse_each_graphs_own_levels():
    """`simulate_dp_steps` walks `_compile`'s graph level by level, the levels cached per graph:
    graphs with as many ops (1 vision stage + 2 LLM stages of 2 replicas, 1 + 1 stage of 4; 1F1B
    and GPipe) and the same graph on new times each give simulate_dp's step bit for bit. A cache
    keyed on too little (the op count, the replicas without the schedule) hands one graph's levels
    to another and fails here."""
    rng = np.random.default_rng(7)
    m = 4
    for _ in range(2):  # the second round reads every graph's levels from the cache
        for n_rep, n_llm in ((2, 2), (4, 1)):
            for schedule in ("1f1b", "gpipe"):
                vf = rng.uniform(0.1, 2.0, (2, 1, m))
                lf = rng.uniform(0.1, 2.0, (2, n_rep, n_llm, m))
                vb, lb = 2 * vf, 2 * lf * rng.uniform(0.8, 1.2, lf.shape)
                orders = np.stack([rng.permutation(m) for _ in range(2)])
                steps = simulate_dp_steps(vf, vb, lf, lb, orders, p2p_s=0.05, schedule=schedule)
                for c in range(2):
                    assert steps[c] == simulate_dp(vf[c], vb[c], lf[c], lb[c], p2p_s=0.05, order=orders[c],
                                                   schedule=schedule).step_s
