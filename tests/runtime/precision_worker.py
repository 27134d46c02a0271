"""One bf16 training step of the tiny model in a world of one, recording the dtypes of (query, key,
value) at the packed-attention kernel and the bytes the LLM layers keep for backward.

Usage: python precision_worker.py spec.json (or one rank of `run_ranks`) (keys: config, plan, shapes, out_dir, report).
"""

from __future__ import annotations

import json
import sys

from dflop.config import Config
from dflop.models import packing
from dflop.runtime.run import train


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    seen: list[list[str]] = []
    sdpa = packing._KERNELS["sdpa"]

    def spy(query, key, value, *args):
        seen.append([str(t.dtype) for t in (query, key, value)])
        return sdpa(query, key, value, *args)

    packing._KERNELS["sdpa"] = spy
    train(Config.from_dict(spec["config"]), plan_path=spec["plan"], shapes_path=spec["shapes"], costmodel_path=None,
          out_dir=spec["out_dir"], steps=1, export=False, progress=False)
    with open(spec["report"], "w") as f:
        json.dump({"dtypes": seen}, f)


if __name__ == "__main__":
    main(sys.argv[1])
