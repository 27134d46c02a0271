"""Which degrees the search may use, and why the others are rejected.

Tensor parallelism stays inside a node: a TP degree must divide gpus_per_node. It must also
split the module evenly (LLM: query heads, key/value heads, MLP width and the vocabulary, for the
vocab-parallel embedding and loss; vision: the MLP and projector widths, while heads are padded
with zero heads to a multiple of the degree as NVIDIA's Megatron does for InternViT-6B, 25 -> 32
at TP 8, priced by the cost model at the padded count), and the cost model must have been
profiled at it: a fitted profile measures what the runtime builds, padding included, and a degree
it lacks is rejected as tp_not_profiled. A padded degree gets an "admitted" row
(reason vision_heads_padded) in candidates.parquet and is named in `describe_plan`.
In the colocated placement the vision tower shares the first LLM stage's TP ranks, so the LLM's
TP degree must also be valid for the vision tower. Every microbatch count must leave at least one
sample per microbatch. Rejected degrees become rows of candidates.parquet.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflop.costmodel.model import CostModel
from dflop.errors import UserError
from dflop.plan import PLACEMENTS
from dflop.pricing.cluster import Cluster
from dflop.planner.screen import SearchSpace

VISION_MODULES = ("vision_embed", "vision_layer", "projector")
LLM_MODULES = ("llm_embed", "llm_layer", "llm_head")


@dataclass(frozen=True)
class ModelShape:
    """The model structure the planner needs (from `dflop.models.info.ModelInfo`).

    *_tp_degrees: TP degrees that split the module evenly (vision: after zero-head padding); hidden
    sizes and tokens per tile size the activations that cross pipeline hops; vision_padded_heads:
    the vision heads at each of vision_tp_degrees after padding (empty: no padding anywhere).
    """

    vision_layers: int
    llm_layers: int
    vision_tp_degrees: tuple[int, ...]
    llm_tp_degrees: tuple[int, ...]
    vision_heads: int
    llm_heads: int
    llm_kv_heads: int
    vocab_size: int
    llm_hidden: int
    vision_hidden: int
    vision_tokens_per_tile: int
    llm_tokens_per_tile: int
    vision_padded_heads: tuple[int, ...] = ()

    def vision_heads_at(self, tp: int) -> int:
        """The vision tower's head count at TP degree `tp`, padding included."""
        return dict(zip(self.vision_tp_degrees, self.vision_padded_heads)).get(tp, self.vision_heads)

    def vision_padding(self, tp: int) -> str:
        """"25 heads padded to 32" when `tp` needs zero heads, else ""."""
        padded = self.vision_heads_at(tp)
        return f"{self.vision_heads} heads padded to {padded}" if padded != self.vision_heads else ""

    @classmethod
    def from_info(cls, info) -> "ModelShape":
        """From a `ModelInfo` (dflop.models.info.model_info)."""
        return cls(info.vision_layers, info.llm_layers, _degrees(info.vision_tp_degrees),
                   _degrees(info.llm_tp_degrees), info.vision_heads, info.llm_heads, info.llm_kv_heads,
                   info.vocab_size, info.llm_hidden, info.vision_hidden, info.vision_tokens_per_tile,
                   info.llm_tokens_per_tile, tuple(int(h) for h in getattr(info, "vision_padded_heads", ())))


def describe_plan(plan, shape: ModelShape) -> str:
    """`Plan.describe`, plus e.g. "; vision tp8 (25 heads padded to 32)" when its vision TP pads heads."""
    padding = shape.vision_padding(plan.layout.tp_v)
    return plan.describe() + (f"; vision tp{plan.layout.tp_v} ({padding})" if padding else "")


def _degrees(value) -> tuple[int, ...]:
    """ModelInfo's TP degrees (a tuple; older ModelInfo had a method)."""
    return tuple(int(t) for t in (value() if callable(value) else value))


def _profiled(cost: CostModel, modules: tuple[str, ...]) -> set[int]:
    degrees = [set(cost.tp_degrees(m)) for m in modules]
    missing = [m for m, d in zip(modules, degrees) if not d]
    if missing:
        raise UserError(f"cost model has no profile for {', '.join(missing)}; re-run `dflop profile-model` and `dflop fit`")
    return set.intersection(*degrees)


def _rejection(reason: str, detail: str, **layout) -> dict:
    return {"kind": "plan", "level": "degree", "status": "rejected", "reason": reason, "detail": detail, **layout}


def build_space(shape: ModelShape, cost: CostModel, cluster: Cluster, *, placements, microbatches,
                global_batch: int, mean_tiles: float) -> tuple[SearchSpace, list[dict]]:
    """The admissible degrees, and one rejection row per inadmissible TP degree or m."""
    placements = tuple(dict.fromkeys(placements))
    bad = [p for p in placements if p not in PLACEMENTS]
    if bad or not placements:
        raise UserError(f"planner.placements must be a non-empty subset of {list(PLACEMENTS)}, got {list(placements)}")
    if int(global_batch) != global_batch or global_batch < 1:
        raise UserError(f"train.global_batch_size must be a whole number >= 1, got {global_batch!r}")
    ms = sorted({int(m) for m in microbatches})
    if not ms or ms[0] < 1:
        raise UserError(f"planner.microbatches must be whole numbers >= 1, got {list(microbatches)}")

    rejected: list[dict] = []
    g = cluster.gpus_per_node
    node_tp = [t for t in range(1, g + 1) if g % t == 0]
    vision_prof, llm_prof = _profiled(cost, VISION_MODULES), _profiled(cost, LLM_MODULES)

    def admissible(module: str, ok: tuple[int, ...], profiled: set[int], heads: str) -> list[int]:
        keep = []
        key = "tp_v" if module == "vision" else "tp_l"
        for t in node_tp:
            if t not in ok:
                rejected.append(_rejection("tp_not_dividing_heads", f"{module} tp={t} does not divide {heads}", **{key: t}))
            elif t not in profiled:
                rejected.append(_rejection("tp_not_profiled", f"{module} tp={t} is not in the cost model "
                                           f"(profiled: {sorted(profiled)})", **{key: t}))
            else:
                keep.append(t)
                if module == "vision" and shape.vision_padding(t):
                    rejected.append({**_rejection("vision_heads_padded", f"vision tp={t}: {shape.vision_padding(t)} "
                                                  f"(zero heads; priced at the padded count)", tp_v=t),
                                     "status": "admitted"})
        for t in sorted(profiled - set(node_tp)):
            rejected.append(_rejection("tp_not_within_node", f"{module} tp={t} does not divide gpus_per_node={g}",
                                       **{key: t}))
        return keep

    vision_tp = admissible("vision", shape.vision_tp_degrees, vision_prof,
                           f"the vision tower's MLP and projector widths ({shape.vision_heads} heads, padded where needed)"
                           if shape.vision_padded_heads else f"{shape.vision_heads} vision heads")
    llm_tp = admissible("llm", shape.llm_tp_degrees, llm_prof,
                        f"{shape.llm_heads} heads / {shape.llm_kv_heads} key-value heads / vocabulary {shape.vocab_size}")
    shared_tp = [t for t in llm_tp if t in vision_tp]
    colocated_tp = shared_tp if "colocated" in placements else []
    if "colocated" in placements:
        for t in llm_tp:
            if t not in vision_tp:
                rejected.append(_rejection("tp_not_dividing_heads", f"colocated: the vision tower cannot share llm "
                                           f"tp={t} (vision tp admitted: {vision_tp}; {shape.vision_heads} heads, profiled "
                                           f"{sorted(vision_prof)})",
                                           placement="colocated", tp_v=t, tp_l=t))
    keep_m = []
    for m in ms:
        if m > global_batch:
            rejected.append(_rejection("divisibility", f"m={m} microbatches need at least {m} samples, global batch "
                                       f"is {global_batch}", m=m))
        else:
            keep_m.append(m)
    space = SearchSpace(vision_tp=tuple(vision_tp) if "disjoint" in placements else (), llm_tp=tuple(llm_tp),
                        colocated_tp=tuple(colocated_tp), shared_tp=tuple(shared_tp), microbatches=tuple(keep_m), placements=placements,
                        vision_layers=shape.vision_layers, llm_layers=shape.llm_layers,
                        global_batch=int(global_batch), mean_tiles=float(mean_tiles))
    if not llm_tp or not keep_m or not (space.vision_tp or space.colocated_tp):
        reasons = "; ".join(r["detail"] for r in rejected if r["status"] == "rejected") or \
            "no TP degree or microbatch count to try"
        raise UserError(f"empty search space: {reasons}")
    if cluster.world_size < 2 and "colocated" not in placements:
        raise UserError(f"a disjoint placement needs at least 2 GPUs, the cluster has {cluster.world_size}; "
                        f"add 'colocated' to planner.placements")
    return space, rejected
