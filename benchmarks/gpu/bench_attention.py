"""Packed causal attention kernels side by side: time (forward + backward) and agreement.

    python benchmarks/gpu/bench_attention.py --out attention.json [--device cuda] [--tokens 8192]
        [--llm qwen2.5-0.5b qwen2.5-7b] [--repeats 10]

For each LLM preset's attention shape (query heads, key/value heads, head width), one packed row of
``--tokens`` tokens made of samples of mixed lengths (seeded; 1 to ~half the row), in bf16 on CUDA
(float32 on CPU), runs through each kernel of `dflop.models.packing` (``sdpa``: SDPA per sample;
``varlen``; ``flex``; ``flash_attn`` where installed) and through ``padded`` (every sample padded to
the longest, one batched causal SDPA call: what a padded trainer runs). Each kernel's output and
input gradients are compared with ``sdpa``'s (max absolute difference over the tensors' scale;
bf16 rounding leaves ~1e-2); its time is the median of ``--repeats`` timed runs after warm-up (CUDA
events). A kernel that cannot run here (no CUDA, no flash-attn, CPU flex has no backward) is
recorded as skipped with the reason. The JSON is rewritten after every kernel, so a cut run keeps
what it measured; the fastest kernel that agrees is named per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from dflop.io import atomic_path
from dflop.models import packing
from dflop.models.packing import PackedSequence
from dflop.models.presets import llm_preset

KERNELS = ("sdpa", "padded", "varlen", "flex", "flash_attn")
AGREEMENT = 0.05  # max |difference| / max |reference|: bf16 rounding stays far below this


def mixed_lengths(total: int, seed: int) -> list[int]:
    """Sample lengths that add up to `total`: log-uniform between 16 and total/2, seeded."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        n = int(torch.exp(torch.empty(1).uniform_(torch.log(torch.tensor(16.0)).item(),
                                                 torch.log(torch.tensor(total / 2)).item(), generator=g)).item())
        n = min(max(n, 1), left)
        lengths.append(n)
        left -= n
    return lengths


def padded_attention(query, key, value, packed: PackedSequence, causal, scaling, dropout):
    """Every sample padded (at its end) to the longest, one batched SDPA call; [1, H, T, d] -> [1, T, H, d].
    Right padding keeps causal outputs of real tokens exact (they never see a later position)."""
    longest, n = packed.max_seqlen, len(packed.lengths)

    def pad(t):
        out = t.new_zeros(n, t.shape[1], longest, t.shape[3])
        for i, part in enumerate(t[0].split(packed.lengths, dim=1)):
            out[i, :, :part.shape[1]] = part
        return out

    q, k, v = pad(query), pad(key), pad(value)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return torch.cat([out[i, :, :length] for i, length in enumerate(packed.lengths)], dim=1).unsqueeze(0) \
        .transpose(1, 2)


def run_kernel(name: str):
    return padded_attention if name == "padded" else packing._KERNELS[name]


def available(name: str, device: torch.device) -> str | None:
    """Why `name` cannot run here (None: it can)."""
    if name == "flash_attn" and packing.flash_attn_varlen_func is None:
        return "flash-attn is not installed"
    if name == "varlen" and packing.varlen_attn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if name in ("varlen", "flash_attn") and device.type != "cuda":
        return "CUDA only"
    return None


def time_ms(fn, device: torch.device, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return times


def make_shape(llm: str, args, device: torch.device, dtype: torch.dtype, report: dict) -> dict:
    """One LLM's head shape: its packed row's inputs and its report entry."""
    preset = llm_preset(llm)
    heads, kv_heads, head_dim = preset.num_heads, preset.num_kv_heads, preset.head_dim
    lengths = mixed_lengths(args.tokens, args.seed)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    q, k, v = (torch.randn(1, h, args.tokens, head_dim, generator=g).to(device, dtype)
               for h in (heads, kv_heads, kv_heads))
    report["shapes"][llm] = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "tokens": args.tokens,
                             "samples": len(lengths), "max_len": max(lengths), "kernels": {}}
    return {"llm": llm, "packed": PackedSequence.from_lengths(lengths, device=device), "qkv": (q, k, v),
            "seed": torch.randn(1, args.tokens, heads, head_dim, generator=g).to(device, dtype),
            "scale": head_dim**-0.5, "reference": None, "entry": report["shapes"][llm]}


def bench_kernel(name: str, shape: dict, args, device: torch.device) -> dict:
    """Time `name` on `shape` and compare it with the shape's SDPA reference (kept on the shape)."""
    why = available(name, device)
    if why is not None:
        return {"skipped": why}
    backward = not (name == "flex" and device.type == "cpu")  # CPU flex: forward only
    fn, packed, seed = run_kernel(name), shape["packed"], shape["seed"]
    leaves = [t.detach().clone().requires_grad_(backward) for t in shape["qkv"]]

    def step():
        for t in leaves:
            t.grad = None
        out = fn(*leaves, packed, True, shape["scale"], 0.0)
        if backward:
            out.backward(seed)
        return out

    began = time.perf_counter()
    try:
        out = step()  # also the first call: compiles flex on CUDA
        result = {"first_call_s": time.perf_counter() - began}
        grads = [t.grad.detach() for t in leaves] if backward else []
        if name == "sdpa":
            shape["reference"] = (out.detach(), grads)
        elif shape["reference"] is not None:
            ref_out, ref_grads = shape["reference"]
            diffs = [_relative_diff(out, ref_out)] + [_relative_diff(a, b) for a, b in zip(grads, ref_grads)]
            result["max_rel_diff"] = max(diffs)
            result["agrees"] = bool(max(diffs) < AGREEMENT)
        times = time_ms(step, device, args.repeats, args.warmup)
        result.update(median_ms=statistics.median(times), min_ms=min(times), repeats=len(times), backward=backward)
    except Exception as error:  # recorded, not fatal: the other kernels still run
        result = {"failed": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]}
        traceback.print_exc(file=sys.stderr)
    return result


def fastest(entry: dict) -> str | None:
    """The fastest packed kernel (padding is not one) that ran forward and backward and agreed."""
    timed = {n: r["median_ms"] for n, r in entry["kernels"].items()
             if "median_ms" in r and r.get("backward") and r.get("agrees", n == "sdpa") and n != "padded"}
    return min(timed, key=timed.get) if timed else None


def _relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--llm", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-7b"])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype), "torch": torch.__version__, "shapes": {}}

    def save():
        with atomic_path(args.out) as tmp:
            Path(tmp).write_text(json.dumps(report, indent=1))

    shapes = [make_shape(llm, args, device, dtype, report) for llm in args.llm]
    for name in args.kernels:  # kernel by kernel, flex's compilation last: a cut run keeps the others
        for shape in shapes:
            result = bench_kernel(name, shape, args, device)
            shape["entry"]["kernels"][name] = result
            shape["entry"]["fastest_packed"] = fastest(shape["entry"])
            print(f"{shape['llm']} {name}: {result}", flush=True)
            save()


if __name__ == "__main__":
    main()
