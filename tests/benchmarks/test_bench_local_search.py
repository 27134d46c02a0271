"""benchmarks/bench_local_search.py: the with/without comparison restores the real search and
measures what it claims."""

import importlib.util
from pathlib import Path

import numpy as np

from dflop.scheduler import partition as partition_function
from dflop.scheduler.greedy import local_search

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_local_search.py"


def test_with_and_without_local_search_on_the_benchmark_batches():
    spec = importlib.util.spec_from_file_location("bench_local_search", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    raw = bench.run(((64, 4, 4), (16, 2, 8)), batches=2, seed=0)
    assert bench.portfolio_module.local_search is local_search       # the identity is swapped back
    assert partition_function is bench.partition_module.partition
    assert (raw.proxy_gain >= 1 - 1e-12).all()                       # the search never raises its proxy
    one_per_bin = raw[raw.n == raw.m * raw.dp]
    assert len(one_per_bin) and np.allclose(one_per_bin[["proxy_gain", "greedy_gain", "dflop_gain"]], 1.0)
    summary = bench.summarise(raw)
    assert summary.items_per_bin.tolist() == [4.0, 1.0]
