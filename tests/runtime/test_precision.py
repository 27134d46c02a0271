"""The one precision contract (`dflop.models.precision`): the profiler measures what the trainer runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflop.models import packing
from dflop.models.architectures import architecture
from dflop.models.builder import model_config
from dflop.models.precision import Precision
from dflop.models.tensor_parallel import TPGroup
from dflop.profiling._timing import Timer
from dflop.profiling.model_modules import build_benches
from dflop.profiling.model_profiler import _RankSync, _run_shape, _Shape
from gloo_ranks import run_ranks
from trainer_reference import config_dict

WORKER = Path(__file__).with_name("precision_worker.py")
ONE_RANK_PLAN = ("vision: {tp: 1, pp: 1, dp: 1, layers_per_stage: [2]}\n"
                 "llm: {tp: 1, pp: 1, dp: 1, layers_per_stage: [2]}\n"
                 "placement: colocated\nmicrobatches: 2\nglobal_batch_size: 4\nworld_size: 1\n")


def _profiler_attention_dtypes(monkeypatch, dtype: str) -> set[tuple[str, ...]]:
    """(query, key, value) dtypes at the kernel while the model profiler runs its llm_layer bench."""
    seen = set()
    sdpa = packing._KERNELS["sdpa"]

    def spy(query, key, value, *args):
        seen.add(tuple(str(t.dtype) for t in (query, key, value)))
        return sdpa(query, key, value, *args)

    monkeypatch.setitem(packing._KERNELS, "sdpa", spy)
    config = model_config("llava_ov", "siglip-tiny", "qwen2.5-tiny")
    (bench,) = build_benches(architecture("llava_ov"), config, modules=("llm_layer",), tp=TPGroup(rank=0, size=1),
                             device=torch.device("cpu"), precision=Precision.of(dtype))
    cpu = torch.device("cpu")
    _run_shape(_Shape(bench, None, 16, 2, 16), 0, 1, _RankSync(cpu), Timer(cpu))
    return seen


@pytest.mark.slow
def test_attention_dtypes_in_a_trainer_step_are_the_profilers(tmp_path, monkeypatch, pools, runtime_demo):
    """bf16 on CPU: one real training step (in a process of its own, forked by `run_ranks`: no
    fresh interpreter importing torch and transformers again) and the profiler's llm_layer
    bench hand the kernel the same dtypes, all bf16 (before the contract: the trainer ran float32 on
    CPU while the profiler ran bf16 modules, and on CUDA q and k reached attention in float32)."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(ONE_RANK_PLAN)
    config = config_dict("llava_ov", runtime_demo, model={"dtype": "bfloat16"},
                         cluster={"device": "cpu", "gpus_per_node": 1},
                         train={"global_batch_size": 4, "steps": 1, "checkpoint_every": 10})
    spec = {"config": config, "plan": str(plan), "shapes": pools["llava_ov"], "out_dir": str(tmp_path / "train"),
            "report": str(tmp_path / "report.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run_ranks(WORKER, tmp_path / "spec.json", nproc=1, timeout=600)  # forked: a fresh interpreter re-imports torch
    trainer = {tuple(d) for d in json.loads((tmp_path / "report.json").read_text())["dtypes"]}
    assert trainer == _profiler_attention_dtypes(monkeypatch, "bfloat16") == {("torch.bfloat16",) * 3}


def test_float32_runs_attention_in_float32(monkeypatch):
    assert _profiler_attention_dtypes(monkeypatch, "float32") == {("torch.float32",) * 3}
