"""`dflop.run_as_main` runs a command line as ``python`` would: the interpreter itself is the
reference (exit code, stdout, the last line of stderr), for -c, -m and a script."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """import sys
print(sys.argv, sys.path[0] == {where!r})
if sys.argv[-1] == "exit3":
    sys.exit(3)
if sys.argv[-1] == "message":
    sys.exit("stopped: a message")
if sys.argv[-1] == "raise":
    raise ValueError("boom")
"""


def _both(args: list[str], cwd) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    wrapped = ("import sys; from dflop.run_as_main import run_as_main; "
               f"sys.exit(run_as_main({args!r}, {str(cwd)!r}))")
    runs = [subprocess.run([sys.executable, *command], cwd=cwd, capture_output=True, text=True, timeout=60)
            for command in (args, ["-c", wrapped])]
    return runs[0], runs[1]


@pytest.mark.parametrize("last", ["ok", "exit3", "message", "raise"])
@pytest.mark.parametrize("form", ["-c", "-m", "script"])
def test_a_command_line_runs_as_the_interpreter_runs_it(form, last, tmp_path):
    where = {"-c": "", "-m": str(tmp_path), "script": str(tmp_path / "pkg")}[form]
    (tmp_path / "pkg").mkdir()
    code = SCRIPT.format(where=where)
    (tmp_path / "mod_under_test.py").write_text(code)
    (tmp_path / "pkg" / "script.py").write_text(code)
    args = {"-c": ["-c", code], "-m": ["-m", "mod_under_test"], "script": [str(tmp_path / "pkg" / "script.py")]}[form]
    python, ours = _both([*args, "a b", last], tmp_path)
    assert ours.returncode == python.returncode
    assert ours.stdout == python.stdout and "True" in python.stdout  # sys.argv and sys.path[0] as python sets them
    assert ours.stderr.strip().splitlines()[-1:] == python.stderr.strip().splitlines()[-1:]
