"""Shared by test_checkpoint.py and test_export.py (no tests here): spawning gloo process groups,
the rank layouts the tests distribute a tiny model over, and a resumable toy training loop.

Reusable for the trainer's kill-and-resume test: `spawn` runs a function on N fresh processes,
`run_toy_training` is the reference loop (checkpoint every few steps, stop early to simulate a
kill, re-run to resume), and `dflop.runtime.checkpoint.read_checkpoint_model` reads the final
weights of two runs for an exact comparison.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dflop.models.builder import build_model
from dflop.models.stages import build_llm_stage, build_vision_stage
from dflop.models.tensor_parallel import (
    TPGroup,
    VocabParallelCausalLMHead,
    VocabParallelEmbedding,
    shard_llm_layer,
    shard_projector,
    shard_vision_layer,
)
from dflop.runtime.checkpoint import TrainState, load_latest, save_checkpoint
from dflop.runtime.param_names import RankParameters, rank_parameters
from dflop.runtime.process_group import end_worker, global_rank, world_size

# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------


def _entry(rank: int, world: int, store: str, fn, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        fn(rank, *args)
    except BaseException:
        dist.destroy_process_group()
        raise  # torch.multiprocessing reports it to the parent, which ends the other ranks
    # Done: as a torchrun worker ends (a barrier, then no interpreter teardown racing gloo's threads,
    # where a finished forked rank hung under load in the process group's destructor).
    end_worker()


def spawn(fn, world: int, tmp_path: Path, *args) -> None:
    """Run ``fn(rank, *args)`` on `world` new processes in one gloo process group (CPU); an
    exception on any rank fails the caller.

    Forked, not spawned: the children inherit the imported modules (a spawned child re-imports
    torch and transformers, 10-30 s on a busy 2-core machine). The parent holds no process group
    and no CUDA context, so forking is safe; everything the test checks is built in the child."""
    store = tmp_path / f"pg_store_{fn.__name__}_{len(list(tmp_path.glob('pg_store_*')))}"
    mp.start_processes(_entry, args=(world, str(store), fn, args), nprocs=world, join=True, start_method="fork")


# --------------------------------------------------------------------------------------------------
# Deterministic "training" values: the same on every rank holding the same tensor
# --------------------------------------------------------------------------------------------------


def noise(name: str, shape, salt: int = 0) -> torch.Tensor:
    """Small values that depend only on (name, shape, salt)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + salt)
    return 0.01 * torch.randn(tuple(shape), generator=g)


def perturb_(model: nn.Module) -> None:
    """Move every parameter away from its init, by name (the same on every rank)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(noise(name, param.shape, salt=1))


def perturbed_weights(spec: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """The full model every layout cuts its shares from: `build_model(*spec, seed=0)`, perturbed."""
    model = build_model(*spec, seed=0)
    perturb_(model)
    return {name: p.detach() for name, p in model.named_parameters()}


def fake_steps(params: RankParameters, optimizer, scheduler, n: int, salt: int) -> None:
    """n optimizer steps with gradients that depend on (name, TP rank, salt): replicas agree."""
    from torch.distributed.tensor import DTensor

    for step in range(n):
        for name, param in params.tensors.items():
            if isinstance(param, DTensor):
                local = param.to_local()
                sharded = any(p.is_shard() for p in param.placements)  # replicated: the same everywhere
                tp_rank = param.device_mesh.get_local_rank() if sharded else 0
                grad = noise(name, local.shape, salt * 100 + step * 10 + tp_rank)
                param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False)
            else:
                param.grad = noise(name, param.shape, salt * 100 + step * 10)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def warmup_cosine(warmup: int, total: int):
    """LR factor: linear warm-up over `warmup` steps, then cosine decay to 0 at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def make_state(params: RankParameters, *, total_steps: int = 10, data_seed: int = 0) -> TrainState:
    optimizer = torch.optim.AdamW(list(params.tensors.values()), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(2, total_steps))
    return TrainState(params, optimizer, scheduler, data_seed=data_seed)


# --------------------------------------------------------------------------------------------------
# Rank layouts of a tiny model
# --------------------------------------------------------------------------------------------------

LLAVA = ("llava_ov", "siglip-tiny", "qwen2.5-tiny")  # tied embeddings
INTERNVL = ("internvl", "internvit-tiny", "llama3-tiny")  # untied
# SigLIP's post-layernorm: LLaVA-OneVision takes the last layer's output before it (test_stages).
LLAVA_UNTRAINED = {"model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"}


@dataclass
class Layout:
    """One rank's share of a model, and the full weights it was cut from (the reference)."""

    model: nn.Module
    params: RankParameters
    reference: dict[str, torch.Tensor]  # full model's parameters, by name, before any sharding
    untrained: set[str]


def _poison_unowned_(model: nn.Module, parts: list[nn.Module], keep: set[str]) -> None:
    """NaN in every full-model parameter this rank does not run, so using it anywhere shows."""
    owned = {id(p) for module in parts for p in module.parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if id(param) not in owned and name not in keep:
                param.fill_(float("nan"))


def pipeline_layout(rank: int, world: int) -> Layout:
    """LLaVA-OV tiny over 2 ranks: rank 0 = vision + LLM stage 0 (layer 0), rank 1 = LLM stage 1
    (layer 1, norm, tied head). world == 1: everything on one rank."""
    model = build_model(*LLAVA, seed=0)
    perturb_(model)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    if world == 1:
        parts = [build_vision_stage(model, 0, 1), build_llm_stage(model, 0, 1)]
    elif rank == 0:
        parts = [build_vision_stage(model, 0, 1), build_llm_stage(model, 0, 2)]
    else:
        parts = [build_llm_stage(model, 1, 2)]
    _poison_unowned_(model, parts, LLAVA_UNTRAINED)
    return Layout(model, rank_parameters(model, parts), reference, LLAVA_UNTRAINED)


def tensor_parallel_layout(rank: int, world: int, tp_size: int | None = None,
                           sequence_parallel: bool = False) -> Layout:
    """InternVL tiny, every part sharded with dflop's DTensor TP (heads/MLP columns, projector,
    vocabulary-parallel embedding and LM head) over groups of `tp_size` neighbouring
    ranks (default: all ranks); the world / tp_size groups are data-parallel replicas.
    `sequence_parallel`: the LLM's norm weights become replicated DTensors."""
    model = build_model(*INTERNVL, seed=0)
    perturb_(model)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    tp_size = tp_size or world
    if tp_size == world:
        tp = TPGroup(rank=rank, size=world)
    else:  # every rank creates every group, in the same order
        groups = [dist.new_group(list(range(start, start + tp_size))) for start in range(0, world, tp_size)]
        tp = TPGroup(rank=rank % tp_size, size=tp_size, group=groups[rank // tp_size])
    vision, llm = build_vision_stage(model, 0, 1), build_llm_stage(model, 0, 1)
    for layer in vision.layers:
        shard_vision_layer(layer, tp)
    shard_projector(model.model.multi_modal_projector, tp)
    for layer in llm.layers:
        shard_llm_layer(layer, tp, sequence_parallel)
    llm.embedding.embed_tokens = VocabParallelEmbedding(llm.embedding.embed_tokens, tp)
    llm.head = VocabParallelCausalLMHead(llm.head.norm, llm.head.lm_head, tp, sequence_parallel)
    parts = [vision, llm]
    _poison_unowned_(model, parts, set())
    return Layout(model, rank_parameters(model, parts), reference, set())


def dtensor_layout(rank: int, world: int) -> Layout:
    """LLaVA-OV tiny, whole on every rank, with the LLM layers' linear layers parallelised by
    torch's own DTensor ``parallelize_module`` (column-wise q/k/v/gate/up, row-wise o/down)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build_model(*LLAVA, seed=0)
    perturb_(model)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (world,))
    plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
             "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.language_model.layers:
        parallelize_module(layer, mesh, plan)
    parts = [build_vision_stage(model, 0, 1), build_llm_stage(model, 0, 1)]
    return Layout(model, rank_parameters(model, parts), reference, LLAVA_UNTRAINED)


LAYOUTS = {"pipeline": pipeline_layout, "tensor_parallel": tensor_parallel_layout, "dtensor": dtensor_layout}


# --------------------------------------------------------------------------------------------------
# A resumable toy training loop (data parallel over the process group, no pipeline)
# --------------------------------------------------------------------------------------------------

GLOBAL_BATCH, SEQ_LEN = 4, 12


def toy_batch(data_seed: int, step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's share [GLOBAL_BATCH / world, SEQ_LEN] of global batch `step` (token ids)."""
    g = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
    ids = torch.randint(0, 2000, (GLOBAL_BATCH, SEQ_LEN), generator=g)
    per_rank = GLOBAL_BATCH // world
    return ids[rank * per_rank:(rank + 1) * per_rank]


def run_toy_training(ckpt_root: Path, *, total_steps: int, stop_after: int | None = None,
                     save_every: int = 2, data_seed: int = 7) -> dict[str, torch.Tensor]:
    """Train the tiny LLaVA-OV LLM for `total_steps`, resuming from `ckpt_root` if it holds a
    checkpoint; stop after step `stop_after` (a kill). Returns the final parameters.

    Every step draws from python's, numpy's and torch's global RNG (stand-ins for dropout and data
    augmentation), so a resume that lost any RNG stream, the data position, the optimizer or the
    LR schedule ends with different weights.
    """
    rank, world = global_rank(), world_size()
    model = build_model(*LLAVA, seed=0)
    state = make_state(rank_parameters(model), total_steps=total_steps, data_seed=data_seed)
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    start = load_latest(ckpt_root, state) or 0
    for step in range(start, total_steps):
        ids = toy_batch(state.data_seed, step, rank, world)
        ids = ids.masked_fill(torch.rand(ids.shape) < 0.15, 0)
        weight = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss * weight
        loss.backward()
        if world > 1:
            for param in model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)
                    param.grad /= world
        state.optimizer.step()
        state.lr_scheduler.step()
        state.optimizer.zero_grad()
        if (step + 1) % save_every == 0 or step + 1 == total_steps:
            save_checkpoint(ckpt_root, step + 1, state)
        if stop_after is not None and step + 1 == stop_after:
            break
    return {name: p.detach().clone() for name, p in model.named_parameters()}
