"""Tensor-parallel shards (TP=2, gloo, launched with torchrun) compute what the full modules compute."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("tp_equivalence_worker.py")


@pytest.mark.distributed
def test_tp2_shards_match_full_modules_under_torchrun():
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)],
        capture_output=True, text=True, timeout=300,
    )
    mismatches = [line for line in result.stderr.splitlines() if line.startswith("rank ")]
    assert result.returncode == 0, "\n".join(mismatches) or result.stderr[-3000:]
