"""A GPU's fitted profile carried to the modules and TP degrees it did not measure.

A profile taken on one GPU measures each module at TP 1 only, and only for the model profiled; a
plan for a cluster also prices TP 2-8, and maybe another LLM behind the same vision tower.
`calibrated` combines the fitted model with the analytic FLOP model (`dflop.costmodel.analytic`)
of the model being planned:

- a module the fitted model measured *for this model* (`applicable_modules`: the vision tower's
  modules where the architecture and tower match, the LLM's where the LLM matches, the projector
  where both do) keeps its fitted costs at the TP degrees it was measured at;
- at its other degrees it takes the analytic costs with their times scaled by the fitted /
  analytic ratio at the smallest measured degree on a reference microbatch (`REFERENCE`), forward
  and each backward target apart: the analytic model's shape of the cost (FLOPs, TP all-reduces)
  at the measured level. Memory stays analytic there (its closed forms count the same bytes);
- every other module is the analytic one.

This is a first-order carry-over (a TP shard's kernels are not just slower by the same ratio);
measure the cluster's own GPUs at their TP degrees when they are available.
"""

from __future__ import annotations

import numpy as np

from dflop.costmodel.features import ShapeKind
from dflop.costmodel.model import CostModel, ModuleCosts, Provenance, _set_prediction

VISION_MODULES = ("vision_embed", "vision_layer")
LLM_MODULES = ("llm_embed", "llm_layer", "llm_attention", "llm_head")
#: The microbatch the time ratio is taken at: 16 tiles; 4 packed samples of 1,024 tokens.
REFERENCE = {ShapeKind.TILES: [4, 4, 4, 4], ShapeKind.TOKENS: [1024, 1024, 1024, 1024]}


def applicable_modules(fitted_preset: str, preset: str) -> tuple[str, ...]:
    """Modules whose fitted costs (model ``fitted_preset``, "arch/vision/llm") hold for ``preset``."""
    arch, vision, llm = _parts(fitted_preset)
    want_arch, want_vision, want_llm = _parts(preset)
    same_tower = (arch, vision) == (want_arch, want_vision)
    out = VISION_MODULES if same_tower else ()
    if same_tower and llm == want_llm:
        out += ("projector",)
    if llm == want_llm:
        out += LLM_MODULES
    return out


def calibrated(analytic: CostModel, fitted: CostModel, modules: tuple[str, ...]) -> CostModel:
    """`analytic` with `modules` priced from `fitted` (module docstring); its provenance says so."""
    out = []
    for (name, tp), base in sorted(analytic.modules.items()):
        measured = {t for (m, t) in fitted.modules if m == name} if name in modules else set()
        if not measured:
            out.append(base)
        elif tp in measured:
            out.append(fitted.module(name, tp))
        else:
            ref = min(measured)
            out.append(_scaled(base, analytic.module(name, ref), fitted.module(name, ref)))
    degrees = sorted({t for (m, t) in fitted.modules if m in modules})
    device = (f"{fitted.provenance.device} fit of {fitted.provenance.preset} for {', '.join(modules)} at TP "
              f"{', '.join(map(str, degrees))} (other degrees scaled from it), {analytic.provenance.device} "
              f"for the rest") if modules else analytic.provenance.device
    provenance = Provenance(preset=analytic.provenance.preset, device=device, dtype=analytic.provenance.dtype,
                            profile=fitted.provenance.profile if modules else "")
    return CostModel(out, provenance, analytic.step_costs)


def _scaled(base: ModuleCosts, analytic_ref: ModuleCosts, fitted_ref: ModuleCosts) -> ModuleCosts:
    """`base` with each time target scaled by fitted / analytic at the reference microbatch."""
    coef = dict(base.coef)
    for target in base.coef:
        if target.startswith(("fwd_ms", "bwd_ms")) and target in fitted_ref.coef:
            ratio = _at_reference(fitted_ref, target) / max(_at_reference(analytic_ref, target), 1e-12)
            coef[target] = tuple(float(c * ratio) for c in base.coef[target])
    return ModuleCosts(base.module, base.tp, base.features, coef, base.param_bytes, base.n_shapes,
                       base.profiled_batch, base.profiled_seq_len, base.tied_param_bytes, base.optimizer_s)


def _at_reference(module: ModuleCosts, target: str) -> float:
    return _set_prediction(module, target, np.asarray(REFERENCE[module.kind], dtype=np.float64))


def _parts(preset: str) -> tuple[str, str, str]:
    arch, vision, llm = (preset or "//").split("/")
    return arch, vision, llm
