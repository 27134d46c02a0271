"""Plans for 8, 64, 512 and 1024 GPUs: siglip-so400m + qwen2.5-7b / qwen2.5-72b on the LLaVA-OV-like mix.

For every (LLM, cluster) it runs the data-aware search (`dflop.planner.search.search`) and prints
the chosen plan, the optimizer's wall time, the predicted speedup over the data-blind baseline
(Megatron-style: colocated encoder, uniform split, fixed-count microbatches, tuned over the same
space and simulated on the same batches) and the predicted GPU utilisation (busy GPU-seconds /
(GPUs x step)).

Cost model: a fitted GPU profile from benchmarks/profiles/<llm>.json (a costmodel.json written by
`dflop fit` on a GPU model_profile.parquet) when present; otherwise the FLOP-count model of
`dflop.costmodel.analytic` (H100-class numbers stated in --tflops/--tp-gbps; see that module for
exactly what it charges), with the modules that a fitted GPU profile in benchmarks/profiles/<device>/
measured for this model (the same vision tower, the same LLM) taken from it
(`dflop.costmodel.calibrate`; `--no-gpu-profiles`: analytic alone). The cost-model column says
which. Shapes: 20,000 samples of `synthetic_mix.llava_ov_mix`.

    python benchmarks/bench_planner.py [--gpus 8 64 512 1024] [--llms qwen2.5-7b qwen2.5-72b]

``--paper`` plans the DFLOP paper's three configurations instead (PAPER: LLaVA-OV SigLIP-so400m +
Llama-3-8B, SigLIP-so400m + Qwen2.5-32B, InternVL2.5-78B = InternViT-6B + Qwen2.5-72B) on the
generated mix (``--mix llava_ov``), its video-heavy variant (``--mix heavy``) or a shapes.parquet
(``--shapes``, counted for LLaVA-OV with SigLIP); vision tokens and sequence lengths are recounted
per architecture (`synthetic_mix.for_architecture`), and the fitted profile is looked up as
benchmarks/profiles/<arch>-<vision>-<llm>.json:

    python benchmarks/bench_planner.py --paper [--gpus 64 512 1024] [--mix llava_ov|heavy] [--shapes FILE]

``--schedules 1f1b interleaved zb-h1`` lets the planner (and the Megatron-style baseline) choose the
LLM's pipeline schedule per layout (`planner.schedules`; default 1f1b alone): the same code with
and without the new schedules.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from dflop.costmodel.analytic import analytic_cost_model
from dflop.costmodel.calibrate import applicable_modules, calibrated
from dflop.costmodel.model import CostModel
from dflop.errors import UserError
from dflop.models.builder import model_config
from dflop.models.info import model_info
from dflop.pricing.cluster import GB, Cluster
from dflop.pricing.pool import Pool
from dflop.planner.optimize import summary
from dflop.planner.search import SearchSettings, search
from dflop.planner.space import ModelShape, describe_plan
from dflop.shapes import read_shapes
from synthetic_mix import for_architecture, heavy_mix, llava_ov_mix
from dflop.costmodel.jsonio import load_cost_model

VISION = "siglip-so400m"
PROFILES = Path(__file__).parent / "profiles"
# global batch, sampled batches K, plans simulated (top_k) per cluster size
SCALE = {8: (128, 4, 8), 64: (512, 4, 8), 512: (1024, 2, 4), 1024: (2048, 2, 4)}
# The DFLOP paper's configurations: (architecture, vision preset, LLM preset)
PAPER = (("llava_ov", "siglip-so400m", "llama3-8b"), ("llava_ov", "siglip-so400m", "qwen2.5-32b"),
         ("internvl", "internvit-6b", "qwen2.5-72b"))
GPUS_PER_NODE = 8
MIXES = {"llava_ov": llava_ov_mix, "heavy": heavy_mix}


def cost_model_for(llm: str, args, arch: str = "llava_ov", vision: str = VISION,
                   profile: str | None = None) -> tuple[CostModel, str]:
    """The cost model a configuration is planned with, and a line saying what it is: the fitted
    profile benchmarks/profiles/<profile or llm>.json when present; else the analytic model at
    every TP degree inside a node (the space drops those the heads do not allow), with the modules
    a fitted GPU profile under benchmarks/profiles/<device>/ measured for this model carried over
    (`dflop.costmodel.calibrate`: its TP degrees as fitted, the others scaled from them)."""
    fitted = PROFILES / f"{profile or llm}.json"
    if fitted.exists():
        return load_cost_model(fitted), f"fitted GPU profile {fitted}"
    node_tp = tuple(t for t in range(1, GPUS_PER_NODE + 1) if GPUS_PER_NODE % t == 0)
    preset = f"{arch}/{vision}/{llm}"
    cost = analytic_cost_model(model_config(arch, vision, llm), tp_degrees=node_tp, achieved_tflops=args.tflops,
                               tp_gbps=args.tp_gbps, preset=preset)
    source = (f"analytic FLOP model: {args.tflops:g} TFLOP/s achieved per GPU, TP all-reduce {args.tp_gbps:g} GB/s, "
              f"bf16, 0.03 ms per op")
    if args.no_gpu_profiles:
        return cost, source
    best = max(((applicable_modules(m.provenance.preset, preset), path, m) for path, m in gpu_cost_models()),
               key=lambda entry: len(entry[0]), default=((), None, None))
    modules, path, gpu = best
    if not modules:
        return cost, source
    return calibrated(cost, gpu, modules), (f"{gpu.provenance.device} fit of {', '.join(modules)} + analytic: "
                                            f"{path.relative_to(PROFILES)} at TP 1, other TP degrees scaled from it; "
                                            f"{source} for the rest")


def gpu_cost_models() -> list[tuple[Path, CostModel]]:
    """The fitted cost models under benchmarks/profiles/<device>/ (``<arch>-<vision>-<llm>.json``),
    in name order (the first of equally good ones wins)."""
    out = []
    for path in sorted(PROFILES.glob("*/*-*-*.json")):
        try:
            out.append((path, load_cost_model(path)))
        except UserError:
            continue  # not a cost model (e.g. a kernel benchmark's JSON)
    return out


def cluster_for(gpus: int, args) -> Cluster:
    return Cluster(nodes=max(1, gpus // GPUS_PER_NODE), gpus_per_node=min(GPUS_PER_NODE, gpus),
                   gpu_memory_bytes=80 * GB, intra_node_bytes_per_s=args.intra_gbps * GB,
                   inter_node_bytes_per_s=args.inter_gbps * GB, p2p_latency_s=20e-6, device="cuda")


def paper_shapes(args):
    """The shapes table --paper plans on, and its name."""
    if args.shapes is not None:
        return read_shapes(args.shapes), str(args.shapes)
    mix = args.mix or "llava_ov"
    return MIXES[mix](args.mix_size, seed=0), f"{args.mix_size} samples of synthetic_mix.{MIXES[mix].__name__}"


def paper_pool(shapes, info, where: str) -> Pool:
    """The pool one configuration plans on: shapes with tokens recounted for its architecture."""
    return Pool.from_shapes(for_architecture(shapes, info.arch, info.llm_tokens_per_tile), where=where)


def run_paper(args) -> None:
    """Plan PAPER's configurations on every cluster size in args.gpus; print each and a markdown table."""
    shapes, shapes_name = paper_shapes(args)
    rows = []
    for arch, vision, llm in PAPER:
        info = model_info(arch, vision, llm)
        pool = paper_pool(shapes, info, shapes_name)
        shape = ModelShape.from_info(info)
        cost, source = cost_model_for(llm, args, arch, vision, profile=f"{arch}-{vision}-{llm}")
        name = f"{arch} {vision} + {llm}"
        print(f"\n=== {name} ({info.total_params / 1e9:.1f}B params, {info.llm_tokens_per_tile} LLM tokens per tile, "
              f"vision TP {vision_degrees(info)}); shapes: {shapes_name}, mean seq_len "
              f"{pool.seq_len.mean():.0f}, max {pool.seq_len.max()}; cost model: {source}")
        for gpus in args.gpus:
            batch, k, top_k = SCALE.get(gpus, (2 * gpus, 2, 4))
            cluster = cluster_for(gpus, args)
            settings = SearchSettings.from_config(global_batch=batch, sample_batches=k, top_k=top_k,
                                                  schedules=tuple(args.schedules))
            print(f"\n--- {gpus} GPUs, global batch {batch}, {k} sampled batches, top_k {top_k}, "
                  f"schedules {' '.join(args.schedules)}")
            row = {"config": name, "gpus": gpus, "batch": batch, "cost": source.split(":")[0]}
            t0 = time.perf_counter()
            try:
                result = search(cost, shape, pool, cluster, settings)
            except UserError as exc:
                row["wall"] = time.perf_counter() - t0
                print(f"  no plan ({row['wall']:.2f} s): {exc}")
                rows.append({**row, "plan": f"no plan: {exc}"})
                continue
            row["wall"] = time.perf_counter() - t0
            print(summary(result, cluster, batch, shape=shape))
            chosen = result.chosen
            row.update(plan=describe_plan(chosen.plan, shape), step=chosen.mean_s, util=chosen.mean_utilisation)
            for key, base in (("base", result.baseline), ("padded", result.padded_baseline)):
                if base.evaluation is not None:
                    row[key] = base.evaluation.mean_s
            if result.baseline.evaluation is not None:
                print(f"  Megatron-style baseline: {describe_plan(result.baseline.evaluation.plan, shape)}")
            print(f"  planner wall time {row['wall']:.2f} s")
            rows.append(row)
    print(paper_table(rows))


def vision_degrees(info) -> str:
    """The vision TP degrees, padded ones marked: "1, 2 (26 heads), 4 (28 heads), ..."."""
    return ", ".join(f"{t}" + (f" ({h} heads)" if h != info.vision_heads else "")
                     for t, h in zip(info.vision_tp_degrees, info.vision_padded_heads))


def paper_table(rows: list[dict]) -> str:
    """The markdown table of run_paper's rows."""

    def vs(row, key):
        return (f"{row[key]:.4g} ({row[key] / row['step']:.2f}x)" if key in row and "step" in row
                else "no layout fits" if "step" in row else "–")

    head = ["configuration", "GPUs", "global batch", "cost model", "plan", "step, mean (s)",
            "Megatron-style packed step (speedup)", "HF/LLaVA padded step (speedup)", "utilisation",
            "planner wall (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["config"], str(r["gpus"]), str(r["batch"]), r["cost"], r["plan"].replace("|", "\\|"),
                 f"{r['step']:.4g}" if "step" in r else "–", vs(r, "base"), vs(r, "padded"),
                 f"{100 * r['util']:.0f}%" if "util" in r else "–", f"{r['wall']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paper", action="store_true", help="plan the DFLOP paper's three configurations (PAPER)")
    p.add_argument("--mix", choices=sorted(MIXES), default=None, help="--paper: generated mix (default llava_ov)")
    p.add_argument("--shapes", type=Path, default=None, help="--paper: a shapes.parquet instead of a generated mix")
    p.add_argument("--gpus", type=int, nargs="+", default=None, help="default 8 64 512 1024; --paper: 64 512 1024")
    p.add_argument("--llms", nargs="+", default=["qwen2.5-7b", "qwen2.5-72b"])
    p.add_argument("--tflops", type=float, default=400.0, help="achieved dense bf16 TFLOP/s per GPU (H100 ~40%% MFU)")
    p.add_argument("--tp-gbps", type=float, default=300.0, help="NVLink bandwidth for TP all-reduces, GB/s")
    p.add_argument("--intra-gbps", type=float, default=300.0, help="cluster.intra_node_gbps")
    p.add_argument("--inter-gbps", type=float, default=50.0, help="cluster.inter_node_gbps (400 Gb/s IB per GPU)")
    p.add_argument("--mix-size", type=int, default=20_000)
    p.add_argument("--schedules", nargs="+", default=["1f1b"], choices=["1f1b", "interleaved", "zb-h1"],
                   help="LLM pipeline schedules the planner may choose (planner.schedules; must list 1f1b)")
    p.add_argument("--no-gpu-profiles", action="store_true",
                   help="plan with the analytic model alone, ignoring benchmarks/profiles/<device>/ fits")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not args.paper and (args.mix or args.shapes):
        p.error("--mix and --shapes need --paper")
    if args.mix and args.shapes:
        p.error("give --mix or --shapes, not both")
    if args.paper:
        args.gpus = args.gpus or [64, 512, 1024]
        try:
            run_paper(args)
        except UserError as exc:
            sys.exit(f"bench_planner: {exc}")
        return
    args.gpus = args.gpus or [8, 64, 512, 1024]

    pool = Pool.from_shapes(llava_ov_mix(args.mix_size, seed=0))
    rows = []
    for llm in args.llms:
        info = model_info("llava_ov", VISION, llm)
        shape = ModelShape.from_info(info)
        cost, source = cost_model_for(llm, args)
        print(f"\n=== {VISION} + {llm} ({info.total_params / 1e9:.1f}B params); cost model: {source}")
        for gpus in args.gpus:
            batch, k, top_k = SCALE.get(gpus, (2 * gpus, 2, 4))
            cluster = cluster_for(gpus, args)
            settings = SearchSettings.from_config(global_batch=batch, sample_batches=k, top_k=top_k,
                                                  schedules=tuple(args.schedules))
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
            print(summary(result, cluster, batch, shape=shape))
            base = result.baseline.evaluation
            speedup = base.mean_s / result.chosen.mean_s if base is not None else None
            rows.append((llm, gpus, batch, wall, describe_plan(result.chosen.plan, shape), speedup,
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
