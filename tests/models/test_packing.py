"""A packed row equals running each sample alone (forward and backward)."""

from __future__ import annotations

import math

import pytest
import torch

from dflop.errors import UserError
from dflop.models.builder import build_model
from dflop.models.packing import PackedSequence, packed_attention_forward
from dflop.models.stages import build_llm_stage


class _Causal(torch.nn.Module):
    is_causal = True


def _brute_force_attention(q, k, v, lengths, causal):
    """Explicit softmax(QK^T/sqrt(d) + mask) V with a block-diagonal (causal) mask; [1,H,T,d] -> [1,T,H,d]."""
    total = sum(lengths)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = sample[:, None] == sample[None, :]
    if causal:
        allowed &= torch.arange(total)[:, None] >= torch.arange(total)[None, :]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("lengths", [(5, 1, 9, 3), (4, 4, 4)], ids=["mixed", "equal"])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_attention_matches_block_diagonal_brute_force(lengths, causal):
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(1, 4, total, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, total, 8, generator=g, requires_grad=True)  # grouped-query: 2 kv heads
    v = torch.randn(1, 2, total, 8, generator=g, requires_grad=True)
    packed = PackedSequence.from_lengths(lengths)
    module = _Causal()
    module.is_causal = causal

    out, _ = packed_attention_forward(module, q, k, v, None, scaling=8**-0.5, **packed.attention_kwargs())
    expected = _brute_force_attention(q, k, v, lengths, causal)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)

    seed = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), seed)
    expected_grads = torch.autograd.grad(expected, (q, k, v), seed)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_shift_labels_stay_inside_each_sample():
    packed = PackedSequence.from_lengths([3, 2, 1])
    labels = torch.tensor([10, 11, 12, 20, 21, 30])
    assert packed.shift_labels(labels).tolist() == [11, 12, -100, 21, -100, -100]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1, 0]
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 6]
    with pytest.raises(UserError, match="at least one token"):
        PackedSequence.from_lengths([3, 0])


@pytest.mark.parametrize("arch,vision,llm", [("llava_ov", "siglip-tiny", "qwen2.5-tiny"),
                                             ("internvl", "internvit-tiny", "llama3-tiny")])
def test_packed_llm_equals_each_sample_alone(arch, vision, llm):
    """Reference: transformers' own model run on each sample separately (batch of one, no packing)."""
    torch.manual_seed(0)
    reference = build_model(arch, vision, llm, seed=0, llm_attention="sdpa")
    model = build_model(arch, vision, llm, seed=1)
    model.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(2)
    samples = [torch.randint(0, 2000, (n,), generator=g) for n in (7, 1, 12, 5)]

    # Reference: per-sample summed token loss and final hidden states; gradients accumulate over samples.
    expected_hidden, expected_loss = [], 0.0
    for s in samples:
        out = reference(input_ids=s[None], labels=s[None], use_cache=False, output_hidden_states=True)
        n_targets = len(s) - 1
        if n_targets:
            (out.loss * n_targets).backward()
            expected_loss += out.loss.item() * n_targets
        expected_hidden.append(out.hidden_states[-1][0].detach())

    packed = PackedSequence.from_lengths([len(s) for s in samples])
    ids = torch.cat(samples)
    body = build_llm_stage(model, 0, 2, (0, model.config.text_config.num_hidden_layers))
    head = build_llm_stage(model, 1, 2, (model.config.text_config.num_hidden_layers,) * 2)
    hidden = body(ids, packed)
    loss = head(hidden, packed, shift_labels=packed.shift_labels(ids), num_items_in_batch=1)  # summed loss
    loss.backward()

    norm = model.model.language_model.norm
    for got, want in zip(norm(hidden[0]).split(packed.lengths), expected_hidden):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if ref_params[name].grad is not None:
            torch.testing.assert_close(param.grad, ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packing_without_boundaries_would_differ():
    """Sanity check that the comparison above can fail: one causal row over all samples is different."""
    reference = build_model("llava_ov", "siglip-tiny", "qwen2.5-tiny", seed=0, llm_attention="sdpa")
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 2000, (6,), generator=g), torch.randint(0, 2000, (6,), generator=g)
    with torch.no_grad():
        alone = reference(input_ids=b[None], use_cache=False).logits[0]
        row = reference(input_ids=torch.cat([a, b])[None], use_cache=False).logits[0, 6:]
    assert not torch.allclose(alone, row, atol=1e-3)


# -- the kernels (model.packed_attention) ------------------------------------------------------------

def _qkv(lengths, heads=4, kv_heads=2, dim=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return [torch.randn(1, h, total, dim, generator=g, dtype=dtype).requires_grad_() for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("lengths", [(5, 1, 9, 3), (4, 4, 4), (33, 130, 7)], ids=["mixed", "equal", "blocks"])
@pytest.mark.parametrize("causal", [True, False])
def test_flex_kernel_equals_brute_force(lengths, causal):
    """flex_attention with the document mask (forward: CPU has no flex backward) against the explicit
    block-diagonal softmax; lengths past flex's 128-token blocks included."""
    from dflop.models.packing import _flex

    q, k, v = (t.detach() for t in _qkv(lengths))
    packed = PackedSequence.from_lengths(lengths)
    with torch.no_grad():
        got = _flex(q, k, v, packed, causal, 8**-0.5, 0.0)
    torch.testing.assert_close(got, _brute_force_attention(q, k, v, lengths, causal), rtol=1e-5, atol=1e-5)
    assert ("flex_block_mask", causal, q.device) in packed.cache  # built once per row, reused by each layer


def test_packed_attention_reads_lengths_from_the_host(monkeypatch):
    """With the row's PackedSequence (as every stage passes it) no kernel reads the boundaries back
    from the device: `.tolist()` / `.item()` would sync the host once per layer on CUDA."""
    from dflop.models import packing

    lengths = (5, 1, 9, 3)
    q, k, v = _qkv(lengths)
    packed = PackedSequence.from_lengths(lengths)

    def sync(*_):
        raise AssertionError("packed attention synced the host")

    monkeypatch.setattr(torch.Tensor, "tolist", sync)
    monkeypatch.setattr(torch.Tensor, "item", sync)
    out, _ = packing.packed_attention_forward(_Causal(), q, k, v, None, scaling=8**-0.5, **packed.attention_kwargs())
    monkeypatch.undo()
    torch.testing.assert_close(out, _brute_force_attention(q, k, v, lengths, True), rtol=1e-5, atol=1e-6)


def test_attention_inputs_share_the_autocast_dtype(monkeypatch):
    """Under bf16 autocast rotary leaves query and key in float32 while value comes from a bf16 matmul:
    the kernel must get all three in bf16 (flash-style kernels take one half-precision dtype)."""
    from dflop.models import packing

    seen = {}

    def spy(query, key, value, packed, causal, scaling, dropout):
        seen["dtypes"] = (query.dtype, key.dtype, value.dtype)
        return torch.zeros(1, query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype)

    monkeypatch.setitem(packing._KERNELS, "sdpa", spy)
    q, k, v = _qkv((3, 4))
    packed = PackedSequence.from_lengths((3, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packing.packed_attention_forward(_Causal(), q, k, v.bfloat16(), None, **packed.attention_kwargs())
    assert seen["dtypes"] == (torch.bfloat16,) * 3
    packing.packed_attention_forward(_Causal(), q, k, v, None, **packed.attention_kwargs())
    assert seen["dtypes"] == (torch.float32,) * 3  # no autocast: as given


def test_kernel_choice():
    from dflop.models import packing

    q = torch.zeros(1, 2, 4, 8)
    assert packing.kernel_for(q, "auto") == "sdpa"  # CPU: the per-sample SDPA
    assert packing.kernel_for(q, "flex") == "flex"
    with pytest.raises(UserError, match="CUDA in half precision"):
        packing.kernel_for(q, "varlen")
    with pytest.raises(UserError, match="unknown kernel"):
        packing.select_packed_kernel("fastest")
    if packing.flash_attn_varlen_func is None:
        with pytest.raises(UserError, match="flash-attn package is not installed"):
            packing.select_packed_kernel("flash_attn")
    assert packing.selected_packed_kernel() == "auto"


def test_a_half_precision_cuda_kernel_is_refused_before_the_run():
    from dflop.models import packing

    with pytest.raises(UserError, match="varlen runs on CUDA in half precision only.*float32 on cuda"):
        packing.select_packed_kernel("varlen", device_type="cuda", compute_dtype=torch.float32)
    with pytest.raises(UserError, match="runs on CUDA in half precision only.*on cpu"):
        packing.select_packed_kernel("varlen", device_type="cpu", compute_dtype=torch.bfloat16)
    assert packing.selected_packed_kernel() == "auto"  # nothing selected by a refused call
