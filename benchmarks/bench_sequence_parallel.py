"""Activation memory of a tensor-parallel LLM stage with and without sequence parallelism.

    python benchmarks/bench_sequence_parallel.py [--preset small] [--lengths 700 549 800]

Launches itself on 2 gloo ranks (torchrun, one torch thread each). Each rank builds the preset
model in bfloat16, takes its whole LLM as one stage (token embedding, every decoder layer, final
norm + LM head + vocabulary-parallel loss), shards it for TP=2 with and without
``sequence_parallel``, and runs one packed row of ``lengths`` (an odd total: SP pads it by one
ignored token) forward under saved-tensor hooks (`dflop.profiling._memory.saved_tensor_bytes`,
parameters excluded), then backward. Printed per rank: bytes saved for backward by the decoder
layers alone and by the whole stage, and the analytic cost model's prediction for the layers
(the analytic layer's act_bytes per token less `activations.sequence_parallel_saving` with SP, x tokens x layers).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_costmodel import PRESETS  # noqa: E402


def worker(preset: str, lengths: list[int]) -> None:
    import torch
    import torch.distributed as dist

    from dflop.costmodel.activations import sequence_parallel_saving
    from dflop.costmodel.analytic import analytic_cost_model
    from dflop.models.builder import build_model
    from dflop.models.llm_parts import run_decoder_layers
    from dflop.models.packing import PackedSequence
    from dflop.models.stages import build_llm_stage
    from dflop.models.tensor_parallel import TPGroup, shard_stage
    from dflop.profiling._memory import saved_tensor_bytes

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tp = TPGroup(dist.get_rank(), dist.get_world_size())
    arch, vision, llm = PRESETS[preset]
    packed = PackedSequence.from_lengths(lengths)
    tokens = packed.total_tokens
    rows = []
    for sp in (False, True):
        model = build_model(arch, vision, llm, seed=0).to(torch.bfloat16)
        text = model.config.text_config
        stage = shard_stage(build_llm_stage(model, 0, 1), tp, sp)
        ids = torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(0))  # text only
        labels = packed.shift_labels(ids)
        params = list(stage.parameters())
        with saved_tensor_bytes(exclude=params) as whole:
            loss = stage(ids, packed, shift_labels=labels, num_items_in_batch=1)
        loss.backward()
        # the decoder layers alone, on this rank's input (its sequence shard of the padded row with SP)
        padded, _ = stage.sequence_sharding.pad(packed, None) if sp else (packed, None)
        hidden = torch.randn(1, padded.total_tokens // (tp.size if sp else 1), text.hidden_size,
                             dtype=torch.bfloat16, requires_grad=True)
        cos_sin = stage.rotary_emb(hidden, padded.position_ids[None])
        with saved_tensor_bytes(exclude=params) as layers:
            out = run_decoder_layers(stage.layers, hidden, padded, cos_sin)
        out.sum().backward()
        cost = analytic_cost_model(model.config, tp_degrees=(tp.size,))
        saving = sequence_parallel_saving(text.hidden_size, tp.size, 2) if sp else 0.0
        per_token = cost.module("llm_layer", tp.size).coefficients("act_bytes")[0] - saving
        rows.append((sp, layers.bytes, per_token * tokens * len(stage.layers), whole.bytes, loss.item()))
    gathered = [None] * tp.size
    dist.all_gather_object(gathered, rows)
    if tp.rank == 0:
        mib = 2**20
        print(f"preset {preset}: {arch}/{vision}/{llm}, packed row of {tokens} tokens ({lengths}), "
              f"{len(stage.layers)} decoder layers, TP=2, bfloat16, gloo")
        print("| rank | SP | layers measured (MiB) | layers predicted (MiB) | pred/meas | whole stage measured (MiB) | loss |")
        print("|---|---|---|---|---|---|---|")
        for rank, rank_rows in enumerate(gathered):
            for sp, measured, predicted, whole_bytes, loss_value in rank_rows:
                print(f"| {rank} | {'on' if sp else 'off'} | {measured / mib:.2f} | {predicted / mib:.2f} | "
                      f"{predicted / measured:.3f} | {whole_bytes / mib:.2f} | {loss_value:.6f} |")
        (_, off_layers, off_pred, off_whole, _), (_, on_layers, on_pred, on_whole, _) = gathered[0]
        print(f"SP saving, rank 0: layers measured {(off_layers - on_layers) / mib:.3f} MiB, predicted "
              f"{(off_pred - on_pred) / mib:.3f} MiB ({(off_pred - on_pred) / (off_layers - on_layers):.3f} x); "
              f"whole stage measured {(off_whole - on_whole) / mib:.3f} MiB "
              f"({100 * (off_whole - on_whole) / off_whole:.1f} % of {off_whole / mib:.2f} MiB)")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[700, 549, 800])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.preset, args.lengths)
        return 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "--worker", "--preset", args.preset, "--lengths", *map(str, args.lengths)]
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
