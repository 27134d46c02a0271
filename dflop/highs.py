"""HiGHS without its copyright banner in the stages' logs.

highspy 1.16 prints "Running HiGHS ... Copyright ..." to file descriptor 1 when a process builds
its first `Highs` object, before any option (`output_flag`) can be set. `silence_banner()` builds
that first object with descriptor 1 on /dev/null; later ones print nothing. Every solve site (the
planner's layer-split MILP, the scheduler's ILPs) builds its models with `quiet_highs`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import highspy


@functools.cache
def silence_banner() -> None:
    """Let the process's first `Highs` print its banner into /dev/null (once per process)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
        highspy.Highs()
        ctypes.CDLL(None).fflush(None)  # a buffered C stdout would write the banner after the restore
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def quiet_highs() -> highspy.Highs:
    """A `highspy.Highs` that prints nothing (no banner, `output_flag` off)."""
    silence_banner()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h
