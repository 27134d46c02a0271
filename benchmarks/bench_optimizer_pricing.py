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
thread, so the three see the same machine state; it prints each round's measured whole step, the
two predictions and their ratios (measured / predicted), then the medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics

import pandas as pd
import torch

from dflop.costmodel.fit import fit_step_costs
from dflop.models.builder import build_model, model_config
from dflop.models.info import info_of
from dflop.models.architectures import architecture
from dflop.models.tensor_parallel import TPGroup
from dflop.profiling._timing import Timer
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
                                                 tp=TPGroup(rank=0, size=1), device=device, dtype=torch.float32)}
    model = build_model(args.arch, args.vision, args.llm)
    timer = Timer(device)
    count = {"vision_embed": 1, "vision_layer": info.vision_layers, "projector": 1, "llm_embed": 1,
             "llm_layer": info.llm_layers, "llm_head": 1}
    nbytes = {name: sum(p.numel() * p.element_size() for p in b.module.parameters()) for name, b in benches.items()}
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tied_share = benches["llm_head"].tied_bytes / nbytes["llm_head"]
    print(f"{args.arch} {args.vision} {args.llm}: {len(list(model.parameters()))} tensors, {whole_bytes / 2**20:.2f} MiB "
          f"(modules x count: {', '.join(f'{n} x{c}' for n, c in count.items())}; tied head share {tied_share:.2f})")
    print(f"{'round':>5} {'measured ms':>12} {'line ms':>9} {'modules ms':>11} {'meas/line':>10} {'meas/modules':>13}")

    def measure(module: torch.nn.Module) -> float:
        return optimizer_step_ms(module, timer, repeats=args.repeats, barrier=lambda: None)

    ratios_line, ratios_modules = [], []
    for r in range(args.rounds):
        module_ms = {name: measure(b.module) for name, b in benches.items()}
        call_ms = optimizer_call_ms(device, timer, repeats=args.repeats, barrier=lambda: None)
        measured = measure(model)
        rows = pd.DataFrame({"kind": "optimizer", "ranks": 1, "bytes": [float(nbytes[n]) for n in module_ms],
                             "ms": list(module_ms.values())})
        line_ms = fit_step_costs(rows).optimizer(whole_bytes) * 1e3
        shares = {n: max(0.0, ms - call_ms) for n, ms in module_ms.items()}
        modules_ms = call_ms + sum(count[n] * shares[n] for n in shares) - shares["llm_head"] * tied_share
        ratios_line.append(measured / line_ms)
        ratios_modules.append(measured / modules_ms)
        print(f"{r:>5} {measured:>12.3f} {line_ms:>9.3f} {modules_ms:>11.3f} {ratios_line[-1]:>10.3f} "
              f"{ratios_modules[-1]:>13.3f}")
    print(f"median measured / predicted: bytes line {statistics.median(ratios_line):.3f}, "
          f"call + module steps {statistics.median(ratios_modules):.3f}")


if __name__ == "__main__":
    main()
