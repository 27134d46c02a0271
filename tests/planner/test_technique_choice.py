"""The planner's choice of memory techniques against brute force on small instances.

- The MILP picks per stage a recompute mode and a layer count: its optimum must equal the best
  of every (split, mode per stage) that fits, written out in full.
- `settle` picks, for a fixed split, each stage's mode and the module-level sharding / sequence
  parallelism: with each of them chosen (auto), forced on or forced off, its step must be the best
  over every setting the config allows and mode assignment that fits, and every technique it chose
  to leave on must be needed (without it nothing as fast fits).
- The memory floor the screen drops layouts by keeps every layout some allowed setting fits.
- The whole search on a real (analytic) cost model: where no plan fits without techniques, the
  chosen plan names techniques under which its predicted per-stage memory fits.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from dflop.costmodel.analytic import analytic_cost_model
from dflop.errors import UserError
from dflop.models.builder import model_config
from dflop.models.info import model_info
from dflop.plan import Layout
from dflop.pricing.cluster import GB, Cluster
from dflop.pricing.pool import Pool, TransferSizes
from dflop.planner.milp import solve_split
from dflop.planner.screen import SearchSpace, layout_of, screen
from dflop.planner.search import SearchSettings, search
from dflop.planner.space import ModelShape
from dflop.planner.stages import TransferMeans
from dflop.planner.technique_choice import TechniqueMeans, TechniqueSpace
from planner_testlib import all_splits, enumerate_layouts, random_stage_model
from synthetic_mix import llava_ov_mix

MODES = ("none", "selective", "full")
# (pp_v, pp_l, vision layers, llm layers, m, dp), seed, memory as a fraction of the least any split
# needs without recomputation (below 1: some stage must recompute)
CASES = [((0, 2, 0, 6, 4, 1), 0, 0.9), ((1, 2, 2, 6, 4, 1), 1, 0.8), ((2, 2, 4, 6, 8, 2), 2, 0.8),
         ((0, 3, 0, 8, 4, 1), 3, 0.9), ((1, 3, 3, 7, 2, 2), 4, 0.85), ((0, 4, 0, 8, 8, 1), 5, 0.95),
         ((1, 2, 2, 6, 4, 1), 6, 1.2)]


def _instance(case, seed, memory):
    pp_v, pp_l, lv, ll, m, dp = case
    sm = random_stage_model(np.random.default_rng(seed), pp_v=pp_v, pp_l=pp_l, vision_layers=max(lv, 1),
                            llm_layers=ll, m=m, dp=dp, modes=MODES)
    need = min(sm.memory_at(n, ["none"] * sm.n_stages).max() for n in all_splits(sm))
    return replace(sm, memory_bytes=memory * need)


def _brute_force(sm):
    best, best_key = np.inf, None
    for n in all_splits(sm):
        for modes in itertools.product(sm.modes, repeat=sm.n_stages):
            if sm.fits(n, modes):
                obj = sm.objective_s(n, modes)
                if obj < best:
                    best, best_key = obj, (tuple(n), modes)
    return best, best_key


@pytest.mark.parametrize("case,seed,memory", CASES)
def test_milp_modes_and_split_equal_brute_force(case, seed, memory):
    sm = _instance(case, seed, memory)
    best, key = _brute_force(sm)
    res = solve_split(sm, rel_gap=0.0)
    if not np.isfinite(best):
        assert not res.has_solution
        return
    assert res.status == "optimal"
    assert sm.fits(res.split, res.modes)
    assert res.objective_s == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("case,seed", [((0, 3, 0, 6, 4, 1), 0), ((1, 2, 3, 6, 2, 1), 1), ((2, 2, 4, 5, 8, 2), 2)])
def test_a_stage_whose_fixed_seconds_dominate_still_holds_a_layer(case, seed):
    """Every stage holds at least one layer: where the first LLM stage's fixed seconds (embedding,
    a colocated tower) dwarf a layer's, the best split would empty it if it could, so the MILP with
    recompute modes (where `x <= n` is what keeps a stage's layer) must still equal the brute
    force over splits of >= 1 layer per stage, and give that stage one layer."""
    pp_v, pp_l, lv, ll, m, dp = case
    sm = random_stage_model(np.random.default_rng(seed), pp_v=pp_v, pp_l=pp_l, vision_layers=max(lv, 1),
                            llm_layers=ll, m=m, dp=dp, modes=MODES)
    first_llm = pp_v
    heavy = {mode: replace(c, time_fixed=c.time_fixed + np.eye(sm.n_stages)[first_llm] * 20.0)
             for mode, c in sm.by_mode.items()}
    sm = replace(sm, by_mode=heavy, memory_bytes=10.0)  # 10x the GPU the stages were drawn for: all fit
    best, (split, _) = _brute_force(sm)
    assert split[first_llm] == 1
    res = solve_split(sm, rel_gap=0.0)
    assert res.status == "optimal" and res.split.min() >= 1 and res.split[first_llm] == 1
    assert res.objective_s == pytest.approx(best, rel=1e-9)


def test_the_instances_exercise_per_stage_choices():
    """Across the cases the optimum recomputes some stages and not others (what makes the per-stage
    choice worth a MILP), and somewhere needs recomputation at all."""
    mixed = needs = 0
    for case, seed, memory in CASES:
        _, key = _brute_force(_instance(case, seed, memory))
        if key is not None:
            used = set(key[1])
            needs += used != {"none"}
            mixed += len(used) > 1
    assert needs >= 3 and mixed >= 2


# ---- settle: techniques for a fixed split, on the analytic cost model of the small preset ----

ARCH = ("llava_ov", "siglip-small", "qwen2.5-small")


@pytest.fixture(scope="module")
def small():
    cost = analytic_cost_model(model_config(*ARCH), tp_degrees=(1, 2), dtype="float32")
    shape = ModelShape.from_info(model_info(*ARCH))
    pool = Pool.from_shapes(llava_ov_mix(300, seed=0))
    return cost, shape, pool


def _means(small, space=TechniqueSpace()):
    cost, shape, pool = small
    return TechniqueMeans.of(cost, pool, shape, (1, 2), (1, 2), space)


LAYOUTS = [Layout("disjoint", 1, 2, 2, 2, 2, 2, 4), Layout("colocated", 2, 1, 2, 2, 2, 2, 4),
           Layout("disjoint", 2, 1, 2, 2, 3, 1, 8)]
MEMORIES_GB = [0.6, 1.0, 1.6]


def _kw(small, memory_gb, gpus=8):
    cost, shape, pool = small
    sizes = TransferSizes.for_model(llm_hidden=shape.llm_hidden, vision_hidden=shape.vision_hidden,
                                    vision_tokens_per_tile=shape.vision_tokens_per_tile, dtype="float32")
    return dict(cluster=Cluster(nodes=1, gpus_per_node=gpus, gpu_memory_bytes=memory_gb * GB), global_batch=16,
                transfer=TransferMeans.of(pool, sizes))


def _even_split(layout, shape):
    """Each module's layers split as evenly as may be, the remainder on its last stage."""
    n_v = 0 if layout.colocated else shape.vision_layers
    split = np.r_[np.full(layout.n_vision_stages, n_v // max(layout.n_vision_stages, 1)),
                  np.full(layout.pp_l, shape.llm_layers // layout.pp_l)]
    split[layout.n_vision_stages - 1 if layout.n_vision_stages else 0] += (n_v % max(layout.n_vision_stages, 1))
    split[-1] += shape.llm_layers % layout.pp_l
    return split


# every way the config may set the two module-level techniques: chosen, forced on, forced off
KEYS = [dict(shard_optimizer=s, sequence_parallel=p) for s in ("auto", True, False) for p in ("auto", True, False)]


def _allowed_settings(layout, keys):
    """Every (shard vision, shard llm, LLM SP) the config `keys` allow on `layout`, written out: a
    technique is off where it does not apply (one replica, tp 1; the colocated vision tower is
    sharded as the LLM is, so its own flag is left off), else both values under auto, the forced one
    otherwise."""
    def values(key, applies):
        return (False,) if not applies else (False, True) if keys[key] == "auto" else (keys[key],)

    return list(itertools.product(values("shard_optimizer", layout.dp_v > 1 and not layout.colocated),
                                  values("shard_optimizer", layout.dp_l > 1),
                                  values("sequence_parallel", layout.tp_l > 1)))


@pytest.mark.parametrize("keys", KEYS, ids=lambda k: f"shard={k['shard_optimizer']}-sp={k['sequence_parallel']}")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("memory_gb", MEMORIES_GB)
def test_settle_is_the_fastest_allowed_setting_and_keeps_only_needed_techniques(small, layout, memory_gb, keys):
    """Brute force over every setting the config allows x every mode per stage: `settle` returns the
    fastest that fits, in an allowed setting (a forced technique stays on where it applies, a
    forced-off one never appears), and every technique it may switch off and leaves on is needed."""
    cost, shape, pool = small
    means = _means(small, TechniqueSpace.of(**keys))
    kw = _kw(small, memory_gb)
    split = _even_split(layout, shape)
    allowed = _allowed_settings(layout, keys)
    fitting = {}
    for setting in allowed:
        sm = means.stage_model(layout, setting, **kw)
        for modes in itertools.product(sm.modes, repeat=sm.n_stages):
            if sm.fits(split, modes):
                fitting[(setting, modes)] = sm.objective_s(split, modes)
    settled = means.fit(layout, split, **kw)
    if not fitting:
        assert settled is None
        return
    sm, modes = settled
    best = min(fitting.values())
    setting = (sm.shard[0] and not layout.colocated, sm.shard[1], sm.sequence_parallel)
    assert setting in allowed
    assert sm.fits(split, modes)
    assert sm.objective_s(split, modes) == pytest.approx(best, rel=1e-12)
    for i, on in enumerate(setting):
        if on and keys["sequence_parallel" if i == 2 else "shard_optimizer"] == "auto":
            # switching it off, nothing as fast fits
            off = tuple(False if j == i else v for j, v in enumerate(setting))
            assert not any(obj <= best * (1 + 1e-12) for (s, _), obj in fitting.items() if s == off)


def test_the_settle_cases_exercise_forced_techniques(small):
    """Somewhere a forced-on technique is one `settle` would switch off under auto (the split fits
    without it), so the forced cases above test that it stays on, for vision sharding as for the others."""
    for index in range(3):
        found = False
        for layout, memory_gb in itertools.product(LAYOUTS, MEMORIES_GB):
            on = dict(shard_optimizer=True, sequence_parallel=True)
            if not _allowed_settings(layout, on)[0][index]:
                continue
            settled = _means(small).fit(layout, _even_split(layout, small[1]), **_kw(small, memory_gb))
            if settled is not None:
                sm = settled[0]
                found |= not (sm.shard[0], sm.shard[1], sm.sequence_parallel)[index]
        assert found, index


# ---- the memory floor the screen drops layouts by ----

def _screen_space(small):
    cost, shape, pool = small
    return SearchSpace(vision_tp=(1, 2), llm_tp=(1, 2), colocated_tp=(1, 2), shared_tp=(1, 2), microbatches=(1, 2, 4),
                       placements=("disjoint", "colocated"), vision_layers=shape.vision_layers,
                       llm_layers=shape.llm_layers, global_batch=16, mean_tiles=float(pool.n_tiles.mean()))


def _layouts_on_4_gpus(small):
    space = _screen_space(small)
    return list(enumerate_layouts(world=4, global_batch=16, microbatches=space.microbatches, vision_tp=space.vision_tp,
                                  llm_tp=space.llm_tp, colocated_tp=space.colocated_tp,
                                  vision_layers=space.vision_layers, llm_layers=space.llm_layers,
                                  mean_tiles=space.mean_tiles))


def _fits_somehow(means, layout, keys, kw) -> bool:
    """Brute force: some setting `keys` allow and some split fit with every stage in some recompute
    mode (stages choose their modes apart: a stage's memory depends on its own layers and mode only)."""
    for setting in _allowed_settings(layout, keys):
        sm = means.stage_model(layout, setting, **kw)
        for split in all_splits(sm):
            least = np.min([sm.memory_at(split, [mode] * sm.n_stages) for mode in sm.modes], axis=0)
            if np.all(least <= sm.memory_bytes):
                return True
    return False


FLOOR_MEMORIES_GB = [1.2, 1.6]  # 4 GPUs of these: some layouts fit only with SP, some only with sharding too


@pytest.mark.parametrize("keys", KEYS, ids=lambda k: f"shard={k['shard_optimizer']}-sp={k['sequence_parallel']}")
@pytest.mark.parametrize("memory_gb", FLOOR_MEMORIES_GB)
def test_the_memory_floor_keeps_every_layout_some_allowed_setting_fits(small, keys, memory_gb):
    """The screen drops a layout by the memory floor of the techniques the config allows
    (`TechniqueMeans.floor`); brute force over those settings, splits and modes on 4 GPUs: every
    layout something fits on is kept (the floor is never above what a setting needs)."""
    means = _means(small, TechniqueSpace.of(**keys))
    kw = _kw(small, memory_gb, gpus=4)
    kept = {layout_of(r) for r in screen(_screen_space(small), *means.for_times(), kw["cluster"], kw["transfer"],
                                         keep=10_000, floor=means.floor()).layouts.itertuples()}
    fitting = {lay for lay in _layouts_on_4_gpus(small) if _fits_somehow(means, lay, keys, kw)}
    assert fitting <= kept


@pytest.mark.parametrize("memory_gb", FLOOR_MEMORIES_GB)
def test_the_floor_cases_need_sequence_parallelism(small, memory_gb):
    """On the instances above some layout fits only with SP, which a floor ignoring SP would drop."""
    means, kw = _means(small), _kw(small, memory_gb, gpus=4)
    chosen, sp_off = dict(shard_optimizer="auto", sequence_parallel="auto"), dict(shard_optimizer="auto",
                                                                                   sequence_parallel=False)
    assert any(_fits_somehow(means, lay, chosen, kw) and not _fits_somehow(means, lay, sp_off, kw)
               for lay in _layouts_on_4_gpus(small))


def test_settle_returns_none_when_no_mode_fits(small):
    cost, shape, pool = small
    sizes = TransferSizes.for_model(llm_hidden=shape.llm_hidden, vision_hidden=shape.vision_hidden,
                                    vision_tokens_per_tile=shape.vision_tokens_per_tile, dtype="float32")
    kw = dict(cluster=Cluster(nodes=1, gpus_per_node=8, gpu_memory_bytes=0.01 * GB), global_batch=16,
              transfer=TransferMeans.of(pool, sizes))
    lay = LAYOUTS[0]
    assert _means(small).fit(lay, np.r_[3, 3, 4, 4], **kw) is None


# ---- the search ----

def test_where_nothing_fits_without_techniques_the_plan_names_the_ones_that_make_it_fit(small):
    cost, shape, pool = small
    # (1.0 GB before the LM head's transient was priced: the data-blind baseline's microbatches now need more)
    cluster = Cluster(nodes=1, gpus_per_node=4, gpu_memory_bytes=1.2 * GB)
    common = dict(global_batch=16, microbatches=(1, 2, 4, 8), top_k=4, sample_batches=2)
    with pytest.raises(UserError, match="no plan fits"):
        search(cost, shape, pool, cluster,
               SearchSettings.from_config(recompute="none", shard_optimizer=False, sequence_parallel=False, **common))
    result = search(cost, shape, pool, cluster, SearchSettings.from_config(**common))
    plan = result.chosen.plan
    used = set(plan.vision_techniques.recompute + plan.llm_techniques.recompute) - {"none"}
    assert used or plan.llm_techniques.shard_optimizer or plan.llm_techniques.sequence_parallel
    # the simulated batches priced with those techniques fit on every stage
    assert result.chosen.ok and np.all(result.chosen.memory_bytes <= cluster.gpu_memory_bytes)
    # and the data-blind baselines were tuned with techniques too (they fit as well)
    assert result.baseline.evaluation is not None and np.all(result.baseline.evaluation.memory_bytes
                                                              <= cluster.gpu_memory_bytes)


def test_forced_recompute_is_what_every_plan_uses(small):
    cost, shape, pool = small
    cluster = Cluster(nodes=1, gpus_per_node=4, gpu_memory_bytes=8.0 * GB)
    result = search(cost, shape, pool, cluster, SearchSettings.from_config(global_batch=16, microbatches=(1, 2, 4), top_k=2,
                                                               sample_batches=1, recompute="selective"))
    for plan in (result.chosen.plan, result.baseline.evaluation.plan):
        assert set(plan.vision_techniques.recompute + plan.llm_techniques.recompute) == {"selective"}
