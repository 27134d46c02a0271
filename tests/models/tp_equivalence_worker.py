"""torchrun worker for test_tensor_parallel.py: every sharded part equals its full module.

Each rank builds the full module (same seed everywhere), shards a copy for its rank, runs both on
the same input, and compares output, input gradient and each shard's parameter gradient with the
matching slice of the full module's gradient. Exits non-zero with one line per mismatch.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

from dflop.models.architectures import ImageLayout, architecture, new_llm_layer, new_llm_norm, new_rotary_embedding
from dflop.models.builder import build_model, model_config
from dflop.models.llm_parts import CausalLMHead, TokenEmbedding, run_decoder_layers
from dflop.models.packing import PackedSequence
from dflop.models.stages import LLMStage, build_llm_stage, build_vision_stage
from dflop.models.tensor_parallel import (
    TPGroup,
    VocabParallelCausalLMHead,
    VocabParallelEmbedding,
    local_tensor,
    shard_llm_layer,
    shard_projector,
    shard_stage,
    shard_vision_layer,
)
from dflop.runtime.process_group import end_worker

FAILURES: list[str] = []


def _close(what, got, want):
    """float32 agreement up to summation order: 1e-5 relative to the tensor's largest entry."""
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item())):
        FAILURES.append(f"{what}: max |diff| {(got - want).abs().max().item():.3g}")


def _matching_slice(full: torch.Tensor, shard: torch.Tensor, rank: int) -> torch.Tensor:
    """The part of a full tensor a rank's shard holds (the one dimension that is 1/tp as long)."""
    shard = local_tensor(shard)
    if full.shape == shard.shape:
        return full
    (dim,) = [d for d in range(full.dim()) if full.shape[d] != shard.shape[d]]
    part = shard.shape[dim]
    return full.narrow(dim, rank * part, part)


def _same_placements(what, param):
    """A DTensor parameter's gradient is laid out like the parameter (the gradient sync and the
    norm read local shards)."""
    if isinstance(param, DTensor) and param.grad.placements != param.placements:
        FAILURES.append(f"{what}: gradient placements {param.grad.placements} != {param.placements}")


def check(name, full, sharded, run, inputs, tp, rename=None):
    """run(module, *inputs) -> output; inputs are leaf tensors (float ones get gradients)."""
    outs, grads = [], []
    for module in (full, sharded):
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = run(module, *leaves)
        seed = (torch.ones_like(out) if out.dim() == 0
                else torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
        out.backward(seed)
        outs.append(out.detach())
        grads.append([x.grad for x in leaves if x.requires_grad])
    _close(f"{name} output", outs[1], outs[0])
    for got, want in zip(grads[1], grads[0]):
        _close(f"{name} input grad", got, want)
    full_params = dict(full.named_parameters())
    for pname, param in sharded.named_parameters():
        ref = full_params[(rename or {}).get(pname, pname)]
        _same_placements(f"{name} grad {pname}", param)
        _close(f"{name} grad {pname}", local_tensor(param.grad), _matching_slice(ref.grad, param, tp.rank))


def check_megatron_collectives(name, sharded, run, hidden):
    """Megatron's communication: one all-reduce per block (attention, MLP) forward and one backward
    (the q/k/v and gate/up projections share their input's gradient sum)."""
    x = hidden.detach().clone().requires_grad_(True)
    with CommDebugMode() as forward:
        out = run(sharded, x)
    with CommDebugMode() as backward:
        out.sum().backward()
    for phase, mode in (("forward", forward), ("backward", backward)):
        counts = {str(op): n for op, n in mode.get_comm_counts().items()}
        if counts != {"c10d_functional.all_reduce": 2}:
            FAILURES.append(f"{name} {phase} collectives {counts}, want 2 all-reduces")


def check_whole_stages(arch, vision, llm, tp, g, sequence_parallel=False, llm_stages=1):
    """A vision stage + `llm_stages` LLM stages sharded with shard_stage vs the same stages unsharded,
    on a packed row of an odd number of tokens. Between LLM stages the hidden state passes as the
    stage hands it over (with sequence parallelism: this rank's sequence shard)."""
    full_model = build_model(arch, vision, llm, seed=0)
    tp_model = build_model(arch, vision, llm, seed=0)
    stages = {}
    for name, model in (("full", full_model), ("tp", tp_model)):
        stages[name] = [build_vision_stage(model, 0, 1)] + [build_llm_stage(model, j, llm_stages)
                                                            for j in range(llm_stages)]
    for stage in stages["tp"]:
        shard_stage(stage, tp, sequence_parallel and isinstance(stage, LLMStage))

    size = full_model.config.vision_config.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    image_sizes = torch.tensor([[size, 2 * size], [size, size]])
    if arch == "llava_ov":  # AnyRes: base tile + crop grid, as transformers counts them
        tiles = tuple(image_size_to_num_patches(s, full_model.config.image_grid_pinpoints, size) for s in image_sizes)
    else:
        tiles = (2, 1)
    layout = ImageLayout(tiles, image_sizes)
    pixels = torch.randn(layout.n_tiles, 3, size, size, generator=g)
    with torch.no_grad():
        n_image = stages["full"][0](pixels, layout).shape[0]
    image = full_model.config.image_token_id
    tail = 16 - n_image % 2  # an odd number of tokens in all: sequence parallelism pads the row
    ids = torch.cat([torch.randint(0, 2000, (5,), generator=g), torch.full((n_image,), image),
                     torch.randint(0, 2000, (tail,), generator=g)])
    packed = PackedSequence.from_lengths([5 + n_image + 7, tail - 7])
    assert packed.total_tokens % 2 == 1
    labels = packed.shift_labels(ids.masked_fill(ids == image, -100))
    losses = {}
    what = f"{arch}{' SP' if sequence_parallel else ''}{f' pp{llm_stages}' if llm_stages > 1 else ''} stage"
    for name, (vision_stage, *llm_stages_) in stages.items():
        hidden = vision_stage(pixels, layout)
        x = ids
        for j, llm_stage in enumerate(llm_stages_):
            kwargs = {"image_features": hidden} if j == 0 else {}
            if j == len(llm_stages_) - 1:
                kwargs["shift_labels"] = labels
            x = llm_stage(x, packed, **kwargs)
            if sequence_parallel and name == "tp" and j < len(llm_stages_) - 1:
                padded = packed.total_tokens + 1
                if tuple(x.shape) != (1, padded // tp.size, full_model.config.text_config.hidden_size):
                    FAILURES.append(f"{what}: stage output {tuple(x.shape)} is not this rank's sequence shard")
        losses[name] = x
        losses[name].backward()
    _close(f"{what} loss", losses["tp"].detach(), losses["full"].detach())
    for full_stage, tp_stage in zip(stages["full"], stages["tp"]):
        full_params = dict(full_stage.named_parameters())
        for pname, param in tp_stage.named_parameters():
            ref = full_params[{"head.weight": "head.lm_head.weight"}.get(pname, pname)]
            if ref.grad is None:
                continue
            _same_placements(f"{what} grad {pname}", param)
            _close(f"{what} grad {pname}", local_tensor(param.grad), _matching_slice(ref.grad, param, tp.rank))


def check_sequence_parallel_collectives(name, layer, tp, run, hidden):
    """Megatron-SP: each all-reduce of a block becomes an all-gather (into the column-parallel
    projections) + a reduce-scatter (out of the row-parallel one), forward and backward; the
    norm weights' gradients (computed from this rank's tokens) are all-reduced in backward."""
    x = hidden.detach().clone().requires_grad_(True)
    with CommDebugMode() as forward:
        out = run(layer, x)
    with CommDebugMode() as backward:
        out.sum().backward()
    want_forward = {"c10d_functional.all_gather_into_tensor": 2, "c10d_functional.reduce_scatter_tensor": 2}
    for phase, mode, want in (("forward", forward, want_forward),
                              ("backward", backward, {**want_forward, "c10d_functional.all_reduce": 2})):
        counts = {str(op): n for op, n in mode.get_comm_counts().items()}
        if counts != want:
            FAILURES.append(f"{name} {phase} collectives {counts}, want {want}")


def main() -> int:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tp = TPGroup(rank=dist.get_rank(), size=dist.get_world_size())
    g = torch.Generator().manual_seed(0)

    for llm in ("qwen2.5-tiny", "llama3-tiny"):
        text_cfg = model_config("llava_ov", "siglip-tiny", llm).text_config
        torch.manual_seed(1)
        layer = new_llm_layer(text_cfg)
        rotary = new_rotary_embedding(text_cfg)
        packed = PackedSequence.from_lengths([5, 11, 3])
        hidden = torch.randn(1, packed.total_tokens, text_cfg.hidden_size, generator=g)

        def run_layer(module, x, packed=packed, rotary=rotary):
            return run_decoder_layers([module], x, packed, rotary(x, packed.position_ids[None]))

        sharded_layer = shard_llm_layer(copy.deepcopy(layer), tp)
        check(f"{llm} layer", layer, sharded_layer, run_layer, [hidden], tp)
        check_megatron_collectives(f"{llm} layer", sharded_layer, run_layer, hidden)

        # sequence parallelism: this rank's tokens in and out (20 tokens: the stage pads odd rows)
        sp_packed = PackedSequence.from_lengths([5, 11, 4])
        sp_hidden = torch.randn(1, sp_packed.total_tokens, text_cfg.hidden_size, generator=g)

        def run_sp_layer(module, x, packed=sp_packed, rotary=rotary):
            return run_decoder_layers([module], x, packed, rotary(x, packed.position_ids[None]))

        sp_layer = shard_llm_layer(copy.deepcopy(layer), tp, sequence_parallel=True)
        full_out_layer = copy.deepcopy(layer)
        x = sp_hidden.clone().requires_grad_(True)
        want = run_sp_layer(full_out_layer, x)
        want.backward(torch.ones_like(want))
        mine = sp_hidden.chunk(tp.size, dim=1)[tp.rank].clone().requires_grad_(True)
        got = run_sp_layer(sp_layer, mine)
        got.backward(torch.ones_like(got))
        _close(f"{llm} SP layer output", got.detach(), want.detach().chunk(tp.size, dim=1)[tp.rank])
        _close(f"{llm} SP layer input grad", mine.grad, x.grad.chunk(tp.size, dim=1)[tp.rank])
        full_params = dict(full_out_layer.named_parameters())
        for pname, param in sp_layer.named_parameters():
            _same_placements(f"{llm} SP layer grad {pname}", param)
            _close(f"{llm} SP layer grad {pname}", local_tensor(param.grad),
                   _matching_slice(full_params[pname].grad, param, tp.rank))
        check_sequence_parallel_collectives(f"{llm} SP layer", sp_layer, tp, run_sp_layer,
                                            sp_hidden.chunk(tp.size, dim=1)[tp.rank])

        embedding = torch.nn.Embedding(text_cfg.vocab_size, text_cfg.hidden_size)
        image_id = 2040
        ids = torch.randint(0, text_cfg.vocab_size, (packed.total_tokens,), generator=g)
        ids[2:6] = image_id
        features = torch.randn(4, text_cfg.hidden_size, generator=g)
        full_embed = TokenEmbedding(embedding, image_id)
        tp_embed = TokenEmbedding(VocabParallelEmbedding(embedding, tp), image_id)
        check(f"{llm} embedding", full_embed, tp_embed, lambda m, i, f: m(i, f), [ids, features], tp)

        lm_head = torch.nn.Linear(text_cfg.hidden_size, text_cfg.vocab_size, bias=False)
        norm = new_llm_norm(text_cfg)
        labels = packed.shift_labels(ids.masked_fill(ids == image_id, -100))
        full_head = CausalLMHead(norm, lm_head)
        tp_head = VocabParallelCausalLMHead(copy.deepcopy(norm), copy.deepcopy(lm_head), tp)
        for items in (None, 50):
            check(f"{llm} head (num_items={items})", full_head, tp_head,
                  lambda m, h, items=items: m(h, labels, items), [hidden], tp)
            full_head.zero_grad(), tp_head.zero_grad()

    for arch, vision, overrides in [("llava_ov", "siglip-tiny", {}),
                                    ("internvl", "internvit-tiny", {}),
                                    ("internvl", "internvit-tiny", dict(use_qk_norm=True, norm_type="rms_norm",
                                                                        attention_bias=False))]:
        spec = architecture(arch)
        config = model_config(arch, vision, "qwen2.5-tiny")
        for key, value in overrides.items():
            setattr(config.vision_config, key, value)
        torch.manual_seed(2)
        layer = spec.new_vision_layer(config)
        tokens = spec.layer_tokens_per_tile(config)
        hidden = torch.randn(3, tokens, config.vision_config.hidden_size, generator=g)
        check(f"{vision}{overrides or ''} layer", layer, shard_vision_layer(copy.deepcopy(layer), tp),
              spec.run_vision_layer, [hidden], tp)
        projector = spec.new_projector(config)  # InternVL: drop CLS + pixel shuffle + LayerNorm + MLP
        sharded = copy.deepcopy(projector)
        shard_projector(sharded.projector if hasattr(sharded, "projector") else sharded, tp)
        check(f"{arch} projector", projector, sharded, lambda m, x: m(x), [hidden], tp)

    for arch, vision, llm in [("llava_ov", "siglip-tiny", "qwen2.5-tiny"),
                              ("internvl", "internvit-tiny", "llama3-tiny")]:
        check_whole_stages(arch, vision, llm, tp, g)
    # sequence parallelism: embedding + head on one stage (tied weights), and across two stages
    check_whole_stages("llava_ov", "siglip-tiny", "qwen2.5-tiny", tp, g, sequence_parallel=True)
    check_whole_stages("internvl", "internvit-tiny", "llama3-tiny", tp, g, sequence_parallel=True, llm_stages=2)

    for line in FAILURES:
        print(f"rank {tp.rank}: {line}", file=sys.stderr)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    end_worker(main())  # barrier, destroy the group, os._exit (see end_worker)
