"""The committed H200 profile (SigLIP-so400m + Qwen2.5-0.5B, bf16, before the profiler measured
transients) refitted: its LM head's transient comes from the CUDA peaks, and per token it is what
the dtypes say the loss's backward holds beside the saved float32 log-probabilities: the float32
gradients of the log-probabilities and of the logits, 8 bytes per vocabulary entry (the forward's
bf16 logits and their float32 copy, 6 bytes, are less)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from dflop.costmodel.fit import fit
from dflop.costmodel.model import TRANSIENT

PROFILE = Path(__file__).parents[2] / "benchmarks/profiles/nvidia-h200/llava_ov-siglip-so400m-qwen2.5-0.5b.profile.parquet"
VOCAB = 151_936  # Qwen2.5's


def test_the_refitted_h200_lm_head_holds_the_losss_float32_gradients(tmp_path):
    rows = pd.read_parquet(PROFILE)
    assert TRANSIENT not in rows.columns  # a profile from before: derived from its CUDA peaks
    head = rows[rows["module"] == "llm_head"].groupby("seq_len")[["peak_bytes", "act_bytes"]].median()
    # The profile itself, between its two largest shapes: the peak beyond the saved bytes, per token
    # and vocabulary entry (no assumption about what the fit does with the smaller shapes).
    (t0, a), (t1, b) = list(head.iloc[-2:].iterrows())
    per_token = ((b.peak_bytes - a.peak_bytes) - (b.act_bytes - a.act_bytes)) / (t1 - t0)
    assert per_token / VOCAB == pytest.approx(8.0, rel=0.01)

    cost = fit(PROFILE, tmp_path / "cost.json", tmp_path / "validation.parquet")
    fitted = cost.module("llm_head", 1)
    coef = dict(zip(fitted.features, fitted.coefficients(TRANSIENT)))
    assert coef["tokens"] / VOCAB == pytest.approx(8.0, rel=0.05)
    # and the stage's peak at the largest profiled shape is the measured one, within 5 %
    largest = int(head.index[-1])
    memory = cost.llm_stage_memory([largest], n_layers=0, first=False, last=True, tp=1, in_flight=1)
    grad = rows.loc[rows["module"] == "llm_head", "grad_bytes"].median()
    measured = head["peak_bytes"].iloc[-1]
    assert memory.activation_bytes + memory.transient_bytes + grad == pytest.approx(measured, rel=0.05)
