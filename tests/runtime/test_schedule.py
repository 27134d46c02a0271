"""The executor's op order is the simulator's (an independent implementation of 1F1B / GPipe)."""

from __future__ import annotations

import pytest

from dflop.runtime.schedule import op_order
from dflop.sim.pipeline import stage_op_order


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("n_stages,m", [(1, 1), (2, 1), (3, 2), (4, 4), (4, 9), (6, 3)])
def test_op_order_matches_the_simulator(schedule, n_stages, m):
    for stage in range(n_stages):
        ours = [(0 if kind == "F" else 1, p) for kind, p in op_order(schedule, stage, n_stages, m)]
        assert ours == stage_op_order(schedule, stage, n_stages, m)


@pytest.mark.parametrize("n_stages,m", [(3, 2), (4, 8)])
def test_1f1b_keeps_at_most_p_minus_s_microbatches_in_flight(n_stages, m):
    for stage in range(n_stages):
        in_flight, peak, done = 0, 0, set()
        for kind, p in op_order("1f1b", stage, n_stages, m):
            if kind == "F":
                in_flight += 1
            else:
                assert p not in done
                done.add(p)
                in_flight -= 1
            peak = max(peak, in_flight)
        assert peak == min(m, n_stages - stage) and done == set(range(m))


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule must be one of"):
        op_order("interleaved", 0, 2, 2)
