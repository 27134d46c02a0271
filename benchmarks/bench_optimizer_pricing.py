"""The optimizer step of a whole one-stage model against its two pricings: the bytes line and the
per-module steps plus one call.

    python benchmarks/bench_optimizer_pricing.py [--arch llava_ov --vision siglip-tiny --llm qwen2.5-tiny]
        [--rounds 5] [--repeats 20]

A rank of a colocated plan with one pipeline stage steps every parameter of the model in one
AdamW step (`dflop.runtime.trainer`). The profiler measures that step per module
(`dflop.profiling.step_costs.optimizer_step_ms` on each bench the model profiler builds) and over
one one-element parameter (`optimizer_call_ms`); the cost model prices a stage either by the line
through the modules' (bytes, ms) points (`dflop.costmodel.fit.fit_step_costs`; what it did before
the per-module steps) or as the call plus each module's step less the call, times its count on
the stage, a tied LM head's weight once (`dflop.costmodel.model.ModuleCosts.optimizer_s`).

Each round measures the modules, the call and the whole model's step back to back, on one torch
thread, so the three see the same machine state (the order rotates from round to round); it
prints each round's measured whole step, the two predictions and their ratios (measured /
predicted), then the medians and ranges over rounds. The predictions go through the library: the
fit's `fit_step_costs` and `module_optimizer_s` on the round's measurements, and the cost model's
colocated stage terms (`CostModel.vision_stage_terms` / `llm_stage_terms`, `StageTerms.optimizer_s`).
The whole model has two small tensors no stage steps (SigLIP's post-layernorm, 128 elements).
"""

from __future__ import annotations

import argparse
import statistics

import pandas as pd
import torch

from dflop.costmodel.features import MODULE_FEATURES
from dflop.costmodel.fit import fit_step_costs, module_optimizer_s
from dflop.costmodel.model import TARGETS, CostModel, ModuleCosts, Provenance
from dflop.models.builder import build_model, model_config
from dflop.models.info import info_of
from dflop.models.architectures import architecture
from dflop.models.tensor_parallel import TPGroup
from dflop.profiling._timing import Timer
from dflop.models.precision import Precision
from dflop.profiling.model_modules import build_benches
from dflop.profiling.step_costs import optimizer_call_ms, optimizer_step_ms

STAGE_MODULES = ("vision_embed", "vision_layer", "projector", "llm_embed", "llm_layer", "llm_head")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llava_ov")
    ap.add_argument("--vision", default="siglip-tiny")
    ap.add_argument("--llm", default="qwen2.5-tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20, help="timed steps per measurement (median)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    config = model_config(args.arch, args.vision, args.llm)
    info = info_of(config)
    device = torch.device("cpu")
    benches = {b.name: b for b in build_benches(architecture(args.arch), config, modules=STAGE_MODULES,
                                                 tp=TPGroup(rank=0, size=1), device=device,
                                                 precision=Precision(torch.float32))}
    model = build_model(args.arch, args.vision, args.llm)
    timer = Timer(device)
    count = {"vision_embed": 1, "vision_layer": info.vision_layers, "projector": 1, "llm_embed": 1,
             "llm_layer": info.llm_layers, "llm_head": 1}
    nbytes = {name: sum(p.numel() * p.element_size() for p in b.module.parameters()) for name, b in benches.items()}
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{args.arch} {args.vision} {args.llm}: {len(list(model.parameters()))} tensors, {whole_bytes / 2**20:.2f} MiB "
          f"(modules x count: {', '.join(f'{n} x{c}' for n, c in count.items())}; "
          f"tied head bytes {benches['llm_head'].tied_bytes})")
    print(f"{'round':>5} {'measured ms':>12} {'line ms':>9} {'modules ms':>11} {'meas/line':>10} {'meas/modules':>13}")

    def measure(module: torch.nn.Module) -> float:
        return optimizer_step_ms(module, timer, repeats=args.repeats, barrier=lambda: None)
    jobs = [("call", None)] + [(name, b.module) for name, b in benches.items()] + [("whole", model)]
    ratios_line, ratios_modules = [], []
    for r in range(args.rounds):
        ms = {}
        for name, module in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:  # rotate the order each round
            ms[name] = (optimizer_call_ms(device, torch.float32, timer, repeats=args.repeats, barrier=lambda: None)
                        if module is None else measure(module))
        rows = pd.DataFrame({"kind": "optimizer", "ranks": 1, "bytes": [float(nbytes[n]) for n in benches],
                             "ms": [ms[n] for n in benches], "module": list(benches), "tp": 1, "n_layers": 1.0})
        rows = pd.concat([rows, pd.DataFrame({"kind": ["optimizer_call"], "ranks": [1], "bytes": [4.0],
                                              "ms": [ms["call"]]})], ignore_index=True)
        step_costs = fit_step_costs(rows)
        line_ms = step_costs.optimizer(whole_bytes) * 1e3
        cost = stage_cost_model(benches, nbytes, module_optimizer_s(rows, step_costs.optimizer_call_s))
        terms = (cost.vision_stage_terms([1], n_layers=count["vision_layer"], first=True, last=True, tp=1),
                 cost.llm_stage_terms([1], n_layers=count["llm_layer"], first=True, last=True, tp=1))
        modules_ms = ms["call"] + sum(t.optimizer_s for t in terms) * 1e3
        ratios_line.append(ms["whole"] / line_ms)
        ratios_modules.append(ms["whole"] / modules_ms)
        print(f"{r:>5} {ms['whole']:>12.3f} {line_ms:>9.3f} {modules_ms:>11.3f} {ratios_line[-1]:>10.3f} "
              f"{ratios_modules[-1]:>13.3f}")
    print(f"measured / predicted, median (min-max) over rounds: bytes line {statistics.median(ratios_line):.3f} "
          f"({min(ratios_line):.3f}-{max(ratios_line):.3f}), call + module steps "
          f"{statistics.median(ratios_modules):.3f} ({min(ratios_modules):.3f}-{max(ratios_modules):.3f})")


def stage_cost_model(benches: dict, nbytes: dict, optimizer_s: dict) -> CostModel:
    """A cost model holding only what prices a stage's optimizer: each module's bytes, its tied
    bytes and its measured step (zero time and memory coefficients)."""
    modules = [ModuleCosts(name, 1, MODULE_FEATURES[name][1], {t: (0.0,) * len(MODULE_FEATURES[name][1])
                                                                for t in TARGETS},
                           float(nbytes[name]), 0, (1, 1), (1, 1), tied_param_bytes=float(bench.tied_bytes),
                           optimizer_s=optimizer_s[(name, 1)])
               for name, bench in benches.items()]
    return CostModel(modules, Provenance(preset=None, device="cpu", dtype="float32"))


if __name__ == "__main__":
    main()
