"""Topology arithmetic: every rank has one place, and the feature routes pair up exactly."""

from __future__ import annotations

import itertools

import pytest

from dflop.plan import plan_from_dict
from dflop.runtime.topology import LLM, VISION, Topology


def make_plan(vision, llm, placement="disjoint"):
    (vt, vp, vd), (lt, lp, ld) = vision, llm
    world = lt * lp * ld + (0 if placement == "colocated" else vt * vp * vd)
    return plan_from_dict({"vision": {"tp": vt, "pp": vp, "dp": vd, "layers_per_stage": [1] * vp},
                           "llm": {"tp": lt, "pp": lp, "dp": ld, "layers_per_stage": [1] * lp},
                           "placement": placement, "microbatches": 2, "global_batch_size": 64, "world_size": world}).plan


LAYOUTS = [((1, 1, 1), (1, 2, 1), "disjoint"), ((1, 2, 2), (2, 2, 3), "disjoint"), ((2, 1, 1), (1, 1, 2), "disjoint"),
           ((1, 1, 3), (2, 1, 2), "disjoint"), ((2, 1, 2), (2, 3, 2), "colocated"), ((1, 1, 1), (1, 1, 1), "colocated")]


@pytest.mark.parametrize("vision,llm,placement", LAYOUTS)
def test_every_rank_has_exactly_one_place(vision, llm, placement):
    plan = make_plan(vision, llm, placement)
    topos = [Topology(plan, r, plan.world_size) for r in range(plan.world_size)]
    llm_places = {(t.llm_role.stage, t.llm_role.replica, t.llm_role.tp_rank): t.rank for t in topos if t.llm_role}
    assert len(llm_places) == plan.llm.n_ranks
    for (stage, replica, tp_rank), rank in llm_places.items():
        assert topos[0].rank_of(LLM, stage, replica, tp_rank) == rank
    vision_ranks = [t for t in topos if t.vision_role]
    if placement == "disjoint":
        assert [t.rank for t in vision_ranks] == list(range(plan.vision.n_ranks))  # vision ranks first
        assert not any(t.vision_role and t.llm_role for t in topos)
        assert sorted(t.pipeline_stage for t in topos) == sorted(
            [k for k in range(plan.vision.pp) for _ in range(plan.vision.tp * plan.vision.dp)]
            + [plan.vision.pp + j for j in range(plan.llm.pp) for _ in range(plan.llm.tp * plan.llm.dp)])
    else:
        assert all(t.llm_role.stage == 0 for t in vision_ranks)  # the tower lives on LLM stage 0
        assert len(vision_ranks) == plan.llm.tp * plan.llm.dp
    for t in topos:  # TP is innermost: a TP group is consecutive ranks
        for role in (t.vision_role, t.llm_role):
            if role is not None and not (role.module == VISION and plan.colocated):
                first = t.rank_of(role.module, role.stage, role.replica, 0)
                assert t.rank == first + role.tp_rank


@pytest.mark.parametrize("vision,llm", [(v, l) for v, l, p in LAYOUTS if p == "disjoint"])
def test_feature_routes_pair_every_receiver_with_one_sender(vision, llm):
    plan = make_plan(vision, llm)
    topos = [Topology(plan, r, plan.world_size) for r in range(plan.world_size)]
    last_vision = [t for t in topos if t.vision_role and t.vision_role.is_last]
    first_llm = [t for t in topos if t.llm_role and t.llm_role.is_first]
    sends = {(t.rank, dst) for t in last_vision for dsts in t.feature_destinations().values() for dst in dsts}
    receives = {(t.feature_source(v), t.rank) for t in first_llm for v in range(plan.vision.dp)}
    assert sends == receives
    for t in first_llm:  # one sender per vision replica, of that replica
        sources = [t.feature_source(v) for v in range(plan.vision.dp)]
        assert [topos[s].vision_role.replica for s in sources] == list(range(plan.vision.dp))
    grad_sends = {(t.rank, dst) for t in first_llm for dsts in t.feature_grad_destinations().values() for dst in dsts}
    grad_receives = {(t.feature_grad_source(r), t.rank) for t in last_vision for r in range(plan.llm.dp)}
    assert grad_sends == grad_receives
    assert {dst for _, dst in grad_sends} == {t.rank for t in last_vision}


def test_groups_listed_identically_and_cover_grids():
    plan = make_plan((1, 2, 2), (2, 2, 3))
    lists = [Topology(plan, r, plan.world_size, tied_embeddings=True)._group_ranks() for r in range(plan.world_size)]
    assert all(g == lists[0] for g in lists)  # the same creation order on every rank
    groups = dict.fromkeys(("vision_tp", "vision_dp", "llm_tp", "llm_dp", "tied_embedding"), 0)
    for name, ranks in lists[0]:
        groups[name] += 1
    assert groups == {"vision_tp": 4, "vision_dp": 2, "llm_tp": 6, "llm_dp": 4, "tied_embedding": 6}
    for name, ranks in lists[0]:
        if name == "llm_dp":
            topos = [Topology(plan, r, plan.world_size) for r in ranks]
            assert len({(t.llm_role.stage, t.llm_role.tp_rank) for t in topos}) == 1
            assert sorted(t.llm_role.replica for t in topos) == [0, 1, 2]
    assert list(itertools.chain.from_iterable(r for n, r in lists[0] if n == "llm_tp")) == list(range(4, 16))
