"""torchrun worker for test_sequence_parallel_memory.py: bytes saved for backward by one
tensor-parallel (TP=2) decoder layer of the tiny Qwen2, with and without sequence parallelism,
under each ``model.dtype``'s contract (`dflop.models.precision`: float32 parameters and residual
stream, bfloat16 under autocast).

Rank 0 prints one line per dtype and recompute mode: ``SAVED <dtype> <mode> <tokens> <bytes without
SP> <bytes with SP>`` (this rank's bytes, parameters excluded; T tokens in one packed sample; mode
none or full, the layer run under activation checkpointing).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from dflop.models.architectures import new_llm_layer, new_rotary_embedding
from dflop.models.builder import model_config
from dflop.models.llm_parts import run_decoder_layers
from dflop.models.packing import PackedSequence
from dflop.models.precision import Precision
from dflop.models.recompute import recompute_layer
from dflop.models.tensor_parallel import TPGroup, shard_llm_layer
from dflop.profiling._memory import saved_tensor_bytes
from dflop.runtime.process_group import end_worker

TOKENS = 96


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tp = TPGroup(dist.get_rank(), dist.get_world_size())
    cfg = model_config("llava_ov", "siglip-tiny", "qwen2.5-tiny").text_config
    packed = PackedSequence.from_lengths([TOKENS])
    for dtype in ("bfloat16", "float32"):
        precision = Precision.of(dtype)
        for mode in ("none", "full"):
            torch.manual_seed(0)
            layer, rotary = new_llm_layer(cfg), new_rotary_embedding(cfg)
            saved = []
            for sp in (False, True):
                sharded = shard_llm_layer(copy.deepcopy(layer), tp, sequence_parallel=sp)
                rows = TOKENS // tp.size if sp else TOKENS
                x = torch.randn(1, rows, cfg.hidden_size, dtype=precision.stream_dtype, requires_grad=True)
                cos_sin = rotary(x, packed.position_ids[None])
                with saved_tensor_bytes(exclude=sharded.parameters()) as result, precision.autocast("cpu"):
                    out = run_decoder_layers([recompute_layer(sharded, mode)], x, packed, cos_sin)
                out.sum().backward()
                saved.append(result.bytes)
            if tp.rank == 0:
                print(f"SAVED {dtype} {mode} {TOKENS} {saved[0]} {saved[1]}", flush=True)


if __name__ == "__main__":
    main()
    end_worker()  # barrier, destroy the group, os._exit (see end_worker)
