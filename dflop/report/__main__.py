"""``python -m dflop.report GROUP ...``: the same as ``dflop report GROUP ...``."""

import sys

from dflop.cli import main

if __name__ == "__main__":
    sys.exit(main(["report", *sys.argv[1:]]))
