"""A stage's peak memory, predicted by a cost model fitted on the profile, against what a real
pipeline stage allocates: the LM head's transient (its float32 loss gradients beside the saved
log-probabilities) is most of it when the vocabulary is large, and the saved bytes alone miss it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dflop.config import Config
from dflop.costmodel.fit import fit
from dflop.costmodel.jsonio import load_cost_model
from dflop.models.builder import build_from_config
from dflop.models.handle import ModelHandle
from dflop.models.packing import PackedSequence
from dflop.models.precision import Precision
from dflop.models.stages import build_llm_stage
from dflop.profiling._memory import allocated_peak
from dflop.profiling.model_profiler import profile_model
from profiling_testlib import SMALL_GRID


def test_a_last_llm_stages_peak_is_its_activations_and_the_heads_transient(tmp_path):
    """The tiny model with a vocabulary 16x its own (so the head dominates), bf16 autocast: profile,
    fit, then run the last LLM stage (one decoder layer, norm, head, loss) on a packed microbatch it
    never saw, as a step's second microbatch runs it (gradients there from the first). What it
    allocates at its peak (training state excluded on both sides) is the fitted activations plus
    the largest module transient within 10 %; the activations alone (the old prediction) miss
    more than 30 %."""
    cfg = Config.from_dict({"model": {"arch": "llava_ov", "vision": "siglip-tiny", "llm": "qwen2.5-tiny",
                                      "dtype": "bfloat16"}, "profile": SMALL_GRID})
    handle = ModelHandle.resolve(cfg.model)
    wide = copy.deepcopy(handle.config)
    wide.text_config.vocab_size = 16 * handle.config.text_config.vocab_size
    profile_model(dataclasses.replace(handle, config=wide), cfg.profile, tmp_path / "profile.parquet", seed=0,
                  min_seq_len=16, progress=False)
    fit(tmp_path / "profile.parquet", tmp_path / "cost.json", tmp_path / "validation.parquet")
    cost = load_cost_model(tmp_path / "cost.json")

    model = build_from_config(wide, seed=0)
    n_layers = wide.text_config.num_hidden_layers
    stage = build_llm_stage(model, 1, 2, (n_layers - 1, n_layers))
    lengths = [45, 70, 13]
    packed = PackedSequence.from_lengths(lengths)
    torch.manual_seed(0)
    labels = packed.shift_labels(torch.randint(0, wide.text_config.vocab_size, (packed.total_tokens,)))
    autocast = Precision.of("bfloat16").autocast("cpu")

    def microbatch():
        hidden = torch.randn(1, packed.total_tokens, wide.text_config.hidden_size, requires_grad=True)
        with autocast:
            loss = stage(hidden, packed, shift_labels=labels)
        loss.backward()

    microbatch()  # the step's first: the gradients exist from here on
    with allocated_peak() as allocated:
        microbatch()

    predicted = cost.llm_stage_memory(lengths, n_layers=1, first=False, last=True, tp=1, in_flight=1)
    assert predicted.activation_bytes + predicted.transient_bytes == pytest.approx(allocated.peak, rel=0.10)
    assert predicted.activation_bytes < 0.7 * allocated.peak
    # and the head's is the largest transient: the loss's two float32 [tokens, vocabulary] gradients
    assert predicted.transient_bytes >= 8 * wide.text_config.vocab_size * sum(lengths) * 0.9
