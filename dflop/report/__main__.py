"""``python -m dflop.report GROUP ...``: write the report plots of one artifact group (see `dflop.report.command`)."""

from __future__ import annotations

import argparse
import sys

from dflop.errors import UserError
from dflop.report.command import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflop.report", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        for path in run(args):
            print(f"wrote {path}")
    except (UserError, FileNotFoundError) as exc:
        print(f"dflop report {args.group}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
