"""Zero-head padding (InternViT-6B's 25 heads under TP 8, here 5 heads under TP 2 and 4): a padded,
tensor-parallel vision stage trains like the unpadded model in one process, its zero heads stay
exactly zero, the export has the unpadded model's shapes and weights, and a checkpoint of the
padded stage resumes to the same weights and optimizer state.

The reference is the unpadded model on each rank itself (same seed everywhere). Where the padding
sits is written out here from the layout (q/k/v rows and QK-norm entries appended after the real
width, output-projection columns likewise), not read from the code under test.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dflop.models.architectures import ImageLayout, architecture
from dflop.models.builder import build_from_config, model_config
from dflop.models.stages import build_llm_stage, build_vision_stage
from dflop.models.tensor_parallel import (TPGroup, drop_head_padding, local_tensor, shard_stage,
                                           shard_vision_layer)
from dflop.runtime.checkpoint import TrainState, load_latest, save_checkpoint
from dflop.runtime.export import export_hf
from dflop.runtime.param_names import rank_parameters
from test_checkpoint_helpers import INTERNVL, LLAVA, perturb_, spawn

HEADS, HEAD_DIM = 5, 12
# parameter name suffix -> padded dimension: InternViT (QK-norm, no bias) and SigLIP (q/k/v biases)
PADDED = {"attention.q_proj.weight": 0, "attention.k_proj.weight": 0, "attention.v_proj.weight": 0,
          "attention.q_norm.weight": 0, "attention.k_norm.weight": 0, "attention.projection_layer.weight": 1,
          **{f"self_attn.{p}_proj.{w}": 0 for p in "qkv" for w in ("weight", "bias")}, "self_attn.out_proj.weight": 1}
# eps 1e-3, not 1e-8: AdamW's first update g / (|g| + eps) turns the float32 summation-order noise
# of a near-zero gradient into up to lr of weight change (seen: 3e-5 on one projector entry at
# TP 4, unpadded part); a zero gradient still gives a zero update, so the padding check is as strict.
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-3)


def _config(spec=INTERNVL):
    """InternVL tiny with an InternViT-6B-like attention (5 heads, QK RMSNorm over all heads, no
    bias), or LLaVA-OV tiny with 5 SigLIP heads (attention biases)."""
    config = copy.deepcopy(model_config(*spec))
    vision = config.vision_config
    vision.num_attention_heads, vision.hidden_size = HEADS, HEADS * HEAD_DIM
    if spec == INTERNVL:
        vision.use_qk_norm, vision.norm_type, vision.attention_bias = True, "rms_norm", False
    return config


def _padded_dim(name: str) -> int | None:
    return next((dim for suffix, dim in PADDED.items() if name.endswith(suffix)), None)


def _mine(full_padded: torch.Tensor, param: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's part of a whole tensor laid out like `param` (DTensor Shard(d): the r-th of tp chunks)."""
    for placement in param.placements if isinstance(param, DTensor) else ():
        if placement.is_shard():
            return full_padded.chunk(tp.size, dim=placement.dim)[tp.rank]
    return full_padded


def _padded(name: str, tensor: torch.Tensor, tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(the unpadded model's tensor with zero heads appended, mask of the appended entries)."""
    dim = _padded_dim(name)
    if dim is None:
        return tensor, torch.zeros_like(tensor, dtype=torch.bool)
    extra = (-(-HEADS // tp.size) * tp.size - HEADS) * HEAD_DIM
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, extra]
    return F.pad(tensor, pad), F.pad(torch.zeros_like(tensor, dtype=torch.bool), pad, value=True)


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()),
                               msg=lambda detail: f"{what}: {detail}")


def _check_like_reference(what: str, tp_stage, ref_stage, tp: TPGroup, grads: bool) -> None:
    """Every parameter (or its gradient) of the sharded stage equals this rank's part of the padded
    reference; the padded entries are exactly zero."""
    ref = dict(ref_stage.named_parameters())
    n_padded = 0
    for name, param in tp_stage.named_parameters():
        got = local_tensor(param.grad if grads else param)
        full, mask = _padded(name, ref[name].grad if grads else ref[name].detach(), tp)
        want, pad = _mine(full, param, tp), _mine(mask, param, tp)
        assert got.shape == want.shape, f"{what} {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        _close(f"{what} {name}", got, want)
        assert torch.count_nonzero(got[pad]) == 0, f"{what} {name}: padded entries are not exactly zero"
        n_padded += int(pad.sum())
    assert n_padded > 0 or tp.rank < tp.size - 1, f"{what}: the last rank holds no zero heads"


def _worker(rank: int, world: int, tmp: str) -> None:
    tp = TPGroup(rank=rank, size=world)
    config = _config()
    ref_model = build_from_config(config, seed=0)
    perturb_(ref_model)  # norms away from ones, so a wrong QK-norm width shows
    tp_model = copy.deepcopy(ref_model)
    ref_stage = build_vision_stage(ref_model, 0, 1)
    tp_stage = shard_stage(build_vision_stage(tp_model, 0, 1), tp)
    ref_opt, tp_opt = (torch.optim.AdamW(stage.parameters(), **ADAMW) for stage in (ref_stage, tp_stage))

    size = config.vision_config.image_size[0]
    layout = ImageLayout((2, 1), torch.tensor([[size, 2 * size], [size, size]]))
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        pixels = torch.randn(layout.n_tiles, 3, size, size, generator=g)
        outs, losses = [], []
        for stage in (ref_stage, tp_stage):
            out = stage(pixels, layout)
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
            loss = (out * weights).sum()
            loss.backward()
            outs.append(out.detach()), losses.append(loss.detach())
        _close(f"step {step} output", outs[1], outs[0])
        _close(f"step {step} loss", losses[1], losses[0])
        _check_like_reference(f"step {step} grad", tp_stage, ref_stage, tp, grads=True)
        ref_opt.step(), tp_opt.step()
        ref_opt.zero_grad(), tp_opt.zero_grad()
    _check_like_reference("after 2 AdamW steps", tp_stage, ref_stage, tp, grads=False)

    # SigLIP layer (5 heads, biases): the zero heads' q/k/v bias gradients are exactly zero too
    siglip, siglip_config = architecture("llava_ov"), _config(LLAVA)
    torch.manual_seed(2)
    ref_layer = siglip.new_vision_layer(siglip_config)
    perturb_(ref_layer)
    tp_layer = shard_vision_layer(copy.deepcopy(ref_layer), tp)
    width = siglip_config.vision_config.hidden_size
    hidden = torch.randn(2, siglip.layer_tokens_per_tile(siglip_config), width, generator=g)
    outs = []
    for layer in (ref_layer, tp_layer):
        x = hidden.clone().requires_grad_(True)
        out = siglip.run_vision_layer(layer, x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
        outs.append((out.detach(), x.grad))
    _close("SigLIP layer output", outs[1][0], outs[0][0])
    _close("SigLIP layer input grad", outs[1][1], outs[0][1])
    _check_like_reference("SigLIP layer grad", tp_layer, ref_layer, tp, grads=True)

    # export: the unpadded model's shapes and the single-process model's trained weights
    params = rank_parameters(tp_model, [tp_stage, build_llm_stage(tp_model, 0, 1)])
    out = export_hf(f"{tmp}/export_{world}", params)
    if rank == 0:
        exported = type(ref_model).from_pretrained(out).state_dict()
        reference = ref_model.state_dict()
        assert set(exported) == set(reference)
        for name, value in reference.items():
            assert exported[name].shape == value.shape, f"export {name}: {exported[name].shape} != {value.shape}"
            _close(f"export {name}", exported[name], value)

    # checkpoint: saved padded, resumed into a fresh padded stage to the same weights and AdamW state
    save_checkpoint(f"{tmp}/ckpt_{world}", 2, TrainState(params, tp_opt))
    fresh = build_from_config(config, seed=1)
    fresh_stage = shard_stage(build_vision_stage(fresh, 0, 1), tp)
    fresh_opt = torch.optim.AdamW(fresh_stage.parameters(), **ADAMW)
    fresh_params = rank_parameters(fresh, [fresh_stage, build_llm_stage(fresh, 0, 1)])
    assert load_latest(f"{tmp}/ckpt_{world}", TrainState(fresh_params, fresh_opt)) == 2
    for (name, saved), resumed in zip(tp_stage.named_parameters(), fresh_stage.parameters()):
        assert torch.equal(local_tensor(resumed), local_tensor(saved)), f"resumed {name}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(local_tensor(fresh_opt.state[resumed][key]),
                               local_tensor(tp_opt.state[saved][key])), f"resumed {name} {key}"


@pytest.mark.parametrize("world", [2, 4])
def test_padded_vision_heads_train_export_and_resume_like_the_unpadded_model(tmp_path, world):
    spawn(_worker, world, tmp_path, world, str(tmp_path))


def test_drop_head_padding_refuses_padding_that_was_trained():
    padded = torch.cat([torch.ones(3, 4), torch.zeros(2, 4)])
    assert torch.equal(drop_head_padding("w", padded, 0, 3), torch.ones(3, 4))
    padded[4, 1] = 1e-12
    with pytest.raises(RuntimeError, match="w: its zero-head padding is no longer zero"):
        drop_head_padding("w", padded, 0, 3)
