"""benchmarks/bench_hf_trainer.py, smallest run: HF's batch_rebalance and DFLOP's sampler (padded,
packed) train 2 steps each in one HF Trainer run on 2 gloo ranks; the two DFLOP variants, which train
the same global batches, agree on every step's loss, and every variant trained the whole batches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hf_trainer.py"


@pytest.mark.distributed
def test_smallest_run_trains_every_variant_and_the_dflop_losses_agree(tmp_path):
    variants = ["hf_batch_rebalance", "dflop_padded", "dflop_packed"]
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--steps", "2", "--variants", ",".join(variants),
                             "--work", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_hf_trainer.json").read_text())
    assert list(doc["results"]) == variants
    batch = doc["meta"]["global_batch_size"]
    for name, rounds in doc["results"].items():
        assert rounds[0]["samples"] == [batch, batch], name  # every step trained the whole global batch
        assert doc["peak_saved_bytes"][name] > 0, name
    padded, packed = doc["results"]["dflop_padded"][0], doc["results"]["dflop_packed"][0]
    assert padded["tokens"] == packed["tokens"]  # the same samples
    assert padded["loss"] == pytest.approx(packed["loss"], rel=1e-4)
    assert "loss check: dflop_padded vs dflop_packed" in result.stdout
    for name in variants:
        assert f"| {name} |" in result.stdout
