"""Training-state bytes per parameter and the 1F1B in-flight counts."""

import pytest

from dflop.costmodel.memory import training_state_bytes
from dflop.plan import in_flight_1f1b
from dflop.errors import UserError


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adamw_state_bytes_per_parameter_are_what_a_training_step_holds(dtype):
    """Against the tensors themselves: a layer built, stepped and autocast as the trainer does
    (`dflop.models.precision`), its parameters, gradients and AdamW state counted in bytes."""
    import torch

    from dflop.models.optimizer import build_optimizer
    from dflop.models.precision import Precision

    precision = Precision.of(dtype)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    layer.to(precision.param_dtype)
    with precision.autocast("cpu"):
        out = layer(torch.randn(4, 8))
    out.float().sum().backward()
    optimizer = build_optimizer(list(layer.named_parameters()), lr=1e-3, weight_decay=0.1)
    optimizer.step()
    params = list(layer.parameters())
    n = sum(p.numel() for p in params)
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    table = training_state_bytes(dtype)
    assert (table.param * n, table.grad * n, table.optimizer * n) == (
        nbytes(params), nbytes(p.grad for p in params), nbytes(state))


def test_unknown_training_dtype():
    with pytest.raises(UserError, match="unsupported training dtype 'float8'"):
        training_state_bytes("float8")


def test_in_flight_follows_1f1b_warmup_depth():
    # Stage k of p runs p - k forwards before its first backward, never more than m.
    assert in_flight_1f1b(4, 8) == [4, 3, 2, 1]
    assert in_flight_1f1b(4, 2) == [2, 2, 2, 1]
    with pytest.raises(UserError):
        in_flight_1f1b(0, 4)
