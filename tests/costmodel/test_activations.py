"""The closed-form bytes saved for backward per recompute mode (`dflop.costmodel.activations`)
match what autograd actually keeps, counted by saved-tensor hooks on real stages and on the model
profiler's modules (CPU), under both settings of ``model.dtype``: float32, and bfloat16 (float32
parameters, forwards under autocast: `dflop.models.precision`).

Prediction: widths, heads and dtype of the config only. Measurement: `saved_tensor_bytes` around the
forward; with non-reentrant checkpoint the hooks see what the checkpoint keeps (its inputs),
since its own hooks replace the layer-internal saves by recomputation. Under autocast the hooks also
count autocast's bf16 copies of the matmul and convolution weights (new tensors, not the
parameters): a per-microbatch constant that the per-token closed forms leave out, computed here
from the parameters and subtracted, so both dtypes are held exactly, byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

from dflop.costmodel import activations
from dflop.models.architectures import ImageLayout, architecture, architecture_of
from dflop.models.builder import build_model, model_config
from dflop.models.packing import PackedSequence
from dflop.models.precision import Precision
from dflop.models.stages import build_llm_stage, build_vision_stage
from dflop.models.tensor_parallel import TPGroup
from dflop.profiling._memory import saved_tensor_bytes
from dflop.profiling.model_modules import build_benches
from dflop.runtime.vision import VisionRunner

from gloo_ranks import run_ranks

MODELS = {"tiny-llava_ov": ("llava_ov", "siglip-tiny", "qwen2.5-tiny"),
          "tiny-internvl": ("internvl", "internvit-tiny", "llama3-tiny"),
          "small-llava_ov": ("llava_ov", "siglip-small", "qwen2.5-small")}
MODES = ("none", "selective", "full")
DTYPES = ("float32", "bfloat16")
H200_PROFILES = Path(__file__).parents[2] / "benchmarks" / "profiles" / "nvidia-h200"


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    torch.set_num_threads(1)
    return build_model(*MODELS[request.param], seed=0)


def _weight_copies(module: nn.Module, dtype: str, mode: str = "none") -> int:
    """Bytes of autocast's bf16 copies of the weights that `module`'s matmuls and convolutions keep
    for backward (their biases' copies are not kept; full recomputation drops them all)."""
    if dtype == "float32" or mode == "full":
        return 0
    weights = {m.weight.untyped_storage().data_ptr(): m.weight.numel()
               for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    return 2 * sum(weights.values())


def _saved(module: nn.Module, dtype: str, run) -> int:
    """Bytes saved for backward by ``run()`` under `dtype`'s autocast, the parameters of `module`
    excluded (as the profiler excludes them); autocast's weight copies included."""
    with saved_tensor_bytes(module.parameters()) as saved:
        with Precision.of(dtype).autocast("cpu"):
            run()
    return saved.bytes


def _measure_vision(model, mode, n_tiles, dtype, n_layers=2):
    stage = build_vision_stage(model, 1, 3, (0, n_layers), recompute=mode)  # a middle stage: layers only
    config = model.config
    tokens = architecture_of(config).layer_tokens_per_tile(config)
    x = torch.randn(n_tiles, tokens, config.vision_config.hidden_size, requires_grad=True)
    saved = _saved(model, dtype, lambda: stage(x, ImageLayout((n_tiles,), torch.zeros(1, 2))))
    return saved - _weight_copies(stage, dtype, mode)


def _measure_llm(model, mode, lengths, dtype, n_layers=2):
    stage = build_llm_stage(model, 1, 3, (0, n_layers), recompute=mode)
    x = torch.randn(1, sum(lengths), model.config.get_text_config().hidden_size, requires_grad=True)
    saved = _saved(model, dtype, lambda: stage(x, PackedSequence.from_lengths(lengths)))
    return saved - _weight_copies(stage, dtype, mode)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vision_saved_bytes_match_closed_form(model, dtype):
    measured = {mode: _measure_vision(model, mode, 3, dtype) for mode in MODES}
    predicted = {mode: activations.vision_stage_layer_bytes(model.config, 3, 2, mode, dtype) for mode in MODES}
    assert measured == predicted
    assert measured["full"] < measured["selective"] < measured["none"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_trainer_vision_runner_saves_what_the_mode_says(model, dtype):
    """The trainer runs vision stages through `VisionRunner`, not `VisionStage.forward`: its saved
    bytes per recompute mode must match the same closed form (it once ignored full recompute)."""
    config = model.config
    tokens = architecture_of(config).layer_tokens_per_tile(config)
    for mode in MODES:
        stage = build_vision_stage(model, 1, 3, (0, 2), recompute=mode)
        runner = VisionRunner(stage, model)
        x = torch.randn(3, tokens, config.vision_config.hidden_size, requires_grad=True)
        saved = _saved(model, dtype, lambda: runner(x, []))
        predicted = activations.vision_stage_layer_bytes(config, 3, 2, mode, dtype)
        assert saved - _weight_copies(stage, dtype, mode) == predicted, mode


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", [(37, 50, 24), (40, 40)], ids=["unequal", "equal"])
def test_llm_saved_bytes_match_closed_form(model, lengths, dtype):
    text = model.config.get_text_config()
    measured = {mode: _measure_llm(model, mode, list(lengths), dtype) for mode in MODES}
    predicted = {mode: activations.llm_stage_layer_bytes(text, lengths, 2, mode, dtype) for mode in MODES}
    assert measured == predicted
    assert measured["full"] < min(measured["none"], measured["selective"])
    # selective drops the float32 log-sum-exp (and per-sample outputs); under autocast its checkpoint
    # keeps the kernel's bf16 query and key, not rotary's float32 ones (dflop.models.recompute)
    assert measured["selective"] < measured["none"]


def _image_layout(model):
    """Two images of a microbatch and their tiles (LLaVA-OV: AnyRes base + crops of these sizes)."""
    config = model.config
    sizes = torch.tensor([[56, 112], [100, 60]])
    if architecture_of(config).vision_family == "siglip":
        tiles = [image_size_to_num_patches(s, config.image_grid_pinpoints, config.vision_config.image_size)
                 for s in sizes]
    else:
        tiles = [2, 1]
    return ImageLayout(tuple(tiles), sizes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_first_and_last_vision_stage_keep_the_embedding_and_projector_closed_forms(model, dtype):
    """A whole one-stage vision tower (pixels in, features out) with its layers: the layers plus the
    embeddings' and projector's closed forms, exactly."""
    config = model.config
    layout = _image_layout(model)
    size = config.vision_config.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    stage = build_vision_stage(model, 0, 1)
    pixels = torch.randn(layout.n_tiles, 3, size, size)
    saved = _saved(model, dtype, lambda: stage(pixels, layout))
    per_tile, const = activations.vision_embed_bytes(config, dtype)
    predicted = (activations.vision_stage_layer_bytes(config, layout.n_tiles, len(stage.layers), "none", dtype)
                 + layout.n_tiles * (per_tile + activations.projector_bytes_per_tile(config, dtype)) + const)
    assert saved - _weight_copies(stage, dtype) == predicted


@pytest.mark.parametrize("dtype", DTYPES)
def test_first_and_last_llm_stage_keep_the_embedding_and_head_closed_forms(model, dtype):
    """A one-stage LLM (ids and image features in, loss out) on a packed row: the
    layers plus the token embedding's and the head's closed forms (4 bytes: the loss's scalar)."""
    text = model.config.get_text_config()
    lengths = [37, 50, 24]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (sum(lengths),), generator=generator)
    ids[5:17] = model.config.image_token_id
    features = torch.randn(12, text.hidden_size, requires_grad=True)
    packed = PackedSequence.from_lengths(lengths)
    shift = packed.shift_labels(torch.randint(0, 1000, (sum(lengths),), generator=generator))
    stage = build_llm_stage(model, 0, 1)
    saved = _saved(model, dtype, lambda: stage(ids, packed, image_features=features, shift_labels=shift,
                                               num_items_in_batch=1))
    tokens = sum(lengths)
    predicted = (activations.llm_stage_layer_bytes(text, lengths, len(stage.layers), "none", dtype)
                 + tokens * activations.LLM_EMBED_BYTES_PER_TOKEN
                 + tokens * activations.llm_head_bytes_per_token(text, dtype))
    assert saved - _weight_copies(stage, dtype) == predicted + 4


# -- the model profiler's modules, run as it runs them (`dflop.profiling.model_profiler._run_shape`) --

def _profiled_bytes(bench, batch: int, seq_len: int, mode: str = "none") -> int:
    torch.manual_seed(0)
    inputs = bench.make_inputs(batch, seq_len)
    with bench.recomputing(mode) as forward:
        with saved_tensor_bytes(exclude=list(bench.module.parameters())) as saved:
            with bench.precision.autocast("cpu"):
                forward(*inputs)
    return saved.bytes


def _closed_form(name: str, config, batch: int, seq_len: int, mode: str, dtype: str) -> float:
    """Bytes the closed forms give a bench's shape (batch tiles or samples of seq_len tokens), with
    the constants a module keeps once (SigLIP's position ids, the loss scalar)."""
    text = config.get_text_config()
    tokens = batch * seq_len
    if name == "vision_embed":
        per_tile, const = activations.vision_embed_bytes(config, dtype)
        return batch * per_tile + const
    if name == "vision_layer":
        return activations.vision_stage_layer_bytes(config, batch, 1, mode, dtype)
    if name == "projector":
        return batch * activations.projector_bytes_per_tile(config, dtype)
    if name == "llm_embed":
        return tokens * activations.LLM_EMBED_BYTES_PER_TOKEN
    if name == "llm_layer":  # a one-layer stage: its shared bytes (rotary cos/sin, checkpoint inputs) too
        return activations.llm_stage_layer_bytes(text, [seq_len] * batch, 1, mode, dtype)
    assert name == "llm_head"
    return tokens * activations.llm_head_bytes_per_token(text, dtype) + 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", sorted(MODELS))
def test_profiled_modules_keep_the_closed_forms(preset, dtype):
    """Every module the model profiler measures (its `act_bytes` column, what `dflop fit` fits),
    at two sizes and in every recompute mode it runs: the closed form plus autocast's weight copies
    (bfloat16; none under full recomputation), exactly."""
    torch.set_num_threads(1)
    arch_name = MODELS[preset][0]
    config = model_config(*MODELS[preset])
    benches = build_benches(architecture(arch_name), config, tp=TPGroup(rank=0, size=1), device=torch.device("cpu"),
                            precision=Precision.of(dtype))
    tile_tokens = architecture_of(config).layer_tokens_per_tile(config)
    checked = set()
    for bench in benches:
        if bench.name == "llm_attention":  # the kernel alone: no closed form of its own
            continue
        shapes = [(1, tile_tokens), (3, tile_tokens)] if bench.name in ("vision_embed", "vision_layer", "projector") \
            else [(1, 24), (3, 40)]
        for mode in ("none",) + bench.recompute_modes:
            for batch, seq_len in shapes:
                measured = _profiled_bytes(bench, batch, seq_len, mode) - _weight_copies(bench.module, dtype, mode)
                assert measured == _closed_form(bench.name, config, batch, seq_len, mode, dtype), \
                    (bench.name, mode, batch, seq_len)
        checked.add(bench.name)
    assert checked == {"vision_embed", "vision_layer", "projector", "llm_embed", "llm_layer", "llm_head"}


@pytest.mark.distributed
def test_profiled_modules_keep_the_closed_forms_at_tp2():
    """One rank of TP=2 (`tp_activations_worker.py`): the split heads and MLP, the replicated norms
    and, under autocast, the replicated copies of the norms' outputs each column-parallel projection
    keeps, exactly. (Not here: the vocabulary-parallel embedding and head, which keep a few masks per
    token more than the TP=1 forms under either dtype.)"""
    worker = Path(__file__).with_name("tp_activations_worker.py")
    result = run_ranks(worker, nproc=2, timeout=300)
    lines = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("SAVED ")]
    config = model_config("llava_ov", "siglip-tiny", "qwen2.5-tiny")
    text = config.get_text_config()
    # the vocabulary-parallel head's transient per token: the closed form's slope (bf16: the head's
    # logits beside their float32 copy, 6 V/t; float32 4 V/t), and the bound with the weight gradient
    heads = {(d, int(n)): float(b) for d, _, n, b in
             (line.split()[1:] for line in result.stdout.splitlines() if line.startswith("TRANSIENT "))}
    V, h = text.vocab_size, text.hidden_size
    for dtype in ("float32", "bfloat16"):
        per_token, per_microbatch = activations.llm_head_transient_bytes(text, dtype, tp=2)
        slope = (heads[dtype, 1024] - heads[dtype, 256]) / (1024 - 256)
        assert slope == pytest.approx(per_token, rel=0.02), dtype
        for n in (256, 1024):
            assert heads[dtype, n] <= n * per_token + per_microbatch <= heads[dtype, n] + 4 * V * h / 2, (dtype, n)
    assert len(lines) == 2 * (1 + 3 + 1 + 3)
    for dtype, name, mode, batch, seq_len, measured in lines:
        batch, seq_len = int(batch), int(seq_len)
        predicted = {
            "vision_embed": lambda: batch * activations.vision_embed_bytes(config, dtype)[0]
            + activations.vision_embed_bytes(config, dtype)[1],
            "vision_layer": lambda: activations.vision_stage_layer_bytes(config, batch, 1, mode, dtype, tp=2),
            "projector": lambda: batch * activations.projector_bytes_per_tile(config, dtype, tp=2),
            "llm_layer": lambda: activations.llm_stage_layer_bytes(text, [seq_len] * batch, 1, mode, dtype, tp=2),
        }[name]()
        assert int(measured) == predicted, (dtype, name, mode)


# -- the GPU: the committed H200 profiles (saved-tensor hooks on CUDA, fitted per module) --

@pytest.mark.parametrize("llm", ["qwen2.5-0.5b", "qwen2.5-7b"])
def test_closed_forms_reproduce_the_h200_profiles(llm):
    """The fitted ``act_bytes`` coefficients per tile / token of SigLIP-so400m + Qwen2.5 on an H200
    (saved-tensor hooks under CUDA's bf16 autocast; torch 2.11, whose varlen kernel gets key and
    value repeated to the query heads, 4.4 % of a layer) are the closed forms, in every recompute mode."""
    config = model_config("llava_ov", "siglip-so400m", llm)
    text = config.get_text_config()
    fitted = json.loads((H200_PROFILES / f"llava_ov-siglip-so400m-{llm}.json").read_text())
    assert fitted["provenance"]["dtype"] == "bfloat16"
    modules = {m["module"]: m for m in fitted["modules"] if m["tp"] == 1}

    def per_unit(module: str, target: str = "act_bytes") -> float:
        features = modules[module]["features"]
        return modules[module]["coef"][target][features.index("tiles" if "tiles" in features else "tokens")]

    def llm_layer_per_token(mode: str) -> float:  # the slope of a one-layer stage in its row's tokens, as fitted
        def row(n):
            return activations.llm_stage_layer_bytes(text, [n], 1, mode, "bfloat16", flash_varlen=True,
                                                     repeated_kv=True)
        return (row(2000) - row(1000)) / 1000

    for mode in MODES:
        target = "act_bytes" if mode == "none" else f"act_bytes:{mode}"
        # that profile predates the cast before selective's checkpoint: its core kept rotary's
        # float32 query and key, (4 - 2) bytes x (H + Hkv) x d more per token than now
        before_cast = 2 * (text.num_attention_heads + text.num_key_value_heads) * (
            text.hidden_size // text.num_attention_heads) if mode == "selective" else 0
        assert llm_layer_per_token(mode) + before_cast == pytest.approx(per_unit("llm_layer", target), rel=5e-3), mode
        assert activations.vision_stage_layer_bytes(config, 1, 1, mode, "bfloat16") == pytest.approx(
            per_unit("vision_layer", target), rel=5e-3), mode
    assert activations.vision_embed_bytes(config, "bfloat16")[0] == pytest.approx(per_unit("vision_embed"), rel=5e-3)
    assert activations.projector_bytes_per_tile(config, "bfloat16") == pytest.approx(per_unit("projector"), rel=5e-3)
    assert activations.LLM_EMBED_BYTES_PER_TOKEN == pytest.approx(per_unit("llm_embed"), rel=5e-3)
    assert activations.llm_head_bytes_per_token(text, "bfloat16") == pytest.approx(per_unit("llm_head"), rel=5e-3)
