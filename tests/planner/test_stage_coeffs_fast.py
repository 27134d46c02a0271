"""The planner's stage coefficients (`stages._stage_coeffs`, evaluated stage by stage on floats)
against the straightforward numpy form written here: `stage_coeffs` per module plus the transfers,
concatenated (the library's form before the float path, kept as this test's reference). The
training state both take from `dflop.pricing.stage.stage_state_lines` (the one composition, which
`test_stage_model_agrees_with_pricing.py` holds against `Pricing`).
Bit-identical, not approximately equal: the search compares these numbers across layouts, and the
speed-up must not move any plan."""

from dataclasses import dataclass, fields, replace

import numpy as np
import pytest

from dflop.costmodel.analytic import analytic_cost_model
from dflop.costmodel.memory import sharded_state_scale
from dflop.costmodel.model import CostModel, StepCosts
from dflop.models.builder import model_config
from dflop.models.info import model_info
from dflop.plan import Layout
from dflop.pricing.cluster import Cluster
from dflop.planner.means import Granularity, PartMeans, module_means
from dflop.pricing.pool import Pool, TransferSizes
from dflop.planner.stages import StageCoeffs, TransferMeans, build_stage_model
from dflop.pricing.cluster import links
from dflop.pricing.stage import StageState, modules_state_of, stage_state_lines
from dflop.planner.space import ModelShape
from dflop.planner.technique_choice import TechniqueMeans, TechniqueSpace
from synthetic_mix import llava_ov_mix

MODES = ("none", "selective", "full")


def plus_time(c: StageCoeffs, fwd_s=0.0, bwd_s=0.0) -> StageCoeffs:
    """The same stages with `fwd_s` / `bwd_s` more seconds per microbatch (transfers)."""
    values = {f.name: getattr(c, f.name) for f in fields(c)}
    values["time_fixed"] = c.time_fixed + fwd_s + bwd_s
    values["bwd_fixed"] = c.bwd_fixed + bwd_s
    return StageCoeffs(**values)


@dataclass(frozen=True)
class _PartAt:
    """A part's costs on one microbatch, as arrays over stages."""

    time: np.ndarray
    bwd: np.ndarray
    act_mean: np.ndarray
    act_heaviest: np.ndarray
    static: np.ndarray
    grad: np.ndarray
    optim: np.ndarray
    transient_mean: np.ndarray  # the largest of the part's transients (a stage holds one module's at a time)
    transient_max: np.ndarray

    @classmethod
    def of(cls, part: PartMeans, nu, heaviest_share, time_nu) -> "_PartAt":
        return cls(part.time_s(time_nu), part.bwd_s(time_nu), part.act_mean(nu), part.act_heaviest(heaviest_share),
                   part.static_bytes, part.grad_bytes, part.optimizer_s, part.transient_mean(nu),
                   part.transient_heaviest(heaviest_share))

    def scaled(self, k) -> "_PartAt":
        """k x every sum; the transients of parts that are present (k a 0/1 mask here) as they are."""
        return _PartAt(*(k * getattr(self, f.name) for f in fields(self)))

    def __add__(self, other: "_PartAt") -> "_PartAt":
        return _PartAt(*(np.maximum(getattr(self, f.name), getattr(other, f.name)) if f.name.startswith("transient")
                         else getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def stage_coeffs(means, *, nu, heaviest_share, first, last, in_flight, state, per_layer, extra=None, extra_nu=None,
                 extra_on=True, time_nu=None, mode=None, state_scale=1.0) -> StageCoeffs:
    """Coefficients of the stages of one module, whole arrays (see `_stage_coeffs`'s docstring)."""
    first = np.asarray(first, dtype=np.float64)
    last = np.asarray(last, dtype=np.float64)
    tnu = nu if time_nu is None else time_nu
    layer = _PartAt.of(means.layers[mode or means.modes[0]], nu, heaviest_share, tnu)
    fixed = _PartAt.of(means.first, nu, heaviest_share, tnu).scaled(first) + \
        _PartAt.of(means.last, nu, heaviest_share, tnu).scaled(last)
    if extra is not None:
        fixed = fixed + _PartAt.of(extra, extra_nu, 1.0, tnu).scaled(np.asarray(extra_on, dtype=np.float64))
    fixed = replace(fixed, static=state.static_bytes, grad=state.grad_bytes, optim=state.optimizer_s)
    layer = replace(layer, static=per_layer.static_bytes, grad=per_layer.grad_bytes, optim=per_layer.optimizer_s)
    return StageCoeffs(
        time_fixed=fixed.time, time_layer=layer.time,
        bwd_fixed=fixed.bwd, bwd_layer=layer.bwd,
        mem_mean_fixed=state_scale * fixed.static + in_flight * fixed.act_mean
        + np.maximum(layer.transient_mean, fixed.transient_mean),
        mem_mean_layer=state_scale * layer.static + in_flight * layer.act_mean,
        mem_max_fixed=state_scale * fixed.static + in_flight * fixed.act_heaviest
        + np.maximum(layer.transient_max, fixed.transient_max),
        mem_max_layer=state_scale * layer.static + in_flight * layer.act_heaviest,
        grad_fixed=fixed.grad, grad_layer=layer.grad, optim_fixed=fixed.optim, optim_layer=layer.optim,
    )


def reference_coeffs(lay, vision, llm, link, B, transfer, granularity, shard, dtype, mode) -> StageCoeffs:
    """Whole-array numpy: one `stage_coeffs` call per module, `plus_time` for the transfers."""
    in_flight = np.asarray(lay.in_flight(), dtype=np.float64)
    n_v, pp_l, m = lay.n_vision_stages, lay.pp_l, lay.m
    state, per_layer = stage_state_lines(lay, modules_state_of(vision.state, llm.state), vision.n_layers)

    def part(s: StageState, side: slice) -> StageState:
        return StageState(*(getattr(s, f.name)[side] for f in fields(StageState)))
    parts = []
    if n_v:
        nu_v = B / (m * lay.dp_v)
        k = np.arange(n_v)
        c = stage_coeffs(vision, nu=np.full(n_v, nu_v), heaviest_share=1.0 / lay.dp_v, first=k == 0,
                         last=k == n_v - 1, in_flight=in_flight[:n_v], mode=mode, state=part(state, slice(0, n_v)),
                         per_layer=part(per_layer, slice(0, n_v)),
                         state_scale=float(sharded_state_scale(dtype, lay.dp_v)) if shard[0] else 1.0)
        hop = nu_v * transfer.vision_hop_bytes / float(link.vision_hop_bps)
        out = nu_v * transfer.feature_bytes / float(link.vision_to_llm_bps)
        parts.append(plus_time(c, fwd_s=np.where(k > 0, hop, 0.0), bwd_s=np.where(k < n_v - 1, hop, out)))
    nu_l = B / (m * lay.dp_l)
    j = np.arange(pp_l)
    c = stage_coeffs(llm, nu=np.full(pp_l, nu_l), heaviest_share=1.0, first=j == 0, last=j == pp_l - 1,
                     in_flight=in_flight[n_v:], state=part(state, slice(n_v, None)),
                     per_layer=part(per_layer, slice(n_v, None)), extra=vision.whole(mode) if lay.colocated else None,
                     extra_nu=nu_l,
                     extra_on=j == 0, time_nu=np.full(pp_l, float(granularity.nu_time(nu_l, m))), mode=mode,
                     state_scale=float(sharded_state_scale(dtype, lay.dp_l)) if shard[1] else 1.0)
    hop = nu_l * transfer.llm_hop_bytes / float(link.llm_hop_bps)
    features = 0.0 if lay.colocated else nu_l * transfer.feature_bytes / float(link.vision_to_llm_bps)
    parts.append(plus_time(c, fwd_s=np.where(j > 0, hop, features), bwd_s=np.where(j < pp_l - 1, hop, 0.0)))
    return StageCoeffs(**{f.name: np.concatenate([np.broadcast_to(getattr(p, f.name), (len(p.time_layer),))
                                                  for p in parts]).astype(np.float64) for f in fields(StageCoeffs)})


@pytest.fixture(scope="module")
def analytic():
    """A cost model that prices every recompute mode (the analytic one, tiny preset) and a small mix."""
    arch = ("llava_ov", "siglip-small", "qwen2.5-small")
    cost = analytic_cost_model(model_config(*arch), tp_degrees=(1, 2), dtype="bfloat16")
    # with measured optimizer seconds per module (the analytic model has none), its tied LM head's share too
    cost = CostModel([replace(m, optimizer_s=1e-5 + 3e-12 * m.param_bytes) for m in cost.modules.values()],
                     cost.provenance, StepCosts(optimizer_call_s=2e-5))
    assert cost.module("llm_head", 1).tied_param_bytes > 0
    return cost, Pool.from_shapes(llava_ov_mix(300, seed=0))


LAYOUTS = [Layout("colocated", 2, 1, 4, 2, 1, 4, 2), Layout("colocated", 1, 1, 2, 1, 3, 2, 4),
           Layout("disjoint", 1, 1, 3, 2, 1, 5, 1), Layout("disjoint", 2, 3, 2, 1, 4, 3, 8),
           Layout("disjoint", 1, 2, 1, 2, 2, 1, 2)]


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.describe())
def test_stage_coeffs_equal_the_numpy_form_bit_for_bit(analytic, lay):
    cost_model, pool = analytic
    B = 96
    # two nodes of 8, so some hops cross the slower link; real transfer sizes, granularity floors
    cluster = Cluster(nodes=4, gpus_per_node=8, gpu_memory_bytes=1e11, intra_node_bytes_per_s=3e11,
                      inter_node_bytes_per_s=5e10, p2p_latency_s=2e-5)
    transfer = TransferMeans.of(pool, TransferSizes.for_model(llm_hidden=64, vision_hidden=32,
                                                              vision_tokens_per_tile=16, dtype="bfloat16"))
    granularity = Granularity({1: 3.0, 2: 5.5, 4: 7.25, 8: 9.0})  # bins of the smaller layouts priced at the floor
    vision = module_means(cost_model, "vision", lay.tp_v, pool, 6, modes=MODES)
    llm = module_means(cost_model, "llm", lay.tp_l, pool, 8, modes=MODES)
    assert len(vision.modes) > 1 and len(llm.modes) > 1, "the toy model should price several recompute modes"
    link = links(cluster, colocated=lay.colocated, tp_v=lay.tp_v, pp_v=lay.pp_v, dp_v=lay.dp_v, tp_l=lay.tp_l,
                 pp_l=lay.pp_l, dp_l=lay.dp_l)
    for shard in ((False, False), (True, True), (False, True)):
        sm = build_stage_model(lay, vision, llm, cluster=cluster, global_batch=B, transfer=transfer,
                               granularity=granularity, shard=shard, dtype="bfloat16")
        for mode in sm.modes:
            got = sm.by_mode[mode]
            want = reference_coeffs(lay, vision, llm, link, B, transfer, granularity, sm.shard, "bfloat16", mode)
            for f in fields(StageCoeffs):
                g, w = getattr(got, f.name), getattr(want, f.name)
                assert g.dtype == np.float64 and g.shape == (sm.n_stages,), f.name
                assert np.array_equal(g, w), (mode, shard, f.name, g, w)


def test_mixed_modes_pick_each_stage_from_its_mode(analytic):
    """A split with a different recompute mode per stage reads stage s's coefficients from mode s."""
    cost_model, pool = analytic
    lay = Layout("disjoint", 1, 2, 2, 2, 3, 2, 4)
    vision = module_means(cost_model, "vision", 1, pool, 6, modes=MODES)
    llm = module_means(cost_model, "llm", 2, pool, 8, modes=MODES)
    sm = build_stage_model(lay, vision, llm, cluster=Cluster(nodes=2, gpus_per_node=8, gpu_memory_bytes=1e11),
                           global_batch=48, transfer=TransferMeans(1e5, 2e5, 3e5))
    modes = ["full", "none", "selective", "full", "none"]
    for _ in range(2):  # the second read comes from the per-mix cache
        got = sm.coeffs_of(modes)
        for f in fields(StageCoeffs):
            want = [getattr(sm.by_mode[m], f.name)[s] for s, m in enumerate(modes)]
            assert getattr(got, f.name).tolist() == want, f.name
    n = [3, 3, 2, 3, 3]
    assert sm.memory_at(n, modes).tolist() == [sm.memory_at(n, [m] * 5)[s] for s, m in enumerate(modes)]


def test_technique_means_reuses_a_model_only_for_the_same_inputs(analytic):
    """`TechniqueMeans.stage_model` hands back the model it built for equal inputs, and builds anew
    when the cluster (here its GPU memory) or the batch differs."""
    cost_model, pool = analytic
    shape = ModelShape.from_info(model_info("llava_ov", "siglip-small", "qwen2.5-small"))
    means = TechniqueMeans.of(cost_model, pool, shape, [1], [2], TechniqueSpace())
    lay = Layout("disjoint", 1, 1, 2, 2, 2, 3, 4)
    transfer = TransferMeans(1e5, 2e5, 3e5)
    small, big = (Cluster(nodes=2, gpus_per_node=8, gpu_memory_bytes=g) for g in (1e10, 2e10))
    kw = dict(global_batch=48, transfer=transfer)
    first = means.stage_model(lay, (True, True, True), cluster=small, **kw)
    assert means.stage_model(lay, (True, True, True), cluster=small, **kw) is first
    other = means.stage_model(lay, (True, True, True), cluster=big, **kw)
    assert other is not first and other.memory_bytes == 2e10
    assert means.stage_model(lay, (True, True, False), cluster=big, **kw).sequence_parallel is False
    bigger = means.stage_model(lay, (True, True, True), cluster=big, global_batch=96, transfer=transfer)
    fresh = build_stage_model(lay, means.vision[1], means.llm[(2, True)], cluster=big, global_batch=96,
                              transfer=transfer, shard=(True, True), dtype=means.dtype)
    assert np.array_equal(bigger.coeffs.mem_mean_fixed, fresh.coeffs.mem_mean_fixed)
    assert not np.array_equal(bigger.coeffs.mem_mean_fixed, first.coeffs.mem_mean_fixed)


def test_granularity_floor_is_the_ratio_of_each_elements_m():
    """`Granularity.nu_time` on arrays (the screen's every layout) looks each m up: max(nu, ratio[m]),
    0 for an m the data gave no ratio for; scalars stay scalars."""
    g = Granularity({1: 3.0, 2: 5.5, 4: 7.25, 8: 9.0})
    rng = np.random.default_rng(0)
    m = rng.choice([1, 2, 4, 8, 16], size=(40, 3))
    nu = rng.uniform(0.0, 10.0, size=(40, 3))
    want = [[max(nu[i, j], g.ratio.get(int(m[i, j]), 0.0)) for j in range(3)] for i in range(40)]
    assert g.nu_time(nu, m).tolist() == want
    assert g.nu_time(2.0, 4) == 7.25 and g.nu_time(2.0, 16) == 2.0 and np.ndim(g.nu_time(2.0, 4)) == 0
    assert Granularity.none().nu_time(nu, m) is nu
