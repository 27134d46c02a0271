"""Training jobs on one machine taking their steps in turn (A B C A B C ...), so that speed phases of
the machine (a shared VM's neighbours, thermal or clock changes) hit every job alike.

Why: two trainers compared one after the other can differ by the machine's phase alone (on the
2-core VM the same run varied by 10 % between minutes). Run side by side with turns, each job's
step k runs between the other jobs' steps k, and a job never computes while another does.

The jobs share a directory (`TurnDir`): ``order.json`` (the job names, in turn order, written by
whoever starts the jobs), one ``ready-NAME`` file per job once it has started up, ``turn`` (the
name whose step may run now), and ``finished-NAME`` once a job has taken its last step. The
starter hands out the first turn once every job is ready (`TurnDir.start_when_ready`), so no job's
start-up (imports, model build) overlaps another's steps. Inside a job (`Turns`) every rank waits
for the job's turn before a step, and after it the job's ranks meet at a barrier (the step is
over on every rank) and rank 0 passes the turn on; the ranks meet again once the turn is theirs, so
they start the step together. Files are replaced atomically; waiting polls
every millisecond and sleeps in between.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Sequence

from dflop.errors import UserError
from dflop.io import write_text_atomic

POLL_S = 0.001
DEFAULT_TIMEOUT_S = 1800.0  # one step of one job, plus the others' steps, never takes this long


class TurnDir:
    """The shared directory of a set of jobs taking turns (module docstring)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)

    def create(self, names: Sequence[str]) -> None:
        """A fresh directory for `names` (turn order): any state of an earlier run is removed."""
        if len(set(names)) != len(names) or not names:
            raise UserError(f"{self.dir}: turn order needs distinct job names, got {list(names)}")
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in [*self.dir.glob("ready-*"), *self.dir.glob("finished-*"), self.dir / "turn"]:
            old.unlink(missing_ok=True)
        write_text_atomic(self.dir / "order.json", json.dumps(list(names)))

    def order(self) -> list[str]:
        path = self.dir / "order.json"
        if not path.exists():
            raise UserError(f"{path}: missing (the jobs' turn order, written before they start)")
        return json.loads(path.read_text())

    def holder(self) -> str | None:
        try:
            return (self.dir / "turn").read_text().strip() or None
        except FileNotFoundError:
            return None

    def finished(self, name: str) -> bool:
        return (self.dir / f"finished-{name}").exists()

    def ready(self, name: str) -> bool:
        return (self.dir / f"ready-{name}").exists()

    def pass_turn(self, name: str) -> None:
        """Give the turn to the first unfinished job after `name` in turn order (`name` itself when
        it is the only one left; nobody when every job has finished)."""
        order = self.order()
        start = order.index(name)
        for offset in range(1, len(order) + 1):
            nxt = order[(start + offset) % len(order)]
            if not self.finished(nxt):
                write_text_atomic(self.dir / "turn", nxt + "\n")
                return
        write_text_atomic(self.dir / "turn", "\n")

    def start_when_ready(self, alive: Callable[[], bool] = lambda: True, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
        """Wait until every job is ready, then give the first job the turn. Returns False without
        starting when `alive()` turns False first (a job died during start-up)."""
        order = self.order()
        deadline = time.monotonic() + timeout_s
        while not all(self.ready(n) for n in order):
            if not alive():
                return False
            if time.monotonic() > deadline:
                missing = [n for n in order if not self.ready(n)]
                raise UserError(f"{self.dir}: job(s) {', '.join(missing)} not ready after {timeout_s:.0f} s")
            time.sleep(0.05)
        write_text_atomic(self.dir / "turn", order[0] + "\n")
        return True


class Turns:
    """One job's side: `wait()` before each step, `done()` after it (`done(last=True)` after the last).

    path: the shared directory and this job's name as one path (``DIR/NAME``). barrier: called on
    every rank before rank 0 passes the turn (the job's ranks have all finished the step); None for
    a single process."""

    def __init__(self, path: str | Path, *, rank: int = 0, barrier: Callable[[], None] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        path = Path(path)
        self.shared, self.name = TurnDir(path.parent), path.name
        if self.name not in self.shared.order():
            raise UserError(f"{self.shared.dir / 'order.json'}: no job named {self.name!r}")
        self.rank, self.barrier, self.timeout_s = rank, barrier, timeout_s
        self._announced = False

    def wait(self) -> None:
        """Block until this job holds the turn (the first call also says this job is ready)."""
        if not self._announced:  # every rank has started up: the job is ready
            self._sync()
            if self.rank == 0:
                write_text_atomic(self.shared.dir / f"ready-{self.name}", "")
            self._announced = True
        began = time.monotonic()
        while self.shared.holder() != self.name:
            if time.monotonic() - began > self.timeout_s:
                raise UserError(f"{self.shared.dir}: job {self.name!r} waited {self.timeout_s:.0f} s for its turn "
                                f"(held by {self.shared.holder()!r}: see that job's log)")
            time.sleep(POLL_S)
        self._sync()  # the ranks start the step together, not as each one happens to wake up

    def _sync(self) -> None:
        if self.barrier is not None:
            self.barrier()

    def done(self, last: bool = False) -> None:
        """This job's step is over on every rank: pass the turn on (`last`: it was the job's last
        step, so it also leaves the turn order)."""
        self._sync()
        if self.rank == 0:
            if last:
                write_text_atomic(self.shared.dir / f"finished-{self.name}", "")
            self.shared.pass_turn(self.name)


class NoTurns:
    """A job that takes no turns: every call returns at once."""

    def wait(self) -> None:
        pass

    def done(self, last: bool = False) -> None:
        pass
