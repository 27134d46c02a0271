"""The executor's op order is the simulator's (an independent implementation of 1F1B / GPipe);
what it uploads to a GPU is concatenated into page-locked memory."""

from __future__ import annotations

import pytest
import torch

from dflop.runtime.schedule import op_order
from dflop.sim.pipeline import stage_op_order


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("n_stages,m", [(1, 1), (2, 1), (3, 2), (4, 4), (4, 9), (6, 3)])
def test_op_order_matches_the_simulator(schedule, n_stages, m):
    for stage in range(n_stages):
        ours = [(0 if kind == "F" else 1, p) for kind, p in op_order(schedule, stage, n_stages, m)]
        assert ours == stage_op_order(schedule, stage, n_stages, m)


@pytest.mark.parametrize("n_stages,m", [(3, 2), (4, 8)])
def test_1f1b_keeps_at_most_p_minus_s_microbatches_in_flight(n_stages, m):
    for stage in range(n_stages):
        in_flight, peak, done = 0, 0, set()
        for kind, p in op_order("1f1b", stage, n_stages, m):
            if kind == "F":
                in_flight += 1
            else:
                assert p not in done
                done.add(p)
                in_flight -= 1
            peak = max(peak, in_flight)
        assert peak == min(m, n_stages - stage) and done == set(range(m))


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule must be one of"):
        op_order("interleaved", 0, 2, 2)


def test_host_cat_concatenates_into_a_pinned_buffer_when_asked(monkeypatch):
    """What a CUDA executor uploads (pixels, token ids, labels) is concatenated into page-locked
    memory (`pinned_empty`, faked here: real pinning needs CUDA), else plainly."""
    from dflop.runtime import schedule

    made = []

    def fake_pinned(shape, dtype):
        made.append(torch.empty(shape, dtype=dtype))
        return made[-1]

    monkeypatch.setattr(schedule, "pinned_empty", fake_pinned)
    parts = [torch.arange(6.0).reshape(2, 3), torch.arange(3.0).reshape(1, 3) + 10]
    out = schedule.host_cat(parts, pin=True)
    assert torch.equal(out, torch.cat(parts)) and len(made) == 1 and out.data_ptr() == made[0].data_ptr()
    made.clear()
    assert torch.equal(schedule.host_cat(parts, pin=False), torch.cat(parts)) and made == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_host_cat_keeps_what_cat_drops_page_locked():
    from dflop.runtime.schedule import host_cat

    parts = [torch.ones(2, 3).pin_memory(), torch.zeros(1, 3).pin_memory()]
    assert not torch.cat(parts).is_pinned()  # why host_cat exists: a non_blocking copy of it is synchronous
    assert host_cat(parts, pin=True).is_pinned()


def _interleaved_plan(placement: str, pp_v: int, pp_l: int, v: int, m: int):
    from dflop.plan import Layout, Plan

    layout = Layout(placement, 1, pp_v, 1, 1, pp_l, 1, m, "interleaved", v)
    return Plan(layout, (1,) * pp_v, (1,) * (pp_l * v))


@pytest.mark.parametrize("placement,pp_v,pp_l,v,m", [("disjoint", 1, 2, 2, 4), ("disjoint", 2, 2, 3, 6),
                                                      ("disjoint", 1, 3, 2, 3), ("colocated", 1, 2, 2, 2),
                                                      ("colocated", 1, 4, 2, 8)])
def test_interleaved_rank_orders_are_the_ones_the_simulator_times(placement, pp_v, pp_l, v, m):
    """Every rank runs the simulator's order for its device (LLM chunk k of rank r = virtual stage
    k pp + r = the simulator's row; vision stages first). Fails if the chunks a rank holds
    (`Topology.rank_chunks`), its warm-up count or the vision stages' lead differed from what the
    step was priced with."""
    from dflop.runtime.schedule import rank_op_order
    from dflop.runtime.topology import Topology
    from dflop.sim.pipeline import _device_orders

    plan = _interleaved_plan(placement, pp_v, pp_l, v, m)
    n_vis = plan.layout.n_vision_stages
    row_of = [[s] for s in range(n_vis + pp_l * v)]
    row_device, orders = _device_orders((1,) * (n_vis + pp_l * v), row_of, m, "interleaved", n_vis, v)
    for rank in range(plan.world_size):
        topo = Topology(plan, rank, plan.world_size)
        ours = rank_op_order(topo, "1f1b", m)
        if topo.llm_role is not None:  # compared by virtual stage: the chunk the rank really holds
            device = row_device[n_vis + topo.llm_role.stage]
            expected = [("FB"[kind], row - n_vis, j) for row, kind, j in orders[device]]
            held = topo.rank_chunks(topo.llm_role)
            ours = [(kind, held[k], j) for kind, k, j in ours]
        else:
            device = row_device[topo.vision_role.stage]
            expected = [("FB"[kind], 0, j) for _, kind, j in orders[device]]
        assert ours == expected, rank
        assert sorted((c, j) for kind, c, j in ours if kind == "F") == \
            sorted((c, j) for kind, c, j in ours if kind == "B")


def test_gpipe_on_an_interleaved_or_zb_h1_plan_is_refused():
    from dflop.errors import UserError
    from dflop.runtime.schedule import rank_op_order
    from dflop.runtime.topology import Topology

    for plan in (_interleaved_plan("disjoint", 1, 2, 2, 4), _zb_h1_plan("disjoint", 1, 2, 4)):
        with pytest.raises(UserError, match="train.schedule gpipe cannot run"):
            rank_op_order(Topology(plan, 1, 3), "gpipe", 4)


def _zb_h1_plan(placement: str, pp_v: int, pp_l: int, m: int):
    from dflop.plan import Layout, Plan

    layout = Layout(placement, 1, pp_v, 1, 1, pp_l, 1, m, "zb-h1")
    return Plan(layout, (1,) * pp_v, (1,) * pp_l)


@pytest.mark.parametrize("placement,pp_v,pp_l,m", [("disjoint", 1, 2, 4), ("disjoint", 2, 3, 5),
                                                    ("disjoint", 1, 4, 2), ("colocated", 1, 2, 2),
                                                    ("colocated", 1, 4, 8)])
def test_zb_h1_rank_orders_are_the_ones_the_simulator_times(placement, pp_v, pp_l, m):
    """Every LLM rank runs the simulator's ZB-H1 order for its device (B and W apart, W deferred as
    priced), every vision stage the simulator's unsplit 1F1B order timed to the LLM's first stage.
    Fails if a rank ran 1F1B's order, W right after its B everywhere, or its postponed W's
    elsewhere than the step was priced with; and unless every microbatch gets one F, B and W."""
    from dflop.runtime.schedule import rank_op_order
    from dflop.runtime.topology import Topology
    from dflop.sim.pipeline import _device_orders

    plan = _zb_h1_plan(placement, pp_v, pp_l, m)
    n_vis = plan.layout.n_vision_stages
    row_of = [[s] for s in range(n_vis + pp_l)]
    row_device, orders = _device_orders((1,) * (n_vis + pp_l), row_of, m, "zb-h1", n_vis, 1)
    for rank in range(plan.world_size):
        topo = Topology(plan, rank, plan.world_size)
        stage = topo.pipeline_stage
        expected = [("FBW"[kind], 0, j) for _, kind, j in orders[row_device[stage]]]
        ours = rank_op_order(topo, "1f1b", m)
        assert ours == expected, rank
        kinds = "FBW" if topo.llm_role is not None else "FB"
        for kind in kinds:
            assert sorted(j for k, _, j in ours if k == kind) == list(range(m)), (rank, kind)
        if topo.llm_role is not None:  # each W after its own B
            assert all(ours.index(("W", 0, j)) > ours.index(("B", 0, j)) for j in range(m))
