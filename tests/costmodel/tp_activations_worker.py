"""torchrun worker for test_activations.py: bytes the model profiler's modules keep for backward on
one rank of TP=2 (tiny LLaVA-OV), as the profiler builds and runs them, under each ``model.dtype``.

Rank 0 prints one line per dtype, module and recompute mode: ``SAVED <dtype> <module> <mode> <batch>
<seq_len> <bytes>`` (this rank's bytes, parameters excluded, autocast's bf16 copies of this rank's
matmul and convolution weights subtracted), and the vocabulary-parallel LM head's transient bytes as
the profiler measures them: ``TRANSIENT <dtype> llm_head <tokens> <bytes>``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dflop.models.architectures import architecture, architecture_of
from dflop.models.builder import model_config
from dflop.models.precision import Precision
from dflop.models.tensor_parallel import TPGroup, local_tensor
from dflop.profiling._memory import saved_tensor_bytes
from dflop.profiling.model_modules import TILE_MODULES, build_benches
from dflop.profiling.model_profiler import _measured_run, _RankSync
from dflop.runtime.process_group import end_worker

MODEL = ("llava_ov", "siglip-tiny", "qwen2.5-tiny")
MODULES = ("vision_embed", "vision_layer", "projector", "llm_layer")
HEAD_TOKENS = (256, 1024)


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tp = TPGroup(dist.get_rank(), dist.get_world_size())
    config = model_config(*MODEL)
    tile_tokens = architecture_of(config).layer_tokens_per_tile(config)
    for dtype in ("float32", "bfloat16"):
        precision = Precision.of(dtype)
        benches = build_benches(architecture(MODEL[0]), config, modules=MODULES, tp=tp, device=torch.device("cpu"),
                                precision=precision)
        for bench in benches:
            batch, seq_len = (2, tile_tokens) if bench.name in TILE_MODULES else (2, 32)
            for mode in ("none",) + bench.recompute_modes:
                torch.manual_seed(0)
                inputs = bench.make_inputs(batch, seq_len)
                with bench.recomputing(mode) as forward:
                    with saved_tensor_bytes(exclude=list(bench.module.parameters())) as saved:
                        with precision.autocast("cpu"):
                            forward(*inputs)
                copies = 0 if not precision.mixed or mode == "full" else 2 * sum(
                    local_tensor(m.weight).numel() for m in bench.module.modules()
                    if isinstance(m, (nn.Linear, nn.Conv2d)))
                if tp.rank == 0:
                    print(f"SAVED {dtype} {bench.name} {mode} {batch} {seq_len} {saved.bytes - copies}", flush=True)
        # the vocabulary-parallel head's transient, as the model profiler measures it
        (head,) = build_benches(architecture(MODEL[0]), config, modules=("llm_head",), tp=tp,
                                device=torch.device("cpu"), precision=precision)
        for tokens in HEAD_TOKENS:
            torch.manual_seed(0)
            inputs = head.make_inputs(1, tokens)
            leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]

            def forward():
                with precision.autocast("cpu"):
                    return head.forward(*inputs)

            _, transient = _measured_run(forward, list(head.module.parameters()), leaves, _RankSync(torch.device("cpu")))
            if tp.rank == 0:
                print(f"TRANSIENT {dtype} llm_head {tokens} {transient}", flush=True)


if __name__ == "__main__":
    main()
    end_worker()  # barrier, destroy the group, os._exit (see end_worker)
