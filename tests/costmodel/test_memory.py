"""Training-state bytes per parameter and the 1F1B in-flight counts."""

import pytest

from dflop.costmodel.memory import training_state_bytes
from dflop.plan import in_flight_1f1b
from dflop.errors import UserError


def test_adamw_state_bytes_per_parameter():
    fp32 = training_state_bytes("torch.float32")
    assert (fp32.param, fp32.grad, fp32.optimizer, fp32.total) == (4, 4, 8, 16)
    bf16 = training_state_bytes("bf16")
    assert (bf16.param, bf16.grad, bf16.optimizer, bf16.total) == (2, 2, 12, 16)
    with pytest.raises(UserError, match="unsupported training dtype 'float8'"):
        training_state_bytes("float8")


def test_in_flight_follows_1f1b_warmup_depth():
    # Stage k of p runs p - k forwards before its first backward, never more than m.
    assert in_flight_1f1b(4, 8) == [4, 3, 2, 1]
    assert in_flight_1f1b(4, 2) == [2, 2, 2, 1]
    with pytest.raises(UserError):
        in_flight_1f1b(0, 4)
