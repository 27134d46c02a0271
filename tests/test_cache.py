"""The per-user cache (dflop/cache.py) stays small without ever removing what is in use: entries
no process read for UNUSED_DAYS and temp files of killed writers go at the next write; entries in
use, other keys of the same stem (another environment's), a live writer's temp file, and files the
cache did not write (DFLOP_CACHE_DIR may point at a folder of the user's) stay."""

from __future__ import annotations

import os
import time

from dflop import cache
from dflop.cache import UNUSED_DAYS, cache_entry, cached_file, prune, store

DAY = 86400


def _age(path, days):
    stamp = time.time() - days * DAY
    os.utime(path, (stamp, stamp))


def _write(path, text="{}"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_write_removes_unused_entries_and_abandoned_temp_files_only(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLOP_CACHE_DIR", str(tmp_path))
    kind = tmp_path / "tokenizers"
    unused = _write(kind / "qwen2.5-aaaaaaaaaaaaaaaaaaaa.json")
    _age(unused, UNUSED_DAYS + 1.5)
    # Another environment's key, read 30 days ago: a read refreshes the mtime only once it is a day
    # old, so its mtime may be up to a day older than that read.
    recent = _write(kind / "qwen2.5-bbbbbbbbbbbbbbbbbbbb.json")
    _age(recent, UNUSED_DAYS + 0.5)
    abandoned = _write(kind / ".qwen2.5-cccccccccccccccccccc.json.x1y2.tmp")
    _age(abandoned, 2 / 24)  # two hours: its writer was killed
    live = _write(kind / ".qwen2.5-dddddddddddddddddddd.json.z3w4.tmp")  # being written now
    other_kind = _write(tmp_path / "models" / "old-eeeeeeeeeeeeeeeeeeee.json")
    _age(other_kind, UNUSED_DAYS + 2)
    users_own = [_write(kind / name) for name in ("tokenizer.json", "x.tmp", ".x.tmp", "notes-0123.json")]
    for path in users_own:
        _age(path, UNUSED_DAYS + 2)

    entry = cache_entry("tokenizers", "qwen2.5", {"version": 2})
    store(entry, '{"new": true}')

    assert entry.read_text() == '{"new": true}'
    assert not unused.exists() and not abandoned.exists()
    assert recent.exists() and live.exists()
    assert other_kind.exists()  # a write prunes its own kind's folder only
    assert all(path.exists() for path in users_own)


def test_reading_an_entry_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLOP_CACHE_DIR", str(tmp_path))
    old = cache_entry("tokenizers", "qwen2.5", {"version": 1})
    store(old, "{}")
    _age(old, UNUSED_DAYS + 5)  # written long ago ...
    assert cached_file(old) == old  # ... and read today
    store(cache_entry("tokenizers", "qwen2.5", {"version": 2}), "{}")
    assert old.exists()
    # Unread for the whole period (and the day a read may leave unmarked), it goes at the next write.
    _age(old, UNUSED_DAYS + 1.01)
    assert prune(old.parent) == [old]


def test_a_read_marks_an_entry_used_at_most_once_a_day(tmp_path, monkeypatch):
    """Each trainer rank reads the entry: no metadata write per process start on a shared home."""
    entry = _write(tmp_path / "tokenizers" / "qwen2.5-ffffffffffffffffffff.json")
    _age(entry, 0.5)
    before = entry.stat().st_mtime
    calls = []
    monkeypatch.setattr(cache.os, "utime", lambda *a, **k: calls.append(a))
    assert cached_file(entry) == entry
    assert calls == [] and entry.stat().st_mtime == before


def test_files_that_cannot_be_removed_or_read_do_not_fail_the_caller(tmp_path, monkeypatch):
    kind = tmp_path / "tokenizers"
    unused = _write(kind / "qwen2.5-aaaaaaaaaaaaaaaaaaaa.json")
    _age(unused, UNUSED_DAYS + 2)

    def refuse(self, missing_ok=False):
        raise PermissionError(f"cannot remove {self}")

    monkeypatch.setattr(type(unused), "unlink", refuse)
    assert prune(kind) == []
    assert prune(tmp_path / "no such folder") == []
    monkeypatch.setattr(cache.os, "utime", lambda *a, **k: (_ for _ in ()).throw(PermissionError("read-only")))
    assert cached_file(unused) == unused
