"""Activation recomputation on the ``small`` preset, CPU: bytes kept for backward and step time per mode.

    python benchmarks/bench_recompute.py [--rounds 5] [--tiles 4] [--lengths 256 160 96]

Builds LLaVA-OV siglip-small + qwen2.5-small (float32, one torch thread) and runs a vision stage
(all 6 SigLIP layers on ``--tiles`` tiles of 256 patches) and an LLM stage (all 8 decoder layers on
one packed row of ``--lengths``) in recompute modes none / selective / full:

- bytes saved for backward, counted by saved-tensor hooks (`saved_tensor_bytes`), against the
  closed form of `dflop.costmodel.activations` (from the config's widths, heads and dtype);
- forward + backward time (thread CPU time of the calling thread, so other processes on the cores
  do not inflate it; rounds interleave the modes), as a ratio to none, against the overhead the
  analytic cost model predicts: ``(bwd[mode] - bwd[none]) / (fwd + bwd)[none]`` from FLOP counts
  (tp 1, no per-op overhead), and the same recomputed-forward fraction applied to the measured
  forward time (``1 + f * fwd_measured / step_measured``, f = recomputed FLOPs / forward FLOPs),
  which removes the analytic model's backward = 2 x forward assumption.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflop.costmodel import activations
from dflop.cpu_memory import reuse_large_cpu_allocations
from dflop.costmodel.analytic import analytic_cost_model
from dflop.models.architectures import ImageLayout, architecture_of
from dflop.models.builder import build_model
from dflop.models.packing import PackedSequence
from dflop.models.stages import build_llm_stage, build_vision_stage
from dflop.profiling._memory import saved_tensor_bytes

MODES = ("none", "selective", "full")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiles", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 160, 96])
    args = parser.parse_args()
    torch.set_num_threads(1)
    reuse_large_cpu_allocations()  # as the CPU trainer does (dflop.cpu_memory)
    torch.manual_seed(0)
    model = build_model("llava_ov", "siglip-small", "qwen2.5-small", seed=0)
    config, text = model.config, model.config.get_text_config()
    arch = architecture_of(model)
    n_v, n_l = arch.n_feature_layers(config), text.num_hidden_layers
    tokens_per_tile = arch.layer_tokens_per_tile(config)
    packed = PackedSequence.from_lengths(args.lengths)
    layout = ImageLayout((args.tiles,), torch.zeros(1, 2))
    vision_in = torch.randn(args.tiles, tokens_per_tile, config.vision_config.hidden_size)
    llm_in = torch.randn(1, packed.total_tokens, text.hidden_size)

    def stage_run(part, mode):
        # a middle stage: layers only, as the cost model's per-layer terms count them
        if part == "vision":
            stage = build_vision_stage(model, 1, 3, (0, n_v), recompute=mode)
            return lambda x: stage(x, layout), vision_in
        stage = build_llm_stage(model, 1, 3, (0, n_l), recompute=mode)
        return lambda x: stage(x, packed), llm_in

    predicted_bytes = {
        ("vision", m): activations.vision_stage_layer_bytes(config, args.tiles, n_v, m, "float32") for m in MODES}
    predicted_bytes |= {
        ("llm", m): activations.llm_stage_layer_bytes(text, args.lengths, n_l, m, "float32") for m in MODES}
    cost = analytic_cost_model(config, tp_degrees=(1,), op_overhead_ms=0.0, dtype="float32")
    times = {
        ("vision", m): cost.vision_stage_time([args.tiles], n_layers=n_v, first=False, last=False, tp=1, recompute=m)
        for m in MODES}
    times |= {("llm", m): cost.llm_stage_time(args.lengths, n_layers=n_l, first=False, last=False, tp=1, recompute=m)
              for m in MODES}

    print(f"small preset, float32, 1 thread: vision {n_v} layers x {args.tiles} tiles x {tokens_per_tile} tokens; "
          f"LLM {n_l} layers x packed {args.lengths}")
    print("\nbytes saved for backward (hooks) vs closed form")
    print(f"{'stage':7} {'mode':10} {'measured MiB':>13} {'predicted MiB':>14} {'meas/pred':>10} {'vs none':>8}")
    measured_bytes = {}
    for part in ("vision", "llm"):
        for mode in MODES:
            fn, x = stage_run(part, mode)
            with saved_tensor_bytes(model.parameters()) as saved:
                fn(x.clone().requires_grad_())
            measured_bytes[part, mode] = saved.bytes
            print(f"{part:7} {mode:10} {saved.bytes / 2**20:13.3f} {predicted_bytes[part, mode] / 2**20:14.3f} "
                  f"{saved.bytes / predicted_bytes[part, mode]:10.4f} "
                  f"{saved.bytes / measured_bytes[part, 'none']:8.3f}")

    samples = {(p, m, k): [] for p in ("vision", "llm") for m in MODES for k in ("fwd", "step")}
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for part in ("vision", "llm"):
            for mode in MODES:
                fn, x = stage_run(part, mode)
                leaf = x.clone().requires_grad_()
                start = time.thread_time()
                out = fn(leaf)
                mid = time.thread_time()
                out.sum().backward()
                end = time.thread_time()
                model.zero_grad(set_to_none=True)
                samples[part, mode, "fwd"].append(mid - start)
                samples[part, mode, "step"].append(end - start)
    med = {k: statistics.median(v[1:]) for k, v in samples.items()}
    print(f"\nforward + backward time (thread CPU s, median of {args.rounds} interleaved rounds) vs predicted overhead")
    print(f"{'stage':7} {'mode':10} {'fwd s':>7} {'step s':>7} {'vs none':>8} {'analytic':>9} {'fwd-based':>10}")
    for part in ("vision", "llm"):
        none = times[part, "none"]
        for mode in MODES:
            t = times[part, mode]
            analytic = t.total_s / none.total_s
            fraction = (t.bwd_s - none.bwd_s) / none.fwd_s
            fwd_based = 1 + fraction * med[part, "none", "fwd"] / med[part, "none", "step"]
            print(f"{part:7} {mode:10} {med[part, mode, 'fwd']:7.3f} {med[part, mode, 'step']:7.3f} "
                  f"{med[part, mode, 'step'] / med[part, 'none', 'step']:8.3f} {analytic:9.3f} {fwd_based:10.3f}")


if __name__ == "__main__":
    main()
