"""Sequence parallelism's activation saving in the analytic cost model against the bytes a TP=2
decoder layer really saves for backward (measured with saved-tensor hooks under torchrun), under
each model.dtype's contract: the same bytes, since what SP shards is float32 under both."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dflop.costmodel.activations import sequence_parallel_saving
from dflop.costmodel.analytic import analytic_cost_model
from dflop.models.builder import model_config

from gloo_ranks import run_ranks

WORKER = Path(__file__).with_name("sp_memory_worker.py")


@pytest.mark.distributed
def test_sequence_parallel_saving_matches_measured_saved_bytes():
    result = run_ranks(WORKER, nproc=2, timeout=300)
    lines = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("SAVED ")]
    assert [line[:2] for line in lines] == [["bfloat16", "none"], ["bfloat16", "full"], ["float32", "none"],
                                            ["float32", "full"]]
    config = model_config("llava_ov", "siglip-tiny", "qwen2.5-tiny")
    hidden = config.text_config.hidden_size
    for dtype, mode, tokens, without, with_sp in lines:
        nbytes = {"bfloat16": 2, "float32": 4}[dtype]
        measured = (int(without) - int(with_sp)) / int(tokens)  # per token per layer, this rank
        assert measured > 0
        assert sequence_parallel_saving(hidden, 2, nbytes, mode) == pytest.approx(measured), (dtype, mode)
    # the cost model charges exactly that much less per token and layer at TP 2 (nothing at TP 1)
    cost = analytic_cost_model(config, tp_degrees=(1, 2))
    lens = [5, 11]
    for t, expected in ((1, 0.0), (2, sequence_parallel_saving(hidden, 2, 2))):
        act = {sp: cost.llm_stage_terms(lens, n_layers=3, first=False, last=False, tp=t,
                                        sequence_parallel_hidden=hidden if sp else 0).act_bytes for sp in (False, True)}
        np.testing.assert_allclose(act[False] - act[True], expected * 3 * np.array(lens), rtol=1e-12)
