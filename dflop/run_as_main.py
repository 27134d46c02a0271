"""Run a ``python`` command line (``-c code``, ``-m module`` or a script, with its arguments) inside
this process, as the interpreter would, and give its exit code.

For processes forked from a fork server that has imported torch and transformers already (the test
suite's gloo ranks, `benchmarks/gpu/validate.py --cpu`'s parts): they skip a fresh interpreter's
seconds of imports but must behave as one would.
"""

from __future__ import annotations

import runpy
import sys
import traceback
from pathlib import Path


def run_as_main(args: list[str], cwd: str) -> int:
    """`args` as they follow ``python``: ``["-c", code, *argv]``, ``["-m", module, *argv]`` or
    ``[script, *argv]``, with sys.argv and sys.path[0] set as the interpreter sets them (`cwd` for
    ``-m``). The exit code: SystemExit's (a message, printed to stderr, counts as 1), 1 after an
    uncaught exception (its traceback on stderr), else 0. Flushes stdout and stderr."""
    try:
        if args[0] == "-c":
            sys.argv, sys.path[:0] = ["-c", *args[2:]], [""]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        elif args[0] == "-m":
            sys.argv, sys.path[:0] = [args[1], *args[2:]], [cwd]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[:0] = list(args), [str(Path(args[0]).parent)]
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code
