"""``python -m dflop.report GROUP ...``: the same as ``dflop report GROUP ...`` (without importing
the `dflop` command, which sits above the report layer)."""

import argparse
import logging
import sys

from dflop.errors import UserError
from dflop.report.command import add_arguments, run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflop.report", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # as the dflop command
    try:
        for path in run(args):
            print(f"wrote {path}")
    except (UserError, FileNotFoundError) as exc:
        print(f"dflop report: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
