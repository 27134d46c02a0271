"""Test helpers for the planner: a closed-form cost model, a small shape pool, random stage models."""

import numpy as np
import pandas as pd

from dflop.costmodel.features import MODULE_FEATURES
from dflop.costmodel.model import CostModel, ModuleCosts, Provenance
from dflop.plan import Layout

# Per-layer / per-part costs at tp=1 by feature name: fwd_ms, bwd_ms and act_bytes per unit of
# the feature (tiles, tokens, squared sample length, per microbatch), and parameter bytes. Features
# the cost model has but TOY does not name get 0. At tp=t every non-constant coefficient and the
# parameter bytes are divided by t (ideal scaling), constants kept.
TOY = {
    "vision_embed": ({"tiles": 0.02, "const": 0.05}, {"tiles": 0.04, "const": 0.05}, {"tiles": 2e5}, 4e5),
    "vision_layer": ({"tiles": 0.30, "const": 0.08}, {"tiles": 0.60, "const": 0.10}, {"tiles": 3e6}, 6e6),
    "projector": ({"tiles": 0.05, "const": 0.04}, {"tiles": 0.10, "const": 0.05}, {"tiles": 1e6}, 3e6),
    "llm_embed": ({"tokens": 1e-5, "const": 0.02}, {"tokens": 2e-5, "const": 0.03}, {"tokens": 8.0}, 2e7),
    "llm_layer": ({"tokens": 2e-3, "sq_tokens": 2e-7, "const": 0.15},
                  {"tokens": 4e-3, "sq_tokens": 5e-7, "const": 0.20}, {"tokens": 3e4}, 3e7),
    "llm_head": ({"tokens": 3e-3, "const": 0.10}, {"tokens": 6e-3, "const": 0.12}, {"tokens": 6e5}, 2e7),
}


def toy_cost_model(tp_degrees=(1, 2), scale=None, dtype="float32") -> CostModel:
    """A CostModel with the TOY coefficients (scale: {module: factor} on times)."""
    scale = scale or {}
    modules = []
    for name, targets in TOY.items():
        features = MODULE_FEATURES[name][1]
        params = targets[3]
        for tp in tp_degrees:
            coef = {}
            for target, values, k in (("fwd_ms", targets[0], scale.get(name, 1.0)),
                                      ("bwd_ms", targets[1], scale.get(name, 1.0)), ("act_bytes", targets[2], 1.0)):
                coef[target] = tuple(k * values.get(f, 0.0) / (1 if f == "const" else tp) for f in features)
            modules.append(ModuleCosts(name, tp, features, coef, params / tp, 10, (1, 64), (16, 4096)))
    return CostModel(modules, Provenance(preset="toy", device="synthetic", dtype=dtype))


def toy_shapes(n=400, seed=0) -> pd.DataFrame:
    """A skewed mix: text-only, one image (1-10 tiles), videos (16 tiles); seq_len in tokens."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=n, p=[0.3, 0.6, 0.1])
    tiles = np.where(kind == 0, 0, np.where(kind == 1, rng.integers(1, 11, n), 16))
    vision_tokens = tiles * 64
    text = rng.integers(20, 600, n)
    return pd.DataFrame({
        "sample_id": [f"s{i}" for i in range(n)], "dataset": "toy",
        "modality": np.array(["text", "image", "video"])[kind], "n_images": (kind == 1).astype(int),
        "n_frames": np.where(kind == 2, 16, 0), "n_tiles": tiles, "vision_tokens": vision_tokens,
        "text_tokens": text, "seq_len": vision_tokens + text, "status": "ok",
    })


def random_stage_model(rng, *, pp_v, pp_l, vision_layers, llm_layers, m, memory=1.0, dp=1, latency=0.0,
                       modes=("none",)):
    """A StageModel with random per-stage coefficients (pp_v = 0: colocated), for solver tests.

    Per-layer time is shared by the stages of a module (as in real layouts); fixed times, memory
    and all-reduce terms vary per stage. Memory in units of `memory` (the GPU limit). Each extra
    recompute mode (selective, full) makes layers slower and lighter by random factors (full more
    so), and a colocated stage 0's fixed terms too (its vision tower is recomputed with it).
    """
    from dflop.plan import Layout
    from dflop.planner.stages import StageCoeffs, StageModel

    P = pp_v + pp_l
    colocated = pp_v == 0
    layout = Layout("colocated", 1, 1, dp, 1, pp_l, dp, m) if colocated else \
        Layout("disjoint", 1, pp_v, dp, 1, pp_l, dp, m)
    is_vision = np.r_[np.ones(pp_v, bool), np.zeros(pp_l, bool)]
    per_layer = np.where(is_vision, rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5))
    fixed = rng.uniform(0.0, 2.0, P)
    bwd_share = rng.uniform(0.5, 0.7, P)
    mem_fixed = rng.uniform(0.05, 0.3, (2, P)) * memory
    mem_layer = rng.uniform(0.02, 0.12, (2, P)) * memory
    coeffs = StageCoeffs(time_fixed=fixed, time_layer=per_layer, bwd_fixed=bwd_share * fixed,
                         bwd_layer=bwd_share * per_layer, mem_mean_fixed=mem_fixed[0], mem_mean_layer=mem_layer[0],
                         mem_max_fixed=mem_fixed[1], mem_max_layer=mem_layer[1],
                         grad_fixed=rng.uniform(0, 1, P), grad_layer=rng.uniform(0, 1, P),
                         optim_fixed=np.zeros(P), optim_layer=np.zeros(P))
    ar_fixed = rng.uniform(0.0, 3.0, P) if dp > 1 else np.zeros(P)
    ar_layer = rng.uniform(0.0, 0.5, P) if dp > 1 else np.zeros(P)
    by_mode = {"none": coeffs}
    slower = {"selective": (0.05, 0.15), "full": (0.25, 0.45)}
    lighter = {"selective": (0.75, 0.95), "full": (0.2, 0.4)}
    for mode in modes:
        if mode == "none":
            continue
        extra, keep = rng.uniform(*slower[mode]), rng.uniform(*lighter[mode])
        fixed_on = np.r_[colocated, np.zeros(P - 1, bool)]  # the colocated vision tower rides on stage 0
        t_fixed = np.where(fixed_on, fixed * (1 + extra), fixed)
        by_mode[mode] = StageCoeffs(
            time_fixed=t_fixed, time_layer=per_layer * (1 + extra), bwd_fixed=bwd_share * fixed + (t_fixed - fixed),
            bwd_layer=bwd_share * per_layer + per_layer * extra,
            mem_mean_fixed=np.where(fixed_on, mem_fixed[0] * keep, mem_fixed[0]), mem_mean_layer=mem_layer[0] * keep,
            mem_max_fixed=np.where(fixed_on, mem_fixed[1] * keep, mem_fixed[1]), mem_max_layer=mem_layer[1] * keep,
            grad_fixed=coeffs.grad_fixed, grad_layer=coeffs.grad_layer,
            optim_fixed=coeffs.optim_fixed, optim_layer=coeffs.optim_layer)
    by_mode = {mode: by_mode[mode] for mode in ("none", "selective", "full") if mode in by_mode}
    return StageModel(layout, is_vision, by_mode, ar_fixed, ar_layer, vision_layers, llm_layers, latency, memory)


def all_splits(sm):
    """Every split of the stage model's layers (>= 1 per stage), as [P] arrays."""
    import itertools

    def compositions(total, parts):
        for cut in itertools.combinations(range(1, total), parts - 1):
            yield np.diff((0, *cut, total))

    pp_v = int(sm.is_vision.sum())
    vision = list(compositions(sm.vision_layers, pp_v)) if pp_v else [np.zeros(0, int)]
    for a in vision:
        for b in compositions(sm.llm_layers, sm.n_stages - pp_v):
            yield np.r_[a, b].astype(int)


def launchable(world, vision_ranks, tp_l, per_node):
    """Whole nodes (or part of one), and the LLM ranks start on a multiple of tp_l."""
    return (world <= per_node or world % per_node == 0) and vision_ranks % tp_l == 0


def enumerate_layouts(*, world, global_batch, microbatches, vision_tp, llm_tp, colocated_tp, vision_layers,
                      llm_layers, mean_tiles, per_node=None):
    """Every layout of a search space, written out loop by loop (the rules of dflop.planner.screen)."""
    W, B = world, global_batch
    per_node = per_node or W
    for m in microbatches:
        for tl in llm_tp:
            for pl in range(1, llm_layers + 1):
                dp = min(W // (tl * pl), B // m)
                while dp >= 1 and not launchable(tl * pl * dp, 0, tl, per_node):
                    dp -= 1
                if dp >= 1 and tl in colocated_tp:
                    yield Layout("colocated", tl, 1, dp, tl, pl, dp, m)
                for tv in vision_tp:
                    for pv in range(1, vision_layers + 1):
                        for dl in range(1, W):
                            if dl * m > B:
                                break
                            cap = max(1, int(np.floor(B / m * mean_tiles)))
                            dv = min((W - tl * pl * dl) // (tv * pv), cap)
                            while dv >= 1 and not launchable(tv * pv * dv + tl * pl * dl, tv * pv * dv, tl, per_node):
                                dv -= 1
                            if dv >= 1:
                                yield Layout("disjoint", tv, pv, dv, tl, pl, dl, m)
