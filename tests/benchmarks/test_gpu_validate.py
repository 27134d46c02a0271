"""`benchmarks/gpu/validate.sh --cpu`: the GPU check's script runs end to end on the tiny presets,
so it cannot rot between GPU loans (issue 36)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_validate_cpu_runs_every_part(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    result = subprocess.run([str(ROOT / "benchmarks/gpu/validate.sh"), "--cpu", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=1500, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    failed = {part: s for part, s in summary["parts"].items() if s["state"] not in ("ok",) and "seconds" in s}
    assert not failed, failed
    for part in ("versions", "attention", "data", "profile", "fit_qwen2.5-tiny", "plan", "train_plan", "train_padded"):
        assert summary["parts"][part]["state"] == "ok", part
    kernels = summary["attention"]["qwen2.5-tiny"]["kernels"]
    assert kernels["sdpa"]["median_ms"] > 0
    assert kernels["padded"]["agrees"] and kernels["flex"]["agrees"]  # both checked against per-sample SDPA
    assert "CUDA only" in kernels["varlen"]["skipped"]
    profile = summary["profiles"]["qwen2.5-tiny"]
    assert {"llm_layer:fwd_ms", "vision_layer:act_bytes"} <= set(profile["held_out"])
    for name in ("train_plan", "train_padded"):
        run = summary["training"][name]
        assert run["steps"] == 3 and run["tokens_per_s"] > 0 and run["predicted_step_s"] > 0
    assert (tmp_path / "results.tar.gz").stat().st_size > 0
