"""A per-user cache of derived files that are slow to rebuild and cheap to read (JSON only).

Every process that tokenizes (each trainer rank, each data-profiling job) would otherwise redo the
same seconds of work at start-up. A cached file is named by a hash of everything its content
depends on, so a new input or library version writes a new file and never reads a stale one.
The cache only saves time: a directory that cannot be written, or an entry that cannot be read,
means the caller rebuilds, never an error.

Location: ``$DFLOP_CACHE_DIR``, else ``$XDG_CACHE_HOME/dflop``, else ``~/.cache/dflop``.
``DFLOP_CACHE_DIR=off`` turns the cache off.

The cache keeps itself small: each write removes, in its kind's folder, the entries no process has
read for `UNUSED_DAYS` (a read marks an entry used by its mtime, at most once a day; a read that
cannot mark it, on a read-only cache, does not count) and the temp files that killed writers
left behind. Only names the cache writes are removed. An entry is not removed because a newer key
exists beside it: two environments (another transformers version, the GPU image's virtualenv)
share one cache and each keeps reading its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from dflop.io import atomic_path, temp_name_pattern

CACHE_DIR_ENV = "DFLOP_CACHE_DIR"
UNUSED_DAYS = 30  # an entry no process has read for this long is removed at the next write
_DAY_S = 86400.0
_ABANDONED_TMP_S = 3600.0  # a writer finishes in seconds: an older temp file's writer was killed
_DIGEST_HEX = 20
# What `cache_entry` names an entry, and `atomic_path` its temp file while it is written: nothing
# else in a kind's folder is pruned.
_ENTRY_PATTERN = rf"[^./][^/]*-[0-9a-f]{{{_DIGEST_HEX}}}\.json"
_ENTRY_NAME = re.compile(_ENTRY_PATTERN)
_TEMP_NAME = re.compile(temp_name_pattern(_ENTRY_PATTERN))


def cache_dir() -> Path | None:
    """The cache's root directory, or None when ``DFLOP_CACHE_DIR=off`` or no home is known."""
    configured = os.environ.get(CACHE_DIR_ENV)
    try:
        if configured is not None and configured.strip():
            return None if configured.strip().lower() == "off" else Path(configured).expanduser()
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    except RuntimeError:  # no HOME and no passwd entry (some containers): no cache
        return None
    return base / "dflop"


def cache_entry(kind: str, stem: str, depends_on: Any) -> Path | None:
    """The path of the cached ``<kind>/<stem>-<hash>.json`` whose content `depends_on` determines.

    depends_on: JSON-serialisable; every input, library version and piece of code that changes
    the content. None when the cache is off.
    """
    root = cache_dir()
    if root is None:
        return None
    digest = hashlib.sha256(json.dumps(depends_on, sort_keys=True).encode()).hexdigest()[:_DIGEST_HEX]
    return root / kind / f"{stem}-{digest}.json"


def cached_file(entry: Path | None) -> Path | None:
    """`entry` if it is a file that can be read, else None (a miss, whatever the reason). A hit
    marks the entry used (its mtime, at most once a day), so that `store` keeps it."""
    try:
        if entry is None or not entry.is_file() or not os.access(entry, os.R_OK):
            return None
        age = time.time() - entry.stat().st_mtime
    except OSError:  # e.g. a parent directory this user may not search, or pruned just now
        return None
    if age > _DAY_S:
        try:
            os.utime(entry)
        except OSError:  # a read-only cache is still read
            pass
    return entry


def store(entry: Path | None, text: str) -> None:
    """Write `text` (UTF-8) to the cache entry atomically, so concurrent writers are safe; skip it
    where it cannot be written (read-only or full file system, a file where a directory should be)."""
    if entry is None:
        return
    try:
        with atomic_path(entry) as tmp:
            tmp.write_bytes(text.encode("utf-8"))
    except OSError:
        return  # the caller already has what it built
    prune(entry.parent)


def prune(folder: Path) -> list[Path]:
    """Remove from one kind's folder the entries unused for `UNUSED_DAYS` and abandoned temp files
    (see the module docstring); return what was removed. Files that cannot be removed stay."""
    now = time.time()
    removed = []
    try:
        files = [p for p in folder.iterdir() if p.is_file()]
    except OSError:
        return removed
    for path in files:
        try:
            age = now - path.stat().st_mtime
            abandoned_tmp = _TEMP_NAME.fullmatch(path.name) is not None and age > _ABANDONED_TMP_S
            # A read refreshes the mtime only once it is a day old: unread for UNUSED_DAYS is one more.
            unused = _ENTRY_NAME.fullmatch(path.name) is not None and age > (UNUSED_DAYS + 1) * _DAY_S
            if abandoned_tmp or unused:
                path.unlink()
                removed.append(path)
        except OSError:  # gone already (another process pruned it) or not ours to remove
            pass
    return removed
