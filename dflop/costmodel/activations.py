"""Bytes a stage keeps for backward per recompute mode, in closed form from the model's config.

These are the tensors autograd saves (what `dflop.profiling._memory.saved_tensor_bytes` counts),
read off the transformers layers' code under `dflop.models.precision`'s contract: parameters and
the residual stream between layers are float32 under every ``model.dtype``; b = bytes of the
compute dtype (4 for float32; 2 for bfloat16, whose forwards run under autocast). Under autocast
the norms, rotary, residual adds and the loss compute in float32 (their inputs are float32), the
matmuls, convolutions and attention in bf16, and each matmul casts its activation input afresh
(autocast caches the casts of parameters only): a norm's float32 output read by k projections is
kept as k bf16 copies, where float32 keeps the one output. c below counts these inputs. Per token
of a layer (t = tensor-parallel degree: q, k, v, attention output and MLP are split; norms,
residuals and the column-parallel projections' inputs are replicated):

LLM decoder layer (Qwen2 / Llama; h hidden, I MLP width, H heads, Hkv kv heads, d head dim):
  none       2 (8 h + 4) + c b h + b (2 H d + 2 Hkv d + 4 I) / t + 4 H / t
             (per RMSNorm its float32 input, normalised input and reciprocal RMS; the projections'
             inputs: c = 2 in float32 (each norm's output, shared by the projections reading it),
             c = 5 under autocast (q, k, v, gate and up each keep a bf16 copy); query and key as
             the kernel gets them (b bytes: the packed attention function casts rotary's float32
             output), value, attention output; gate, up, SiLU and down input; float32 log-sum-exp
             of the attention kernel)
             + b H d / t when the packed row's samples differ in length and the per-sample SDPA
             path concatenates their outputs (the kernel's outputs and the concatenated copy are
             both kept)
             + 2 b (H - Hkv) d / t when the kernel gets key and value repeated to H heads (a
             `varlen_attn` without GQA, torch 2.11: `dflop.models.packing._varlen`)
  selective  none - 4 H / t - (the per-sample outputs b H d / t when concatenated, the repeated key
             and value 2 b (H - Hkv) d / t when repeated): the attention core keeps its inputs
             (checkpoint inputs: query, key and value, cast to b bytes before the checkpoint,
             `dflop.models.recompute`) and recomputes its repeats, output and log-sum-exp; the
             output projection still keeps its (concatenated or shared) input
  full       4 h (the layer input: the float32 residual stream)
  per stage with layers: rotary cos + sin 8 d per token (float32, the stream's dtype); selective
  and full also keep the int64 position ids and int32 cu_seqlens as checkpoint inputs (8 bytes per
  token + 4 (n + 1)).

Vision layer (S tokens per tile incl. CLS):
  SigLIP (LayerNorm)     none  2 (4 h + 8) + c b h + b (4 h + 2 I) / t + 4 H / t
  InternViT (LayerNorm)  none  SigLIP's + 2 b h (the two layer-scale products keep the attention
                         and MLP outputs)
  (per LayerNorm its float32 input and float32 mean + rstd; the projections' inputs: c = 2 in
  float32 (the two norms' outputs), c = 4 under autocast (q, k, v and fc1 each keep a bf16 copy);
  q, k, v, attention output; MLP hidden before and after the activation; float32 log-sum-exp)
  selective  none - 4 H / t (q, k and v reach the kernel as the projections made them, so the
             checkpoint keeps the same tensors; the attention output is the output projection's
             saved input, so only the log-sum-exp goes);  full  4 h (float32 layer input).
  Zero-head padding (a degree t that does not divide H: H' = `padded_vision_heads`, H' d wide
  q, k, v and attention output): the attention terms scale by H'/H, i.e. 4h -> 4h H'/H and
  H -> H' in the log-sum-exp; the MLP, norms and residuals do not change.
  InternViT with RMSNorm (InternViT-6B) and QK-norm are not modelled: `UserError`.

The parts around the layers (first and last stages; S image size, P patches per tile, n LLM tokens
per tile, V vocabulary; replicated under TP unless divided by t):
  vision embeddings  b 3 S^2 per tile (the pixels the patch convolution keeps, as it reads them:
                     autocast's bf16 copy; SigLIP's int64 position ids, 8 P, once per microbatch)
  projector          LLaVA-OV (Linear, GELU, Linear) per tile: P (b h_v + 2 b h / t) (its input as
                     the first Linear reads it, the GELU's input and output); InternVL (drop CLS,
                     pixel shuffle, LayerNorm, Linear, GELU, Linear): (4 + b) h_v P + 8 n + 2 b n h / t
                     (the norm's float32 input, its output as the Linear reads it, float32 mean +
                     rstd, the GELU's input and output)
  token embeddings   9 per token (the int64 ids the lookup keeps, the bool image-token mask)
  LM head + loss     8 h + 4 + b h + 4 V / t + 8 per token (the final RMSNorm as in the layers, the
                     LM head's input, the float32 log-softmax, the int64 label)

Not per token: under autocast each microbatch also keeps the bf16 copy of every matmul's and
convolution's weight (`dflop.costmodel.analytic.AUTOCAST_WEIGHT_MODULES`; the biases' copies are not
saved).

CPU and CUDA autocast list different ops (CUDA runs pow, rsqrt, layer_norm, softmax and log_softmax
in float32, CPU runs them in the input's dtype), but each such op here gets a float32 input either
way (the residual stream; the loss upcasts the logits), and both run matmuls, convolutions and SDPA
in bf16 and GELU/SiLU in their input's dtype: the forms are the same on both. Measured exactly
against the hooks on the tiny and small presets (float32 and bf16 autocast, CPU) by tests/costmodel,
and equal to the H200 profile's fitted coefficients (benchmarks/profiles/nvidia-h200: torch 2.11's
varlen kernel, so key and value repeated).

Transient bytes of the LM head + loss (what its forward + backward holds at its peak beyond what it
keeps, `dflop.costmodel.model.StageMemory`), per token and per microbatch:
  t = 1   8 V per token under float32 and bf16 alike: the loss's backward holds the gradient of the
          float32 log-probabilities and that of the logits beside the saved log-probabilities (the
          forward's logits and their float32 copy, 6 V in bf16 and 4 V in float32, are less);
  t > 1   (4 + (4 - b)) V / t per token: the vocabulary-parallel loss's forward holds the float32
          logits and their shifted copy (which it keeps) and, below float32, the head's b-byte
          logits it upcast (2 V / t more in bf16); its backward works in place;
  and 4 V h / t per microbatch: the weight's float32 gradient, made before it is added into the
  accumulated one. The two peaks come one after the other (the loss's backward, then the weight's);
  their sum bounds both, within the smaller of the two.
"""

from __future__ import annotations

from typing import Sequence

from transformers import PreTrainedConfig

from dflop.costmodel.memory import canonical_dtype
from dflop.errors import UserError
from dflop.models.architectures import architecture_of
from dflop.models.info import padded_vision_heads
from dflop.models.precision import Precision
from dflop.models.recompute import check_mode

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Bytes per element of the residual stream, the norms' statistics and rotary cos/sin under every
#: ``model.dtype`` (float32: `dflop.models.precision`).
STREAM_BYTES = Precision.of("float32").stream_dtype.itemsize
#: Linears reading each norm's output (LLM layer: q, k, v | gate, up; vision layer: q, k, v | fc1):
#: under autocast each keeps its own cast copy of it (module docstring, c).
_LLM_NORM_READERS, _VISION_NORM_READERS = 5, 4


def _mode(mode: str) -> str:
    return check_mode(mode, "activation bytes")


def _compute_bytes(dtype: str) -> tuple[int, bool]:
    """(b, autocast): bytes of the compute dtype `dtype` and whether it runs under autocast (below float32)."""
    b = DTYPE_BYTES[canonical_dtype(dtype)]
    return b, b < STREAM_BYTES


def _projection_inputs(dtype: str, norms: int, readers: int) -> float:
    """c b h / h (module docstring): the norms' outputs as the projections reading them keep them."""
    b, autocast = _compute_bytes(dtype)
    return float(b * (readers if autocast else norms))


def layer_input_bytes_per_token(hidden_size: int, dtype: str) -> float:
    """What a fully recomputed layer keeps per token: its input (replicated under TP), in the
    residual stream's dtype, float32 under every `dtype`."""
    canonical_dtype(dtype)
    return float(STREAM_BYTES * hidden_size)


def sequence_parallel_saving(hidden: int, tp: int, nbytes: int, mode: str = "none") -> float:
    """Activation bytes per token per decoder layer that sequence parallelism saves at TP degree `tp`.

    Modes none and selective: what SP shards along the sequence is what the two RMSNorms save for
    backward: per token their float32 input (4 h), the float32 normalised input before the weight
    (4 h) and the float32 reciprocal RMS (4), now for T/tp tokens per rank. Not saved less: the
    all-gathered norm output, which the column-parallel projections keep (DTensor does not re-gather
    it in backward as Megatron does; under autocast each keeps its bf16 copy), and the residual
    additions, which keep nothing. Mode full: the layer's checkpointed input is the rank's sequence
    shard, ``4 h`` per token for T/tp tokens.

    nbytes: the compute dtype's bytes; every tensor SP shards is float32 under each ``model.dtype``
    (`dflop.models.precision`), so it does not change the result."""
    if tp <= 1:
        return 0.0
    if _mode(mode) == "full":
        return STREAM_BYTES * hidden * (1 - 1 / tp)
    per_norm = 2 * STREAM_BYTES * hidden + 4
    return 2 * per_norm * (1 - 1 / tp)


def core_saving_per_token(num_heads: int, tp: int = 1) -> float:
    """What selective recomputation drops per token with a flash-style kernel whose output the
    output projection keeps anyway: the float32 log-sum-exp."""
    return 4.0 * num_heads / tp


def llm_layer_bytes_per_token(text_config: PreTrainedConfig, mode: str, dtype: str, *, tp: int = 1,
                              concatenated_output: bool = False, repeated_kv: bool = False) -> float:
    """Bytes one decoder layer keeps per token (module docstring). concatenated_output: the
    packed row's samples differ in length and run through per-sample SDPA (no flash-attn);
    repeated_kv: the kernel gets key and value repeated to the query heads (torch 2.11's varlen)."""
    b, _ = _compute_bytes(dtype)
    h, I = text_config.hidden_size, text_config.intermediate_size
    H, Hkv = text_config.num_attention_heads, text_config.num_key_value_heads
    d = getattr(text_config, "head_dim", None) or h // H
    if _mode(mode) == "full":
        return layer_input_bytes_per_token(h, dtype)
    out = b * H * d / tp
    repeats = 2 * b * (H - Hkv) * d / tp if repeated_kv else 0.0
    norms = 2 * (2 * STREAM_BYTES * h + 4)
    none = (norms + _projection_inputs(dtype, 2, _LLM_NORM_READERS) * h
            + b * (2 * H * d + 2 * Hkv * d + 4 * I) / tp + 4 * H / tp + repeats)
    if concatenated_output:
        none += out
    if mode == "none":
        return float(none)
    return float(none - core_saving_per_token(H, tp) - (out if concatenated_output else 0.0) - repeats)


def llm_stage_shared_bytes(text_config: PreTrainedConfig, seq_lens: Sequence[int], mode: str, dtype: str) -> float:
    """Bytes an LLM stage with layers keeps once, whatever its layer count (module docstring)."""
    canonical_dtype(dtype)
    d = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    tokens = sum(seq_lens)
    shared = 2 * STREAM_BYTES * d * tokens
    if _mode(mode) != "none":
        shared += 8 * tokens + 4 * (len(seq_lens) + 1)
    return float(shared)


def llm_stage_layer_bytes(text_config: PreTrainedConfig, seq_lens: Sequence[int], n_layers: int, mode: str,
                          dtype: str, *, tp: int = 1, flash_varlen: bool = False, repeated_kv: bool = False) -> float:
    """Bytes `n_layers` decoder layers of an LLM stage keep for one packed row of these samples
    (repeated_kv as `llm_layer_bytes_per_token`)."""
    if n_layers == 0:
        return 0.0
    concatenated = not flash_varlen and len(set(int(n) for n in seq_lens)) > 1
    per_token = llm_layer_bytes_per_token(text_config, mode, dtype, tp=tp, concatenated_output=concatenated,
                                          repeated_kv=repeated_kv)
    return n_layers * per_token * sum(seq_lens) + llm_stage_shared_bytes(text_config, seq_lens, mode, dtype)


def vision_layer_bytes_per_token(config: PreTrainedConfig, mode: str, dtype: str, *, tp: int = 1) -> float:
    """Bytes one vision layer keeps per token at TP degree `tp`, heads zero-padded to a multiple of
    it where they do not divide (module docstring); `config` is the multimodal config."""
    b, _ = _compute_bytes(dtype)
    vc = config.vision_config
    h, I, H = vc.hidden_size, vc.intermediate_size, vc.num_attention_heads
    padded = padded_vision_heads(config, tp)
    if _mode(mode) == "full":
        return layer_input_bytes_per_token(h, dtype)
    family = architecture_of(config).vision_family
    if family == "internvit" and (getattr(vc, "norm_type", "layer_norm") != "layer_norm" or getattr(vc, "use_qk_norm", False)):
        raise UserError("activation bytes: InternViT with RMSNorm or QK-norm is not modelled (layer_norm towers only)")
    norms = 2 * (STREAM_BYTES * h + 8)
    layer_scale = 2 * b * h if family == "internvit" else 0.0
    none = (norms + _projection_inputs(dtype, 2, _VISION_NORM_READERS) * h + layer_scale
            + b * (4 * h * padded / H + 2 * I) / tp + 4 * padded / tp)
    return float(none if mode == "none" else none - core_saving_per_token(padded, tp))


def vision_stage_layer_bytes(config: PreTrainedConfig, n_tiles: int, n_layers: int, mode: str, dtype: str, *,
                             tp: int = 1) -> float:
    """Bytes `n_layers` vision layers keep for `n_tiles` tiles."""
    tokens = n_tiles * architecture_of(config).layer_tokens_per_tile(config)
    return n_layers * tokens * vision_layer_bytes_per_token(config, mode, dtype, tp=tp)


def vision_embed_bytes(config: PreTrainedConfig, dtype: str) -> tuple[float, float]:
    """(bytes per tile, bytes per microbatch) the vision embeddings keep (module docstring)."""
    vc = config.vision_config
    size = vc.image_size[0] if isinstance(vc.image_size, (tuple, list)) else vc.image_size
    const = 8.0 * (size // vc.patch_size) ** 2 if architecture_of(config).vision_family == "siglip" else 0.0
    return float(DTYPE_BYTES[canonical_dtype(dtype)] * 3 * size * size), const


def projector_bytes_per_tile(config: PreTrainedConfig, dtype: str, *, tp: int = 1) -> float:
    """Bytes the projector keeps per tile (module docstring); `config` is the multimodal config."""
    b, _ = _compute_bytes(dtype)
    arch = architecture_of(config)
    hv, h = config.vision_config.hidden_size, config.get_text_config().hidden_size
    n = arch.llm_tokens_per_tile(config)
    if arch.vision_family == "internvit":
        patches = arch.layer_tokens_per_tile(config) - 1  # the CLS token is dropped
        return float((STREAM_BYTES + b) * hv * patches + 8 * n + 2 * b * n * h / tp)
    return float(arch.layer_tokens_per_tile(config) * (b * hv + 2 * b * h / tp))


#: What the token embedding keeps per token: the int64 ids and the bool image-token mask.
LLM_EMBED_BYTES_PER_TOKEN = 9.0


def llm_head_bytes_per_token(text_config: PreTrainedConfig, dtype: str, *, tp: int = 1) -> float:
    """Bytes the final norm, LM head and cross-entropy keep per token (module docstring)."""
    b, _ = _compute_bytes(dtype)
    h = text_config.hidden_size
    return float(2 * STREAM_BYTES * h + 4 + b * h + 4 * text_config.vocab_size / tp + 8)


def llm_head_transient_bytes(text_config: PreTrainedConfig, dtype: str, *, tp: int = 1) -> tuple[float, float]:
    """(bytes per token, bytes per microbatch) the final norm, LM head and loss hold beyond what they
    keep (module docstring)."""
    V, h = text_config.vocab_size, text_config.hidden_size
    b, _ = _compute_bytes(dtype)
    return (8.0 if tp == 1 else 4.0 + (4 - b)) * V / tp, 4.0 * V * h / tp
