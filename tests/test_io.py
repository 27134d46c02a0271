"""Atomic outputs: a failed write leaves the old file; a replaced directory is never half old, half new."""

import os

import pytest

from dflop.errors import UserError
from dflop.io import atomic_path, read_yaml, replace_dir, write_text_atomic


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "out.parquet"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet"]


def test_written_file_has_umask_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "sub" / "plan.yaml", "x: 1\n")
    finally:
        os.umask(mask)
    path = tmp_path / "sub" / "plan.yaml"
    assert path.read_text() == "x: 1\n" and (path.stat().st_mode & 0o777) == 0o644


def test_replace_dir_swaps_whole_directories(tmp_path):
    final, tmp = tmp_path / "final", tmp_path / "final.tmp"
    tmp.mkdir()
    (tmp / "a").write_text("1")
    replace_dir(tmp, final)
    assert [p.name for p in final.iterdir()] == ["a"] and not tmp.exists()

    tmp.mkdir()
    (tmp / "b").write_text("2")
    replace_dir(tmp, final)
    assert [p.name for p in final.iterdir()] == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


@pytest.mark.parametrize("content,message", [
    (b"a: [1, 2\n", r"bad\.yaml:\d+: not valid YAML"),
    (b"a: 1\x00\n", r"bad\.yaml: not valid YAML \(.*\)$"),
    (b"a: \xff\xfe\n", r"bad\.yaml: not UTF-8 text"),
])
def test_bad_yaml_is_one_line_naming_the_file(tmp_path, content, message):
    (tmp_path / "bad.yaml").write_bytes(content)
    with pytest.raises(UserError, match=message) as err:
        read_yaml(tmp_path / "bad.yaml", missing_hint="x")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=r"nope\.yaml: no such file \(run it first\)"):
        read_yaml(tmp_path / "nope.yaml", missing_hint="run it first")
    with pytest.raises(UserError, match="cannot be read"):
        read_yaml(tmp_path, missing_hint="x")  # a directory


def test_temp_name_pattern_matches_what_atomic_path_writes(tmp_path, monkeypatch):
    """dflop/cache.py prunes killed writers' temp files by this pattern: it must name the temp file
    atomic_path really makes, and no other file."""
    import re

    from dflop.io import temp_name_pattern

    seen = []
    target = tmp_path / "entry-0123.json"
    with atomic_path(target) as tmp:
        seen.append(tmp.name)
    pattern = re.compile(temp_name_pattern(r"entry-\d+\.json"))
    assert pattern.fullmatch(seen[0])
    assert not pattern.fullmatch("entry-0123.json") and not pattern.fullmatch(".other-0123.json.abc.tmp")
