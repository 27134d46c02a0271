"""plan.yaml's LLM pipeline schedule (`llm.schedule`, `llm.chunks`) and the in-flight counts each
schedule implies, held against the simulator's own counts (`dflop.sim`, which walks the schedules'
op orders: an independent reference for `dflop.plan.schedule_in_flight`'s closed forms)."""

import numpy as np
import pytest

from dflop.errors import UserError
from dflop.plan import Layout, Plan, plan_from_dict, read_plan, write_plan
from dflop.sim import simulate_dp


def raw(llm=None, **changes):
    base = {"vision": {"tp": 1, "pp": 1, "dp": 1, "layers_per_stage": [2]},
            "llm": {"tp": 1, "pp": 2, "dp": 1, "layers_per_stage": [1, 1, 1, 1],
                    "schedule": "interleaved", "chunks": 2},
            "placement": "disjoint", "microbatches": 4, "global_batch_size": 8, "world_size": 3}
    base["llm"].update(llm or {})
    base.update(changes)
    return base


def test_schedule_round_trips_and_old_plans_read_as_1f1b(tmp_path):
    path = tmp_path / "plan.yaml"
    write_plan(raw(), path)
    plan = read_plan(path).plan
    assert (plan.layout.schedule, plan.layout.chunks, plan.llm_layers) == ("interleaved", 2, (1, 1, 1, 1))
    assert plan.llm.to_dict()["schedule"] == "interleaved" and plan.llm.to_dict()["chunks"] == 2
    assert plan.llm_rank_layers == (2, 2)
    old = raw(llm={"layers_per_stage": [2, 2]})
    del old["llm"]["schedule"], old["llm"]["chunks"]
    plan = plan_from_dict(old).plan
    assert (plan.layout.schedule, plan.layout.chunks) == ("1f1b", 1)
    assert plan.to_dict(8)["llm"]["schedule"] == "1f1b"  # new plans always write the keys
    assert "schedule" not in plan.to_dict(8)["vision"]


@pytest.mark.parametrize("llm, top, match", [
    ({"chunks": 1}, {}, "llm.chunks: interleaved needs at least 2"),
    ({"schedule": "zb-h1"}, {}, "llm.chunks: zb-h1 runs one model chunk"),
    ({"schedule": "gpipe", "chunks": 1}, {}, "llm.schedule: expected one of"),
    ({"layers_per_stage": [2, 2]}, {}, r"llm.layers_per_stage: expected a list of 4 .*pp x chunks = 2 x 2"),
    ({"recompute": ["none", "full"]}, {}, "llm.recompute: expected a list of 4"),
    ({}, {"microbatches": 3, "global_batch_size": 9}, "microbatches: interleaved needs a multiple of llm.pp"),
    ({"pp": 1, "layers_per_stage": [2, 2]}, {"world_size": 2}, r"interleaved needs pipeline parallelism"),
    ({"chunks": 0}, {}, "llm.chunks: expected an integer >= 1"),
])
def test_schedule_errors_name_the_key(llm, top, match):
    with pytest.raises(UserError, match=match):
        plan_from_dict(raw(llm, **top), "plan.yaml")


def test_vision_has_no_schedule_key():
    doc = raw()
    doc["vision"]["schedule"] = "zb-h1"
    with pytest.raises(UserError, match="vision.schedule: unknown key .the vision tower always runs 1F1B"):
        plan_from_dict(doc, "plan.yaml")


def test_with_schedule_splits_each_rank_over_its_chunks():
    lay = Layout("colocated", 1, 1, 1, 1, 3, 1, 6)
    plan = Plan(lay, (4,), (5, 3, 4)).with_forced_techniques("full")
    inter = plan.with_schedule("interleaved", 2)
    # rank r's chunks are r, r + 3: rank 0's 5 layers as 3 + 2, rank 1's 3 as 2 + 1, rank 2's 4 as 2 + 2
    assert inter.llm_layers == (3, 2, 2, 2, 1, 2) and inter.llm_rank_layers == plan.llm_layers
    assert inter.llm_techniques.recompute == ("full",) * 6 and inter.layout.chunks == 2
    assert plan.with_schedule("zb-h1").llm_layers == plan.llm_layers


def _held_until_w(res, row):
    """Most microbatches of `row` whose forward has started and whose weight gradient has not ended."""
    start, end = res.fwd_start[row], res.w_end[row]
    return max(int(((start <= t) & (end > t)).sum()) for t in start)


@pytest.mark.parametrize("n_v, p, m", [(0, 4, 8), (2, 4, 8), (0, 4, 2), (1, 3, 6), (0, 1, 3), (2, 2, 1)])
def test_zb_h1_in_flight_matches_the_simulator(n_v, p, m):
    """Bug caught: counting only 1F1B's p - s (the microbatches whose B is due) and not the
    postponed W's inputs underprices the later stages' memory."""
    rng = np.random.default_rng(n_v * 100 + p * 10 + m)
    res = simulate_dp(rng.uniform(1, 2, (n_v, m)), rng.uniform(2, 4, (n_v, m)), rng.uniform(1, 2, (1, p, m)),
                      rng.uniform(2, 4, (1, p, m)), schedule="zb-h1", wgrad_frac=0.4)
    ours = Layout("disjoint", 1, max(n_v, 1), 1, 1, p, 1, m, "zb-h1").in_flight() if n_v else \
        Layout("colocated", 1, 1, 1, 1, p, 1, m, "zb-h1").in_flight()
    expect = [int(res.in_flight[k]) for k in range(n_v)] + [_held_until_w(res, n_v + j) for j in range(p)]
    assert ours == expect


@pytest.mark.parametrize("n_v, p, v, m", [(0, 4, 2, 8), (2, 4, 2, 8), (0, 4, 3, 4), (1, 2, 2, 4), (2, 4, 2, 4),
                                          (1, 4, 4, 12), (3, 2, 3, 6), (1, 3, 2, 9)])
def test_interleaved_in_flight_matches_the_simulator(n_v, p, v, m):
    """Bugs caught: Megatron's warm-up without its m == p case (all forwards first), and vision
    stages counted as 1F1B's P - k instead of following rank 0's first chunk."""
    rng = np.random.default_rng(m * 7 + p)
    res = simulate_dp(rng.uniform(1, 2, (n_v, m)), rng.uniform(2, 4, (n_v, m)), rng.uniform(1, 2, (1, p * v, m)),
                      rng.uniform(2, 4, (1, p * v, m)), schedule="interleaved", chunks=v)
    lay = (Layout("disjoint", 1, n_v, 1, 1, p, 1, m, "interleaved", v) if n_v
           else Layout("colocated", 1, 1, 1, 1, p, 1, m, "interleaved", v))
    ours = lay.in_flight()
    assert ours[:n_v] == [float(x) for x in res.in_flight[:n_v]]
    assert [f * v for f in ours[n_v:]] == [float(x) for x in res.device_in_flight[n_v:]]


def test_1f1b_in_flight_unchanged():
    lay = Layout("disjoint", 1, 2, 1, 1, 3, 1, 4)
    assert lay.in_flight() == [4, 4, 3, 2, 1] and all(isinstance(f, int) for f in lay.in_flight())
