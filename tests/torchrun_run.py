"""The tests' one way to start gloo workers under torchrun: each rank's own output is kept, and a
failed run fails the test with every rank's stdout and stderr (not the tail of torchrun's summary,
where one rank's message is lost among the others' and the launcher's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TAIL = 4000  # characters of each rank's stdout and stderr in a failure's message


def _rank_logs(log_dir: Path) -> dict[int, tuple[str, str]]:
    """rank -> (stdout, stderr) from torchrun's --log-dir (<run>/attempt_<n>/<local rank>/), last attempt."""
    found: dict[int, tuple[str, str]] = {}
    for out in sorted(log_dir.glob("*/attempt_*/*/stdout.log")):
        err = out.with_name("stderr.log")
        found[int(out.parent.name)] = (out.read_text(errors="replace"),
                                       err.read_text(errors="replace") if err.exists() else "")
    return dict(sorted(found.items()))


def failure_report(proc: subprocess.CompletedProcess, ranks: dict[int, tuple[str, str]], why: str) -> str:
    parts = [f"torchrun {why}; torchrun's own stderr (tail):\n{proc.stderr[-2000:]}"]
    if not ranks:
        parts.append("(no rank wrote a log: the workers did not start)")
    for rank, (out, err) in ranks.items():
        parts.append(f"----- rank {rank} stdout (tail) -----\n{out[-TAIL:]}\n"
                     f"----- rank {rank} stderr (tail) -----\n{err[-TAIL:]}")
    return "\n".join(parts)


def torchrun(worker: str | Path, *args: object, nproc: int = 2, timeout: float = 600,
             check: bool = True) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc-per-node nproc worker args...`.

    stdout and stderr of the result: torchrun's own, then each rank's in rank order (each rank's
    lines together, so a line a test looks for is whole). With `check` (the default) a non-zero exit
    or the timeout fails with every rank's output; on the timeout the whole process group of
    torchrun and its workers is killed, none is left behind."""
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--log-dir", logs, "--redirects", "3", str(worker), *map(str, args)]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as popen:
            try:
                stdout, stderr = popen.communicate(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                stdout, stderr = popen.communicate()
                timed_out = True
        ranks = _rank_logs(Path(logs))
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout + "".join(out for out, _ in ranks.values()),
                                       stderr + "".join(err for _, err in ranks.values()))
    if timed_out:
        raise AssertionError(failure_report(proc, ranks, f"did not finish in {timeout} s"))
    if check and proc.returncode != 0:
        raise AssertionError(failure_report(proc, ranks, f"failed (exit {proc.returncode})"))
    return proc
