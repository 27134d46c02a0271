import threading
import time

import pytest

from dflop.scheduler.partition import greedy_partition, partition
from dflop.scheduler.service import KEPT_STEPS, SchedulerService

M, DP = 8, 2


def _batches(make_costs, k, n=96):
    return [make_costs(n, seed=100 + s)[1] for s in range(k)]


def test_prefetch_hides_solve_time(make_costs):
    batches = _batches(make_costs, 6)
    solve_s = 0.1

    def slow_solver(costs, *a, **k):  # an ILP that takes 100 ms more per batch
        time.sleep(solve_s)
        return partition(costs, *a, **{**k, "budget_s": 0.0})

    with SchedulerService(m=M, dp_llm=DP, dp_vision=DP, prefetch=2, solver=slow_solver) as svc:
        svc.submit(0, batches[0])
        svc.submit(1, batches[1])
        time.sleep(4 * solve_s + 0.3)  # the data loader runs ahead before the first step
        for step in range(len(batches)):
            if step + 2 < len(batches):
                svc.submit(step + 2, batches[step + 2])
            part = svc.get(step)
            assert not part.member.startswith("fallback"), step
            time.sleep(solve_s + 0.25)  # one training step, longer than one solve
        assert list(svc.fallbacks) == []
        # The loop never waited for a solve: each get took far less than the solve itself.
        assert max(svc.wait_s) < solve_s / 2


def test_not_ready_returns_greedy_without_waiting(make_costs):
    batch = _batches(make_costs, 1)[0]
    release = threading.Event()

    def stuck_solver(costs, *a, **k):  # overruns its budget by far
        release.wait(5)
        return partition(costs, *a, **k)

    want = greedy_partition(batch, M, DP, DP)
    with SchedulerService(m=M, dp_llm=DP, dp_vision=DP, budget_s=5.0, solver=stuck_solver) as svc:
        svc.submit(0, batch)
        t0 = time.perf_counter()
        part = svc.get(0)
        waited = time.perf_counter() - t0
        release.set()
    assert part.member.startswith("fallback:")  # not the stuck solve's result
    assert part.same_assignment(want)
    # One greedy partition (tens of ms; 0.14 s beside a busy loop and another test), not the 5-s
    # budget: a wall-clock bound with room for a loaded machine, far below what a wait would take.
    assert waited < 1.0
    assert list(svc.fallbacks) == [(0, "not ready")]


def test_solver_failure_falls_back_to_greedy(make_costs):
    batch = _batches(make_costs, 1)[0]

    def broken(*a, **k):
        raise RuntimeError("HiGHS exploded")

    with SchedulerService(m=M, dp_llm=DP, dp_vision=DP, solver=broken) as svc:
        svc.submit(0, batch)
        part = svc.get(0, timeout_s=10)
    assert part.member.startswith("fallback:")
    assert part.same_assignment(greedy_partition(batch, M, DP, DP))
    assert list(svc.fallbacks) == [(0, "solver failed: RuntimeError: HiGHS exploded")]


def test_deterministic_given_seed_and_budget(make_costs):
    batches = _batches(make_costs, 4, n=48)
    runs = []
    for _ in range(2):
        with SchedulerService(m=4, dp_llm=DP, dp_vision=DP, seed=11, budget_s=0.3, prefetch=3) as svc:
            for step, costs in enumerate(batches):
                svc.submit(step, costs)
            runs.append([svc.get(step, timeout_s=30) for step in range(len(batches))])
            assert list(svc.fallbacks) == []
    for a, b in zip(*runs):
        assert a.same_assignment(b) and a.member == b.member and a.step_s == b.step_s
    # And equal to calling partition directly with seed + step.
    direct = partition(batches[2], 4, DP, DP, seed=13, budget_s=0.3)
    assert runs[0][2].same_assignment(direct)


def test_bad_use_is_reported(make_costs):
    batch = _batches(make_costs, 1)[0]
    with SchedulerService(m=M, dp_llm=DP, dp_vision=DP) as svc:
        svc.submit(3, batch)
        with pytest.raises(ValueError, match="step 3 was already submitted"):
            svc.submit(3, batch)
        with pytest.raises(ValueError, match="submit in order"):
            svc.submit(1, batch)
        with pytest.raises(KeyError, match="step 7 was never submitted"):
            svc.get(7)
    with pytest.raises(ValueError, match="prefetch must be >= 1"):
        SchedulerService(m=M, dp_llm=DP, dp_vision=DP, prefetch=0)


def test_a_long_run_holds_no_more_state_than_a_short_one(make_costs):
    """Every per-step record the service keeps is bounded: after 10x KEPT_STEPS steps, each of
    them (with one solver failure per step, the worst case for `fallbacks`) is at most KEPT_STEPS
    long, while the newest steps are still there."""
    batch = _batches(make_costs, 1, n=16)[0]

    def broken(*a, **k):
        raise RuntimeError("no solver")

    steps = 10 * KEPT_STEPS
    with SchedulerService(m=4, dp_llm=DP, dp_vision=DP, solver=broken) as svc:
        for step in range(steps):
            svc.submit(step, batch)
            svc.get(step, timeout_s=5)
        kept = {"wait_s": svc.wait_s, "fallbacks": svc.fallbacks, "taken": svc._taken,
                "solved_corrected": svc.solved_corrected, "inputs": svc._inputs, "results": svc._results}
        assert {name: len(v) for name, v in kept.items() if len(v) > KEPT_STEPS + 1} == {}
        assert svc.fallbacks[-1][0] == steps - 1 and steps - 1 in svc._taken
        with pytest.raises(ValueError, match="already submitted"):
            svc.submit(steps - 1, batch)
