"""Interleaved 1F1B and ZB-H1 in the simulator: equal to a brute-force event simulation, equal to
the published closed forms for identical microbatches, and holding the known in-flight counts.

The reference below shares no code with `dflop.sim`: its own per-device orders (written from
Megatron-LM's description and the ZB paper's), its own dependency rules, and a priority-queue
event loop in time order.
"""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from dflop.sim import simulate, simulate_dp, simulate_dp_steps

# ---- reference orders, per device, as (kind, chunk, microbatch position) ----


def _ref_1f1b(stage, p, m, split=False):
    """1F1B; with ``split`` each backward is "B" then "W", and stage ``stage`` holds back its
    first ``stage`` W's to the end (ZB-H1)."""
    warm = min(p - stage - 1, m)
    seq = [("F", j) for j in range(warm)]
    for i in range(m - warm):
        seq += [("F", warm + i), ("B", i)]
    seq += [("B", j) for j in range(m - warm, m)]
    if not split:
        return [(k, 0, j) for k, j in seq]
    out, held = [], []
    for k, j in seq:
        out.append((k, 0, j))
        if k == "B":
            held.append(j)
            if len(held) > stage:          # this B has `stage` W's still held before it
                out.append(("W", 0, held[len(held) - 1 - stage]))
    done = {j for k, _, j in out if k == "W"}
    return out + [("W", 0, j) for j in range(m) if j not in done]


def _megatron_warmup(rank, p, v, m):
    if m == p:
        return m * v
    return min((p - rank - 1) * 2 + (v - 1) * p, m * v)


def _ref_interleaved(rank, p, v, m):
    fwd = [(k, g * p + i) for g in range(m // p) for k in range(v) for i in range(p)]
    bwd = [(v - 1 - k, g * p + i) for g in range(m // p) for k in range(v) for i in range(p)]
    warm = _megatron_warmup(rank, p, v, m)
    seq = [("F", *fwd[i]) for i in range(warm)]
    for i in range(len(fwd) - warm):
        seq += [("F", *fwd[warm + i]), ("B", *bwd[i])]
    return seq + [("B", *bwd[i]) for i in range(len(fwd) - warm, len(fwd))]


# ---- reference event simulation ----


def _reference(vf, vb, lf, lb, lat, schedule, v=1, frac=None, order=None):
    """Times of every op and in-flight peaks of a vision + LLM-replica pipeline.

    vf, vb: [Sv, M]; lf, lb: [R, Sl, M] with Sl = p * v (chunk c on rank c % p); frac: [R, Sl, M]
    W share of each LLM backward (ZB-H1). Returns (ops, peaks): ops[(node, kind, mb id)] =
    (start, end) with node = ("v", g, 0) or ("l", c, q); peaks = per node and per device.
    """
    n_vis, m = vf.shape
    n_rep, n_llm, _ = lf.shape
    p = n_llm // v
    order = np.arange(m) if order is None else np.asarray(order)
    split = schedule == "zb-h1"

    def dur(node, kind, pos):
        j = order[pos]
        if node[0] == "v":
            return (vf if kind == "F" else vb)[node[1], j]
        _, c, q = node
        if kind == "F":
            return lf[q, c, j]
        w = lb[q, c, j] * frac[q, c, j] if split else 0.0
        return w if kind == "W" else lb[q, c, j] - w

    def device(node):
        return node if node[0] == "v" else ("l", node[1] % p, node[2])

    # Per-device op lists (nodes resolved from chunk indices).
    llm_orders = {}
    for r in range(p):
        if schedule == "interleaved":
            seq = _ref_interleaved(r, p, v, m)
        else:
            seq = _ref_1f1b(r, p, m, split=split)
        for q in range(n_rep):
            llm_orders[("l", r, q)] = [(("l", k * p + r, q), kind, j) for kind, k, j in seq]
    # Vision stages: 1F1B warmed up to the LLM's first chunk on rank 0: lead = its peak in flight.
    live = lead = 0
    for node, kind, _ in llm_orders[("l", 0, 0)]:
        if node == ("l", 0, 0):
            live += {"F": 1, "B": -1, "W": 0}[kind]
            lead = max(lead, live)
    orders = dict(llm_orders)
    for g in range(n_vis):
        warm = min(lead + n_vis - g - 1, m)
        seq = [("F", j) for j in range(warm)]
        for i in range(m - warm):
            seq += [("F", warm + i), ("B", i)]
        seq += [("B", j) for j in range(m - warm, m)]
        orders[("v", g, 0)] = [(("v", g, 0), k, j) for k, j in seq]

    def senders(node, kind):
        """Nodes whose op ``kind`` (same microbatch) this node's op waits for."""
        g = node[1] if node[0] == "v" else n_vis + node[1]
        if kind == "W":
            return [(node, "B")]
        nxt = g - 1 if kind == "F" else g + 1
        if kind == "F" and g == 0:
            return []
        if kind == "B" and g == n_vis + n_llm - 1:
            return [(node, "F")]
        if nxt < n_vis:
            return [(("v", nxt, 0), kind)]
        if g < n_vis:      # the last vision stage waits for every LLM replica's first chunk
            return [(("l", 0, q), kind) for q in range(n_rep)]
        return [(("l", nxt - n_vis, node[2]), kind)]

    ops, heap, seq_no = {}, [], 0
    nxt_idx = dict.fromkeys(orders, 0)
    free_at = dict.fromkeys(orders, 0.0)

    def try_start(dev):
        nonlocal seq_no
        if nxt_idx[dev] >= len(orders[dev]) or free_at[dev] is None:
            return
        node, kind, pos = orders[dev][nxt_idx[dev]]
        start = free_at[dev]
        for src, skind in senders(node, kind):
            key = (src, skind, pos)
            if key not in ops or ops[key][1] is None:
                return
            arrive = ops[key][1] + (lat if device(src) != dev else 0.0)
            start = max(start, arrive)
        end = start + dur(node, kind, pos)
        ops[(node, kind, pos)] = (start, None)
        free_at[dev] = None                          # busy until the completion event
        heapq.heappush(heap, (end, seq_no, dev, (node, kind, pos)))
        seq_no += 1

    for dev in orders:
        try_start(dev)
    completion_order = {dev: [] for dev in orders}
    while heap:
        end, _, dev, key = heapq.heappop(heap)
        ops[key] = (ops[key][0], end)
        free_at[dev] = end
        nxt_idx[dev] += 1
        completion_order[dev].append(key)
        for d in orders:
            try_start(d)
    assert all(nxt_idx[d] == len(orders[d]) for d in orders), "reference deadlocked"

    peaks = {}
    for dev, done in completion_order.items():
        live, pend, total = {}, {}, 0
        for node, kind, _ in done:
            delta = {"F": 1, "B": -1, "W": 0}[kind]
            live[node] = live.get(node, 0) + delta
            total += delta
            pend[node] = pend.get(node, 0) + (kind == "B" and split and node[0] == "l") - (kind == "W")
            peaks[node] = max(peaks.get(node, (0, 0))[0], live[node]), max(peaks.get(node, (0, 0))[1], pend[node])
            peaks[dev, "device"] = max(peaks.get((dev, "device"), 0), total)
    return {(node, kind, int(order[pos])): t for (node, kind, pos), t in ops.items()}, peaks


def _row_nodes(n_vis, n_llm, n_rep):
    return [("v", g, 0) for g in range(n_vis)] + [("l", c, q) for c in range(n_llm) for q in range(n_rep)]


def _random_instance(rng, schedule):
    p = int(rng.integers(2, 5))
    v = 2 if schedule == "interleaved" else 1
    m = p * int(rng.integers(1, 8 // p + 1)) if schedule == "interleaved" else int(rng.integers(2, 9))
    n_vis, n_rep = int(rng.integers(0, 3)), int(rng.integers(1, 4))
    vf = rng.uniform(0.1, 2.0, (n_vis, m))
    lf = rng.uniform(0.1, 2.0, (n_rep, p * v, m))
    vb, lb = vf * rng.uniform(1.0, 3.0, vf.shape), lf * rng.uniform(1.0, 3.0, lf.shape)
    frac = rng.uniform(0.0, 1.0, lf.shape)
    lat = float(rng.choice([0.0, 0.05]))
    return p, v, m, n_vis, n_rep, vf, vb, lf, lb, frac, lat, rng.permutation(m)


@pytest.mark.parametrize("schedule", ["interleaved", "zb-h1", "1f1b"])
@pytest.mark.parametrize("seed", range(25))
def test_equals_brute_force_event_simulation(schedule, seed):
    """Every op's start and end, the in-flight peaks per row and per device, and the batched
    step equal the reference's, on random heterogeneous instances with vision stages, replicas,
    latency and a shuffled microbatch order."""
    rng = np.random.default_rng(1000 * seed + len(schedule))
    p, v, m, n_vis, n_rep, vf, vb, lf, lb, frac, lat, order = _random_instance(rng, schedule)
    res = simulate_dp(vf, vb, lf, lb, schedule=schedule, chunks=v, p2p_s=lat, order=order, wgrad_frac=frac)
    ref, peaks = _reference(vf, vb, lf, lb, lat, schedule, v=v, frac=frac, order=order)
    nodes = _row_nodes(n_vis, p * v, n_rep)
    assert len(nodes) == len(res.row_stage)
    for row, node in enumerate(nodes):
        for j in range(m):
            assert (res.fwd_start[row, j], res.fwd_end[row, j]) == pytest.approx(ref[(node, "F", j)], abs=1e-9)
            assert (res.bwd_start[row, j], res.bwd_end[row, j]) == pytest.approx(ref[(node, "B", j)], abs=1e-9)
            if schedule == "zb-h1" and node[0] == "l":
                assert (res.w_start[row, j], res.w_end[row, j]) == pytest.approx(ref[(node, "W", j)], abs=1e-9)
        assert res.in_flight[row] == peaks[node][0]
        assert res.wgrad_pending[row] == peaks[node][1]
    for row, node in enumerate(nodes):
        dev = node if node[0] == "v" else ("l", node[1] % p, node[2])
        assert res.device_in_flight[res.row_device[row]] == peaks[dev, "device"]
    assert res.makespan_s == pytest.approx(max(t[1] for t in ref.values()), abs=1e-9)
    batched = simulate_dp_steps(vf[None], vb[None], lf[None], lb[None], order[None], schedule=schedule,
                                chunks=v, p2p_s=lat, wgrad_frac=frac[None])
    assert batched[0] == res.step_s


# ---- closed forms for identical microbatches ----


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 2), (4, 3), (5, 4)])
@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (0.4, 0.4), (1.3, 0.7)])
def test_interleaved_bubble_closed_form(p, v, groups, f, b):
    """Narayanan et al. 2021 (Megatron-LM, SC'21), Sec. 2.2.2: the interleaved schedule's bubble
    time is (p - 1)(t_f + t_b) / v, with t_f, t_b one microbatch's forward / backward through a
    whole rank (v chunks, so t_f = v f for per-chunk f), i.e. a bubble fraction (p - 1) / (v m) of
    the ideal m (t_f + t_b). No latency; m a multiple of p (m = p included, where Megatron runs
    every forward first)."""
    m = groups * p
    res = simulate(np.full((p * v, m), f), np.full((p * v, m), b), schedule="interleaved", chunks=v)
    t_f, t_b = v * f, v * b
    ideal = m * (t_f + t_b)
    assert res.step_s == pytest.approx(ideal + (p - 1) * (t_f + t_b) / v, rel=1e-12)
    assert (res.step_s - ideal) / ideal == pytest.approx((p - 1) / (v * m), rel=1e-9)


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 5])
@pytest.mark.parametrize("t_f,t_b,t_w", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.7), (2.0, 0.8, 0.5), (0.6, 1.2, 0.6)])
def test_zb_h1_bubble_closed_form(p, extra, t_f, t_b, t_w):
    """Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), ZB-H1: bubble
    (p - 1)(T_F + T_B - T_W), against 1F1B's (p - 1)(T_F + T_B + T_W) (with T_F = T_B = T_W a
    third, the official README's (p - 1)/3m bubble rate). Tested as step = m (T_F + T_B + T_W)
    + (p - 1)(T_F + T_B - T_W) for identical microbatches, m >= p, no latency and
    T_W <= min(T_F, T_B) (the schedule's W's then always fit the gaps they are held for)."""
    m = p + extra
    bwd = np.full((p, m), t_b + t_w)
    res = simulate(np.full((p, m), t_f), bwd, schedule="zb-h1", wgrad_frac=t_w / (t_b + t_w))
    assert res.step_s == pytest.approx(m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w), rel=1e-12)
    one = simulate(np.full((p, m), t_f), bwd, schedule="1f1b")
    assert one.step_s == pytest.approx(m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b + t_w), rel=1e-12)


def test_zb_h1_with_no_weight_gradient_is_1f1b():
    rng = np.random.default_rng(7)
    fwd, bwd = rng.uniform(0.2, 1.0, (4, 9)), rng.uniform(0.5, 2.0, (4, 9))
    zb = simulate(fwd, bwd, schedule="zb-h1", wgrad_frac=0.0, p2p_s=0.03)
    one = simulate(fwd, bwd, schedule="1f1b", p2p_s=0.03)
    assert zb.step_s == pytest.approx(one.step_s, rel=1e-12)
    np.testing.assert_allclose(zb.bwd_end, one.bwd_end)


# ---- in-flight activations: the known counts ----


@pytest.mark.parametrize("p,m", [(2, 2), (3, 7), (4, 3), (4, 8), (6, 12)])
def test_in_flight_1f1b_and_zb_h1_hold_p_minus_s(p, m):
    ones = np.ones((p, m))
    for schedule in ("1f1b", "zb-h1"):
        res = simulate(ones, 2 * ones, schedule=schedule)
        assert res.in_flight.tolist() == [min(p - s, m) for s in range(p)]
        assert res.device_in_flight.tolist() == res.in_flight.tolist()
    zb = simulate(ones, 2 * ones, schedule="zb-h1")
    assert (zb.wgrad_pending >= 1).all() and (simulate(ones, ones).wgrad_pending == 0).all()


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 6), (3, 2, 9), (4, 2, 8), (4, 3, 16)])
def test_in_flight_interleaved_is_megatron_warmup_plus_one(p, v, m):
    res = simulate(np.ones((p * v, m)), np.ones((p * v, m)), schedule="interleaved", chunks=v)
    expected = [min(_megatron_warmup(r, p, v, m) + 1, m * v) for r in range(p)]
    assert res.device_in_flight.tolist() == expected
    assert res.n_devices == p and res.row_device.tolist() == [c % p for c in range(p * v)]


def test_refusals_are_one_line():
    ones = np.ones((4, 5))
    with pytest.raises(ValueError, match="multiple of the pipeline ranks") as e:
        simulate(ones, ones, schedule="interleaved", chunks=2)    # 2 ranks, 5 microbatches
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="at least 2 model chunks"):
        simulate(ones, ones, schedule="interleaved")
    with pytest.raises(ValueError, match="one model chunk per device"):
        simulate(ones, ones, schedule="zb-h1", chunks=2)
    with pytest.raises(ValueError, match="wgrad_frac"):
        simulate(ones, ones, schedule="zb-h1", wgrad_frac=1.5)


def test_gantt_draws_devices_and_weight_gradients(tmp_path):
    import matplotlib.image as mpimg

    from dflop.sim import plot_gantt

    rng = np.random.default_rng(2)
    vf, lf = rng.uniform(0.5, 1.0, (1, 4)), rng.uniform(0.5, 1.0, (1, 4, 4))
    inter = simulate_dp(vf, 2 * vf, lf, 2 * lf, schedule="interleaved", chunks=2)
    assert inter.n_devices == 3 and inter.w_start is None
    plot_gantt(inter, tmp_path / "interleaved.png")
    zb = simulate_dp(vf, 2 * vf, lf, 2 * lf, schedule="zb-h1")
    assert np.isnan(zb.w_start[0]).all() and np.isfinite(zb.w_start[1:]).all()
    rgb = (mpimg.imread(plot_gantt(zb, tmp_path / "zb.png"))[..., :3] * 255).round().astype(int).reshape(-1, 3)
    assert ((np.abs(rgb - [0x55, 0xA8, 0x68]).sum(1)) < 6).any()  # weight-gradient bars (#55A868)
