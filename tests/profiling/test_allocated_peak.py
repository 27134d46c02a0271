"""`allocated_peak` against bytes counted by hand: chains of ops whose outputs have known sizes,
views, in-place ops, tensors freed part-way, storages autograd keeps after Python drops them, and
autocast's weight copies. (Against `torch.cuda.max_memory_allocated` only where a GPU is visible:
the allocator rounds each block up, so that comparison has a tolerance.)"""

from __future__ import annotations

import pytest
import torch

from dflop.profiling._memory import allocated_peak, saved_tensor_bytes

N = 1000  # elements: 4000 bytes in float32


def test_a_chain_of_ops_peaks_at_its_largest_live_set():
    x = torch.randn(N)  # made before the block: not counted
    with allocated_peak() as tracked:
        a = x * 2  # 4 N
        b = a.exp()  # 4 N, both alive: 8 N
        del a
        c = b.sum()  # 4
        d = torch.cat([b, b])  # 8 N beside b: 12 N + 4
        del b, d
    assert tracked.peak == 12 * N + 4
    assert tracked.live == 4  # c only
    del c
    assert tracked.live == 0


def test_views_share_their_base_and_in_place_ops_allocate_nothing():
    x = torch.randn(N)
    with allocated_peak() as tracked:
        a = x + 1  # 4 N
        view = a.view(10, N // 10)
        view.add_(1)  # in place on a storage made here
        x.mul_(2)  # in place on one made before: still nothing
        a_t = view.t()
        assert tracked.live == tracked.peak == 4 * N
        del a, view
        assert tracked.live == 4 * N  # the transposed view still holds the storage
        del a_t
        assert tracked.live == 0
        out = torch.empty(N)
        torch.add(x, 1, out=out)  # out= writes into the storage it was given
    assert tracked.peak == 4 * N


def test_a_tensor_freed_part_way_leaves_room_for_the_next():
    x = torch.randn(N)
    with allocated_peak() as tracked:
        for _ in range(3):
            y = x * 3  # the previous y is freed when the name is rebound, after the new one exists
        del y
        z = torch.zeros(N // 2)
    assert tracked.peak == 8 * N  # two ys at once, never three
    assert tracked.live == 2 * N
    del z


def test_storages_autograd_saves_stay_counted_until_backward_frees_them():
    x = torch.randn(N, requires_grad=True)
    with allocated_peak() as tracked:
        y = x.exp()  # ExpBackward saves its result: autograd's copy of the tensor, same storage
        loss = y.sum()
        del y  # Python's tensor is gone, the bytes are not
        assert tracked.live == 4 * N + 4
        loss.backward()  # the gradient (4 N) is made while the saved result still exists
        assert x.grad is not None
    assert tracked.peak == 4 * N + 4 + 4 * N + 4  # y, the loss, x's gradient, the loss's seed
    del loss
    assert tracked.live == 4 * N  # x's gradient, adopted by x


def test_autocast_weight_copies_and_saved_bytes_made_inside():
    """A Linear under bf16 autocast: the weight's bf16 copy and the input's are allocations of the
    forward (and saved), the output too; `SavedBytes.among` picks the saved storages made inside."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=True)  # both gradients wanted: both copies saved
    with allocated_peak() as tracked:
        with saved_tensor_bytes(exclude=list(layer.parameters())) as saved, torch.autocast("cpu", torch.bfloat16):
            out = layer(x)
        assert out.dtype == torch.bfloat16
        inside = saved.among(tracked.holding())
    weight_copy, input_copy, output = 2 * 64 * 32, 2 * 16 * 64, 2 * 16 * 32
    assert saved.bytes == inside == weight_copy + input_copy
    assert tracked.peak == weight_copy + input_copy + output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the CUDA allocator to compare with)")
def test_the_peak_is_the_cuda_allocators_on_large_tensors():
    x = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with allocated_peak() as tracked:
        a = x.exp()
        b = torch.log_softmax(a.view(1024, -1), dim=-1)
        del a
        c = b * 2
        del b, c
    torch.cuda.synchronize()
    assert tracked.peak == pytest.approx(torch.cuda.max_memory_allocated() - base, rel=0.01)


def test_flex_layers_are_profiled_without_the_tracker(monkeypatch):
    """The allocation tracker cannot follow flex attention's higher-order op (a dispatch mode has no
    rule for it: the profile would crash): with flex selected, the attention-bearing LLM modules
    measure their saved bytes only and leave the transient NaN (not fitted), the others as always."""
    import math

    from dflop.models import packing
    from dflop.profiling.model_profiler import _measured_run, _RankSync, _tracker_sees

    bench = lambda name: type("Bench", (), {"name": name})()
    monkeypatch.setattr(packing, "_selected", "flex")
    assert not _tracker_sees(bench("llm_layer")) and not _tracker_sees(bench("llm_attention"))
    assert _tracker_sees(bench("llm_head")) and _tracker_sees(bench("vision_layer"))
    monkeypatch.setattr(packing, "_selected", "auto")
    assert _tracker_sees(bench("llm_layer"))

    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    saved, transient = _measured_run(lambda: layer(x).relu(), list(layer.parameters()), [x],
                                     _RankSync(torch.device("cpu")), track=False)
    assert math.isnan(transient) and saved == 2 * 4 * 8 * 4  # the linear keeps x, relu its output
