"""Plans for 8, 64, 512 and 1024 GPUs: siglip-so400m + qwen2.5-7b / qwen2.5-72b on the LLaVA-OV-like mix.

For every (LLM, cluster) it runs the data-aware search (`dflop.planner.search.search`) and prints
the chosen plan, the optimizer's wall time, the predicted speedup over the data-blind baseline
(Megatron-style: colocated encoder, uniform split, fixed-count microbatches, tuned over the same
space and simulated on the same batches) and the predicted GPU utilisation (busy GPU-seconds /
(GPUs x step)).

Cost model: a fitted GPU profile from benchmarks/profiles/<llm>.json (a costmodel.json written by
`dflop fit` on a GPU model_profile.parquet) when present; otherwise the FLOP-count model of
`dflop.costmodel.analytic` (H100-class numbers stated in --tflops/--tp-gbps; see that module for
exactly what it charges). Shapes: 20,000 samples of `synthetic_mix.llava_ov_mix`.

    python benchmarks/bench_planner.py [--gpus 8 64 512 1024] [--llms qwen2.5-7b qwen2.5-72b]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dflop.costmodel.analytic import analytic_cost_model
from dflop.costmodel.model import CostModel
from dflop.errors import UserError
from dflop.models.builder import model_config
from dflop.models.info import model_info
from dflop.planner.cluster import GB, Cluster
from dflop.planner.means import Pool
from dflop.planner.optimize import summary
from dflop.planner.search import SearchSettings, search
from dflop.planner.space import ModelShape
from synthetic_mix import llava_ov_mix
from dflop.costmodel.jsonio import load_cost_model

VISION = "siglip-so400m"
PROFILES = Path(__file__).parent / "profiles"
# global batch, sampled batches K, plans simulated (top_k) per cluster size
SCALE = {8: (128, 4, 8), 64: (512, 4, 8), 512: (1024, 2, 4), 1024: (2048, 2, 4)}


def cost_model_for(llm: str, args) -> tuple[CostModel, str]:
    fitted = PROFILES / f"{llm}.json"
    if fitted.exists():
        return load_cost_model(fitted), f"fitted GPU profile {fitted}"
    cost = analytic_cost_model(model_config("llava_ov", VISION, llm), achieved_tflops=args.tflops,
                               tp_gbps=args.tp_gbps, preset=f"llava_ov/{VISION}/{llm}")
    return cost, (f"analytic FLOP model: {args.tflops:g} TFLOP/s achieved per GPU, TP all-reduce {args.tp_gbps:g} GB/s, "
                  f"bf16, 0.03 ms per op")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 512, 1024])
    p.add_argument("--llms", nargs="+", default=["qwen2.5-7b", "qwen2.5-72b"])
    p.add_argument("--tflops", type=float, default=400.0, help="achieved dense bf16 TFLOP/s per GPU (H100 ~40%% MFU)")
    p.add_argument("--tp-gbps", type=float, default=300.0, help="NVLink bandwidth for TP all-reduces, GB/s")
    p.add_argument("--intra-gbps", type=float, default=300.0, help="cluster.intra_node_gbps")
    p.add_argument("--inter-gbps", type=float, default=50.0, help="cluster.inter_node_gbps (400 Gb/s IB per GPU)")
    p.add_argument("--mix-size", type=int, default=20_000)
    args = p.parse_args()
    torch.set_num_threads(1)

    pool = Pool.from_shapes(llava_ov_mix(args.mix_size, seed=0))
    rows = []
    for llm in args.llms:
        info = model_info("llava_ov", VISION, llm)
        shape = ModelShape.from_info(info)
        cost, source = cost_model_for(llm, args)
        print(f"\n=== {VISION} + {llm} ({info.total_params / 1e9:.1f}B params); cost model: {source}")
        for gpus in args.gpus:
            batch, k, top_k = SCALE.get(gpus, (2 * gpus, 2, 4))
            cluster = Cluster(nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus), gpu_memory_bytes=80 * GB,
                              intra_node_bytes_per_s=args.intra_gbps * GB, inter_node_bytes_per_s=args.inter_gbps * GB,
                              p2p_latency_s=20e-6, device="cuda")
            settings = SearchSettings(global_batch=batch, sample_batches=k, top_k=top_k)
            print(f"\n--- {gpus} GPUs, global batch {batch}, {k} sampled batches, top_k {top_k}")
            t0 = time.perf_counter()
            try:
                result = search(cost, shape, pool, cluster, settings)
            except UserError as exc:
                wall = time.perf_counter() - t0
                print(f"  no plan ({wall:.2f} s): {exc}")
                rows.append((llm, gpus, batch, wall, "no plan fits", None, None, None))
                continue
            wall = time.perf_counter() - t0
            print(summary(result, cluster, batch))
            base = result.baseline.evaluation
            speedup = base.mean_s / result.chosen.mean_s if base is not None else None
            rows.append((llm, gpus, batch, wall, result.chosen.plan.describe(), speedup,
                         result.chosen.mean_utilisation, base.mean_utilisation if base is not None else None))

    print("\n| LLM | GPUs | global batch | optimizer wall (s) | plan | speedup vs data-blind | utilisation (plan / baseline) |")
    print("|---|---|---|---|---|---|---|")
    for llm, gpus, batch, wall, plan, speedup, util, base_util in rows:
        sp = f"{speedup:.2f}x" if speedup else "n/a (no data-blind layout fits)"
        ut = f"{100 * util:.0f}% / {100 * base_util:.0f}%" if base_util is not None else \
            (f"{100 * util:.0f}% / n/a" if util is not None else "n/a")
        print(f"| {llm} | {gpus} | {batch} | {wall:.1f} | {plan} | {sp} | {ut} |")


if __name__ == "__main__":
    main()
