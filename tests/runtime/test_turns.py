"""Jobs taking their steps in turn (dflop.runtime.turns): jobs of 1 or 2 ranks, run as threads over
the shared directory, log when each rank begins and ends each step; the log must be the round-robin
order computed here (jobs leave the order when they finish), and no two jobs' steps overlap."""

from __future__ import annotations

import threading
import time

import pytest

from dflop.errors import UserError
from dflop.runtime.turns import TurnDir, Turns


def run_jobs(tmp_path, jobs: dict[str, tuple[int, int]], step_s: float = 0.002):
    """jobs: name -> (ranks, steps). Returns the log of (name, rank, step, "begin"|"end")."""
    shared = TurnDir(tmp_path / "turns")
    shared.create(list(jobs))
    log: list[tuple[str, int, int, str]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def rank_main(name: str, rank: int, barrier, steps: int) -> None:
        try:
            turns = Turns(shared.dir / name, rank=rank, barrier=barrier.wait if barrier else None, timeout_s=20)
            for step in range(steps):
                turns.wait()
                with lock:
                    log.append((name, rank, step, "begin"))
                time.sleep(step_s * (1 + rank))  # ranks of one job take different times
                with lock:
                    log.append((name, rank, step, "end"))
                turns.done(last=step == steps - 1)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = []
    for name, (ranks, steps) in jobs.items():
        barrier = threading.Barrier(ranks) if ranks > 1 else None
        threads += [threading.Thread(target=rank_main, args=(name, r, barrier, steps)) for r in range(ranks)]
    for t in threads:
        t.start()
    assert shared.start_when_ready(timeout_s=20)
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return log


def expected_order(jobs: dict[str, tuple[int, int]]) -> list[tuple[str, int]]:
    """Round robin over the jobs in order, skipping those with no steps left."""
    left = {name: steps for name, (_, steps) in jobs.items()}
    done = {name: 0 for name in jobs}
    order = []
    while any(left.values()):
        for name in jobs:
            if left[name]:
                order.append((name, done[name]))
                done[name] += 1
                left[name] -= 1
    return order


@pytest.mark.parametrize("jobs", [
    {"plan": (1, 3), "baseline": (1, 3), "hf": (1, 3)},
    {"plan": (2, 4), "baseline": (2, 2), "hf": (1, 5)},  # jobs finish at different steps
])
def test_steps_run_round_robin_and_never_overlap(tmp_path, jobs):
    log = run_jobs(tmp_path, jobs)
    # Every rank of a job begins a step after every rank of the previous turn ended it, and the job's
    # ranks all end it before the next turn begins: the log is one block per turn.
    blocks: list[tuple[str, int]] = []
    open_ranks: dict[tuple[str, int], set[int]] = {}
    for name, rank, step, what in log:
        key = (name, step)
        if what == "begin":
            if not blocks or blocks[-1] != key:
                assert not any(open_ranks.values()), f"{key} began while {open_ranks} still ran"
                blocks.append(key)
            open_ranks.setdefault(key, set()).add(rank)
        else:
            assert blocks[-1] == key
            open_ranks[key].discard(rank)
    assert blocks == expected_order(jobs)
    for name, (ranks, steps) in jobs.items():  # every rank took every step
        assert sum(1 for n, _, _, w in log if n == name and w == "end") == ranks * steps


def test_first_turn_waits_until_every_job_is_ready(tmp_path):
    shared = TurnDir(tmp_path / "turns")
    shared.create(["a", "b"])
    Turns(shared.dir / "a")  # joins, but has not called wait(): not ready
    starter = threading.Thread(target=shared.start_when_ready, kwargs={"timeout_s": 20})
    starter.start()
    time.sleep(0.2)
    assert shared.holder() is None  # b is not ready either
    b = Turns(shared.dir / "b", timeout_s=0.2)
    with pytest.raises(UserError, match="waited"):  # b announces itself ready, then times out: a is not
        b.wait()
    assert shared.holder() is None
    a = Turns(shared.dir / "a", timeout_s=20)
    a.wait()  # both ready now: the starter gives the first turn to a
    starter.join(5)
    assert shared.holder() == "a"


def test_a_dead_job_stops_the_start_and_waiting_names_the_holder(tmp_path):
    shared = TurnDir(tmp_path / "turns")
    shared.create(["a", "b"])
    assert shared.start_when_ready(alive=lambda: False) is False
    shared.pass_turn("b")  # a holds the turn now
    with pytest.raises(UserError, match="held by 'a'"):
        Turns(shared.dir / "b", timeout_s=0.05).wait()
    with pytest.raises(UserError, match="no job named 'c'"):
        Turns(shared.dir / "c")
