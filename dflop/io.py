"""Artifact files: atomic output (a temp file beside the target, then rename) and checked input.

A killed stage leaves either the old file or none, never half of one, so re-running it is safe
and Snakemake never mistakes a partial output for a finished one. A missing or unreadable input
is one UserError line naming the file (and the YAML line), with a hint at the stage that makes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from dflop.errors import UserError


def temp_name_pattern(target_pattern: str) -> str:
    """A regex of the names `atomic_path` gives its temp files for targets whose names match
    `target_pattern` (what a killed writer leaves behind: ".<target>.<random>.tmp")."""
    return rf"\.(?:{target_pattern})\.\w+\.tmp"


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


def read_yaml(path: str | os.PathLike, *, missing_hint: str) -> Any:
    """The parsed YAML document at `path`; one-line UserError for a missing file or a syntax error.

    missing_hint: what to do about a missing file, e.g. "run `dflop optimize` first".
    """
    import yaml

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file ({missing_hint})")
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        detail = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{path}{where}: not valid YAML ({detail})") from None


def read_parquet(path: str | os.PathLike, *, missing_hint: str):
    """The table at `path` as a pandas DataFrame; one-line UserError for a missing or corrupt file."""
    import pandas as pd

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file ({missing_hint})")
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{path}: not a readable Parquet file ({first})") from None
