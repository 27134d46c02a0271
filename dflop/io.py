"""Atomic file output: write to a temp file beside the target, then rename.

A killed stage leaves either the old file or none, never half of one, so re-running it is safe
and Snakemake never mistakes a partial output for a finished one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path in the target's directory; on success rename it over `target`.

    On an exception the temp file is removed and `target` is left untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if tmp.exists():
            # mkstemp makes the file private (0600); give it the permissions a plain open() would.
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(target: str | os.PathLike, text: str) -> None:
    """Write `text` to `target` atomically."""
    with atomic_path(target) as tmp:
        tmp.write_text(text)


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move the finished directory `tmp` to `final`, replacing any old `final`.

    The old one is renamed aside first and removed only after the new one is in place, so a kill
    at any point leaves a complete directory at `final` or at `final`.old, never a mix.
    """
    tmp, final = Path(tmp), Path(final)
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
