"""The tests' one way to start gloo workers: `run_ranks(worker, *args, nproc=N)` runs a worker script
on N ranks with the environment torchrun gives its workers (RANK, WORLD_SIZE, MASTER_ADDR, ...), keeps
each rank's own output, and fails the test with every rank's stdout and stderr (not the tail of one
summary, where one rank's message is lost among the others').

The ranks are forked from one fork server per test session that has imported torch, transformers'
model classes and dflop's runtime (`PRELOAD`): a fresh interpreter per rank, as torchrun
starts, spends several CPU-seconds importing them, which made process start-up the largest part of
the suite's time on a 2-core machine. What torchrun itself does (rendezvous, agents per node) is
covered by the tests that launch `dflop train`, which starts real torchrun, and by the workflow and
Slurm end-to-end tests."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

from dflop.run_as_main import run_as_main

TAIL = 4000  # characters of each rank's stdout and stderr in a failure's message
# What every gloo worker imports, imported once by the fork server (names, not paths: Python 3.11's
# fork server ignores the parent's sys.path, so these must be importable from the environment).
# Imports, and the Qwen2.5 tokenizer every trainer rank loads (`fork_preload`, found in this folder:
# `_start_fork_server`): the fork server runs no torch operation, so it starts no thread pool a
# forked rank could inherit in a broken state.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
           "transformers.models.internvl.modeling_internvl", "transformers.models.llama.modeling_llama",
           "transformers.models.llava_onevision.modeling_llava_onevision",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.siglip.modeling_siglip",
           "dflop.models.builder", "dflop.runtime.run", "fork_preload"]
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(PRELOAD)


def _start_fork_server() -> None:
    """Start the fork server (once per process) with this folder on its PYTHONPATH, for its preload
    `fork_preload`; this process's environment, which the ranks get, stays as it was."""
    from multiprocessing import forkserver

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *([old] if old else [])])
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(script: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """One rank: its stdout and stderr to files, torchrun's environment, then `script` as __main__
    (``-m module`` runs the module, as ``python -m module`` would)."""
    for fd, path in ((1, out), (2, err)):
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, fd)
        os.close(log)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    module = script.removeprefix("-m ") if script.startswith("-m ") else None
    code = run_as_main(["-m", module, *argv] if module else [script, *argv], cwd)
    os._exit(code)  # no interpreter teardown racing gloo's threads (dflop.runtime.process_group.end_worker)


def _rank_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several workers per node
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc), ROLE_NAME="default",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=run_id,
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", PYTHONUNBUFFERED="1")
    return env


def failure_report(ranks: dict[int, tuple[str, str]], codes: dict[int, int | None], why: str) -> str:
    parts = [f"the {len(ranks)} ranks {why}; exit codes by rank: {codes}"]
    for rank, (out, err) in ranks.items():
        parts.append(f"----- rank {rank} stdout (tail) -----\n{out[-TAIL:]}\n"
                     f"----- rank {rank} stderr (tail) -----\n{err[-TAIL:]}")
    return "\n".join(parts)


class RanksResult:
    """What the ranks wrote: stdout and stderr are every rank's, in rank order (a rank's lines
    together, so a line a test looks for is whole); `returncode` is that of a rank that failed on
    its own (not of one ended because another failed), else 0."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_ranks(worker: str | Path, *args: object, nproc: int = 2, timeout: float = 600,
             check: bool = True) -> RanksResult:
    """Run `worker args...` on `nproc` gloo ranks as torchrun would (see the module's docstring);
    `worker` is a script's path or ``"-m package.module"``.

    As torchrun does, the first rank to fail ends the others. With `check` (the default) a failed
    rank or the timeout fails with every rank's output; on the timeout every rank is killed, none
    is left behind."""
    _start_fork_server()
    port, run_id = _free_port(), uuid.uuid4().hex[:12]
    with tempfile.TemporaryDirectory(prefix="ranks-logs-") as logs:
        paths = [(Path(logs) / f"{rank}.out", Path(logs) / f"{rank}.err") for rank in range(nproc)]
        procs = [_FORKSERVER.Process(target=_run_rank, daemon=False,
                                     args=(str(worker), [str(a) for a in args], _rank_env(rank, nproc, port, run_id),
                                           os.getcwd(), str(out), str(err)))
                 for rank, (out, err) in enumerate(paths)]
        for proc in procs:
            proc.start()
        deadline, timed_out, failed = time.monotonic() + timeout, False, []
        while any(p.is_alive() for p in procs):
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                break  # a rank failed: end the others, as torchrun does
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join()
        ranks = {rank: (out.read_text(errors="replace"), err.read_text(errors="replace"))
                 for rank, (out, err) in enumerate(paths)}
    codes = {rank: proc.exitcode for rank, proc in enumerate(procs)}
    failed = failed or [code for code in codes.values() if code != 0]  # the ranks that failed before any was ended
    result = RanksResult(failed[0] if failed else 0, "".join(out for out, _ in ranks.values()),
                         "".join(err for _, err in ranks.values()))
    if timed_out:
        raise AssertionError(failure_report(ranks, codes, f"did not finish in {timeout} s"))
    if check and result.returncode != 0:
        raise AssertionError(failure_report(ranks, codes, f"failed (exit {result.returncode})"))
    return result
