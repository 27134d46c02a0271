"""Progress of a long stage: a tqdm bar on a terminal, plain lines in a log file.

Snakemake sends every rule's stderr to `logs/<rule>.log`; a tqdm bar there is one line of
carriage returns and ANSI codes per refresh. `progress()` returns a tqdm bar only when the stream
is a terminal, and otherwise a `PlainProgress` that writes a whole line at every `every` fraction
of the total (and at the end), or every `interval_s` seconds when the total is unknown.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import IO, Iterator


def progress(total: int | None, desc: str, unit: str, *, enabled: bool = True, initial: int = 0,
             file: IO[str] | None = None, leave: bool = True, every: float = 0.1, interval_s: float = 60.0,
             plain: bool = True):
    """A progress counter with tqdm's `update(n)` / `close()` (also a context manager).

    plain=False: no lines at all off a terminal (for a loop that logs a line per update anyway).
    """
    file = sys.stderr if file is None else file
    if enabled and _is_terminal(file):
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=file, leave=leave, mininterval=1.0)
    return PlainProgress(total, desc, unit, enabled=enabled and plain, initial=initial, file=file, every=every,
                         interval_s=interval_s)


def _is_terminal(file) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class PlainProgress:
    """Whole lines such as ``profile_data: 150/300 sample (50%) 12.3 s``; nothing when disabled."""

    def __init__(self, total: int | None, desc: str, unit: str, *, enabled: bool = True, initial: int = 0,
                 file: IO[str] | None = None, every: float = 0.1, interval_s: float = 60.0):
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.n = initial
        self.file = sys.stderr if file is None else file
        self.every, self.interval_s = every, interval_s
        self._started = self._last_time = time.monotonic()
        self._last_n = initial
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.total:
            step = max(1, round(self.every * self.total))
            if self.n // step > self._last_n // step or (self.n >= self.total > self._last_n):
                self._write(now)
        elif now - self._last_time >= self.interval_s:
            self._write(now)

    def close(self) -> None:
        if self.enabled and not self._closed and self.n != self._last_n:
            self._write(time.monotonic())
        self._closed = True

    def _write(self, now: float) -> None:
        done = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        print(f"{self.desc}: {done} {self.unit}{share} {now - self._started:.1f} s", file=self.file, flush=True)
        self._last_n, self._last_time = self.n, now

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def library_bars_off_in_logs(file: IO[str] | None = None) -> Iterator[None]:
    """transformers' own tqdm bars (e.g. "Writing model shards" in `save_pretrained`) switched off
    while inside, unless `file` (stderr) is a terminal."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if was_on and not _is_terminal(sys.stderr if file is None else file):
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            hf_logging.enable_progress_bar()
    else:
        yield
