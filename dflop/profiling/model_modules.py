"""The units the model profiler measures, each built alone from the model config (this rank's
tensor-parallel shard), with inputs for one shape.

| module | shape (batch, seq_len) | what runs |
|---|---|---|
| vision_embed | batch tiles, seq_len tokens per tile | patch (+ CLS) + position embeddings, replicated under TP |
| vision_layer | batch tiles, seq_len tokens per tile | one vision encoder layer |
| projector | batch tiles, seq_len tokens per tile | LLaVA-OV MLP; InternVL drop-CLS + pixel shuffle + MLP |
| llm_embed | batch samples of seq_len tokens | token embedding + splice of image features (half the tokens) |
| llm_layer | batch samples of seq_len tokens, packed | one decoder layer, attention within each sample |
| llm_attention | batch samples of seq_len tokens, packed | the attention kernel alone (no projections) |
| llm_head | batch samples of seq_len tokens | final norm + LM head + cross-entropy |

The modules are the ones the pipeline stages run (`dflop.models.llm_parts`, transformers layers),
so the profile times the training code. Rotary cos/sin are inputs of `llm_layer` because a stage
computes them once for all its layers. vision_layer and llm_layer, the layers a stage recomputes,
also run wrapped as a stage with recompute selective / full wraps them (the same wrappers,
`dflop.models.recompute.recompute_layer`; `ModuleBench.recomputing`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from transformers import PreTrainedConfig

from dflop import plan
from dflop.models.architectures import Architecture, new_llm_layer, new_llm_norm, new_rotary_embedding
from dflop.models.builder import ties_embeddings
from dflop.models.llm_parts import CausalLMHead, TokenEmbedding, run_decoder_layers
from dflop.models.packing import PackedSequence, packed_attention_forward
from dflop.models.precision import Precision
from dflop.models.recompute import recompute_layer
from dflop.models.tensor_parallel import (
    TPGroup,
    VocabParallelCausalLMHead,
    VocabParallelEmbedding,
    local_tensor,
    shard_llm_layer,
    shard_projector,
    shard_vision_layer,
)

TILE_MODULES = ("vision_embed", "vision_layer", "projector")
TOKEN_MODULES = ("llm_embed", "llm_layer", "llm_attention", "llm_head")
MODULES = TILE_MODULES + TOKEN_MODULES
LAYER_MODULES = frozenset({"vision_layer", "llm_layer", "llm_attention"})
#: Recompute modes measured besides none, for the benches that have ``recompute``.
RECOMPUTE_MODES = tuple(mode for mode in plan.RECOMPUTE_MODES if mode != "none")
#: Share of the tokens that are image placeholders in the `llm_embed` input.
IMAGE_TOKEN_SHARE = 0.5


@dataclass(frozen=True)
class ModuleBench:
    """One profiled module: ``forward(*make_inputs(batch, seq_len))`` is the timed forward.

    module: holds the measured parameters (none for llm_attention).
    make_inputs: float inputs that get gradients are leaves with ``requires_grad``.
    recompute: for vision_layer and llm_layer, ``recompute(mode)`` switches the module to a recompute
        mode (none | selective | full) and returns the forward a stage in that mode runs.
    tied_bytes: bytes of this rank's parameters that are the token embedding's in the model (the
        LM head of a model with tied embeddings): a stage holding both holds them once.
    precision: the contract the forward runs under (float32 parameters, the autocast of
        ``model.dtype``), as the stages run it.
    """

    name: str
    module: nn.Module
    make_inputs: Callable[[int, int], tuple]
    forward: Callable[..., torch.Tensor]
    recompute: Callable[[str], Callable[..., torch.Tensor]] | None = None
    tied_bytes: int = 0
    precision: Precision = Precision(torch.float32)

    @property
    def recompute_modes(self) -> tuple[str, ...]:
        """The recompute modes measured besides none (none for modules a stage never recomputes)."""
        return RECOMPUTE_MODES if self.recompute is not None else ()

    @contextlib.contextmanager
    def recomputing(self, mode: str) -> Iterator[Callable[..., torch.Tensor]]:
        """The forward under recompute `mode` for the block (forward and backward); mode none after."""
        if mode == "none":
            yield self.forward
            return
        forward = self.recompute(mode)
        try:
            yield forward
        finally:
            self.recompute("none")

    @property
    def n_layers(self) -> int:
        """1 for one transformer layer (or its attention), 0 for embeddings, projector and head."""
        return 1 if self.name in LAYER_MODULES else 0


class _AttentionCore(nn.Module):
    """Parameter-free stand-in for an attention module: what the attention function reads."""

    is_causal = True


@contextlib.contextmanager
def _building(device: torch.device, dtype: torch.dtype):
    """New modules get their parameters on `device` in `dtype`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_benches(arch: Architecture, config: PreTrainedConfig, *, modules=MODULES, tp: TPGroup,
                  device: torch.device, precision: Precision, seed: int = 0) -> list[ModuleBench]:
    """The requested modules of `config` as this rank's shard, parameters initialised from `seed`
    (the same on every rank, so shards are slices of one module), in `precision`'s parameter dtype;
    hidden-state inputs come in its residual-stream dtype, and forwards run under its autocast."""
    factory = _BenchFactory(arch, config, tp, device, precision.stream_dtype)
    benches = []
    for name in modules:
        torch.manual_seed(seed)
        with _building(device, precision.param_dtype):
            benches.append(dataclasses.replace(getattr(factory, name)(), precision=precision))
    return benches


class _BenchFactory:
    def __init__(self, arch, config, tp, device, dtype):
        self.arch, self.config, self.tp, self.device, self.dtype = arch, config, tp, device, dtype
        self.vision_cfg, self.text_cfg = config.vision_config, config.text_config

    def _randn(self, *shape, grad=True) -> torch.Tensor:
        x = torch.randn(*shape, device=self.device, dtype=self.dtype)
        return x.requires_grad_(grad)

    def _packed(self, batch: int, seq_len: int) -> PackedSequence:
        return PackedSequence.from_lengths([seq_len] * batch, device=self.device)

    # -- vision (shape: batch tiles, seq_len tokens per tile) --
    def vision_embed(self) -> ModuleBench:
        module = self.arch.new_vision_embeddings(self.config)
        size = self.vision_cfg.image_size
        size = size[0] if isinstance(size, (tuple, list)) else size
        return ModuleBench("vision_embed", module,
                           lambda batch, _: (self._randn(batch, 3, size, size, grad=False),), module)

    def vision_layer(self) -> ModuleBench:
        layer = shard_vision_layer(self.arch.new_vision_layer(self.config), self.tp)
        width = self.vision_cfg.hidden_size
        run = self.arch.run_vision_layer

        def recompute(mode):  # as `dflop.models.stages.VisionStage` runs its layers, wrapped
            wrapped = recompute_layer(layer, mode)
            return lambda hidden: run(wrapped, hidden)

        def forward(hidden):
            return run(layer, hidden)

        return ModuleBench("vision_layer", layer, lambda batch, seq: (self._randn(batch, seq, width),), forward,
                           recompute)

    def projector(self) -> ModuleBench:
        module = self.arch.new_projector(self.config)
        shard_projector(getattr(module, "projector", module), self.tp)
        width = self.vision_cfg.hidden_size
        return ModuleBench("projector", module, lambda batch, seq: (self._randn(batch, seq, width),), module)

    # -- LLM (shape: batch samples of seq_len tokens, packed into one row) --
    def llm_embed(self) -> ModuleBench:
        vocab, width = self.text_cfg.vocab_size, self.text_cfg.hidden_size
        table = nn.Embedding(vocab, width)
        image_id = self.config.image_token_id
        module = TokenEmbedding(table if self.tp.size == 1 else VocabParallelEmbedding(table, self.tp), image_id)

        def inputs(batch, seq):
            total = batch * seq
            ids = torch.randint(0, vocab, (total,), device=self.device)
            ids[ids == image_id] = 0
            n_image = int(total * IMAGE_TOKEN_SHARE)
            ids[torch.randperm(total, device=self.device)[:n_image]] = image_id
            return ids, self._randn(n_image, width)

        return ModuleBench("llm_embed", module, inputs, module)

    def llm_layer(self) -> ModuleBench:
        layer = shard_llm_layer(new_llm_layer(self.text_cfg), self.tp)
        rotary = new_rotary_embedding(self.text_cfg)
        width = self.text_cfg.hidden_size

        def inputs(batch, seq):
            packed = self._packed(batch, seq)
            hidden = self._randn(1, packed.total_tokens, width)
            with torch.no_grad():
                cos_sin = rotary(hidden, packed.position_ids.unsqueeze(0))
            return hidden, packed, cos_sin

        def recompute(mode):  # as `dflop.models.stages.LLMStage` runs its layers, wrapped
            wrapped = recompute_layer(layer, mode)
            return lambda hidden, packed, cos_sin: run_decoder_layers([wrapped], hidden, packed, cos_sin)

        return ModuleBench("llm_layer", layer, inputs,
                           lambda hidden, packed, cos_sin: run_decoder_layers([layer], hidden, packed, cos_sin),
                           recompute)

    def llm_attention(self) -> ModuleBench:
        cfg = self.text_cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        heads, kv_heads = cfg.num_attention_heads // self.tp.size, cfg.num_key_value_heads // self.tp.size
        core = _AttentionCore()

        def inputs(batch, seq):
            packed = self._packed(batch, seq)
            total = packed.total_tokens
            return (self._randn(1, heads, total, head_dim), self._randn(1, kv_heads, total, head_dim),
                    self._randn(1, kv_heads, total, head_dim), packed)

        def forward(q, k, v, packed):
            out, _ = packed_attention_forward(core, q, k, v, None, scaling=head_dim**-0.5, **packed.attention_kwargs())
            return out

        return ModuleBench("llm_attention", core, inputs, forward)

    def llm_head(self) -> ModuleBench:
        vocab, width = self.text_cfg.vocab_size, self.text_cfg.hidden_size
        lm_head = nn.Linear(width, vocab, bias=False)
        norm = new_llm_norm(self.text_cfg)
        module = CausalLMHead(norm, lm_head) if self.tp.size == 1 else VocabParallelCausalLMHead(norm, lm_head, self.tp)
        weight = local_tensor(module.lm_head.weight)
        tied = weight.numel() * weight.element_size() if ties_embeddings(self.config) else 0

        def inputs(batch, seq):
            packed = self._packed(batch, seq)
            labels = torch.randint(0, vocab, (packed.total_tokens,), device=self.device)
            return self._randn(1, packed.total_tokens, width), packed.shift_labels(labels)

        return ModuleBench("llm_head", module, inputs, module, tied_bytes=tied)
