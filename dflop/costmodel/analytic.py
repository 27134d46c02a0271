"""A cost model from FLOP counts, for planning GPU clusters before any GPU profile exists.

The what-if question ("how fast on 512 H100s?") comes before GPU hours are bought, so there is
no GPU profile to fit. This module writes the same `CostModel` the fitted one is, from the model's
shapes and a stated achieved throughput:

- time of an op = FLOPs / ``achieved_tflops`` + tensor-parallel all-reduces (ring, intra-node
  ``tp_gbps``) + ``op_overhead_ms`` per layer per microbatch (kernel launches); backward = 2 x
  forward FLOPs and the same all-reduces;
- FLOPs (forward, per rank at TP degree t; P = parameters of the part, h = hidden size):
  vision layer per tile of T tokens ``(2 P T + 4 T^2 h) / t`` (bidirectional attention);
  vision embeddings and projector ``2 P T / t``; LLM layer per sample of s tokens
  ``(2 P s + 2 h s^2) / t`` (causal attention inside the sample: QK^T and AV, halved);
  LM head ``2 h V s / t``; token embeddings: a lookup, charged as memory traffic
  ``2 h s`` bytes at ``hbm_gbps``;
- TP communication (Megatron): 2 all-reduces of the layer output per forward and 2 per backward,
  ``2 (t-1)/t * bytes / tp_gbps`` each. Sequence parallelism replaces each all-reduce by a
  reduce-scatter + an all-gather of the same total traffic (a ring all-reduce is exactly those
  two), so the term is the same with and without it;
- activation bytes kept for the backward (no recomputation, no sequence parallelism; flash
  attention: no concatenated per-sample outputs): the closed forms of `dflop.costmodel.activations`
  for every part (layers, embeddings, projector, LM head + loss), held against saved-tensor hooks
  there; a vision tower they do not model (InternViT-6B: RMSNorm, QK-norm) gets the first-order
  ``b (4 h + (6 h + 3 I) / t)`` per token per layer (I = MLP width). Not in the model: what an LLM
  stage keeps once whatever its layer count (rotary cos/sin, `activations.llm_stage_shared_bytes`).
  Sequence parallelism (LLM layers, t > 1) is priced per plan by the cost model
  (`dflop.costmodel.activations.sequence_parallel_saving`);
- activation recomputation (``recompute``, per stage): ``full`` keeps the layer input ``4 h`` per
  token (the float32 residual stream) and its backward runs the layer's forward again (FLOPs, TP
  all-reduces, overhead) up to the last tensor backward needs: torch's checkpoint stops early, so
  the LLM's and SigLIP's MLP down projection (``2 h I / t`` per token) and its all-reduce are not
  rerun (InternViT's layer scale keeps that output, so its whole layer is);
  ``selective`` recomputes the attention core (``4 T^2 h / t`` per tile, ``2 h s^2 / t`` per
  sample) and keeps what none keeps less the core's float32 log-sum-exp ``4 H / t`` per token
  (`dflop.costmodel.activations`; with flash attention the core's output stays, as the output
  projection's input);
- transient bytes (what a module holds at its peak beyond what it keeps): the LM head + loss's
  closed form (`activations.llm_head_transient_bytes`: its float32 loss gradients and the weight's
  gradient), 0 for the other modules in mode none; a recomputed layer's is what its mode no longer
  keeps, held again while its backward reruns the forward (`CostModel`'s rule for a missing mode);
- parameters: the model's exact counts (`dflop.models.info`) x 4 bytes / t (float32 master
  weights under every ``dtype``, `dflop.models.precision`); with bfloat16 each microbatch also keeps
  autocast's bf16 copy of every matmul's weights (``2 P / t``, a per-microbatch constant of the
  activations, dropped by full recomputation);
- zero-head padding: at a TP degree t that does not divide the vision heads H, the tower is priced
  as the padded one the runtime trains (H' = `dflop.models.info.padded_vision_heads`, NVIDIA's
  recipe for InternViT-6B: 25 -> 32 at TP 8): its attention part grows by H'/H — q/k/v/o
  parameters (`ModelInfo.padded_vision_layer_params`, so also their FLOPs ``2 P T``, gradients
  and optimizer state), the core ``4 T^2 h H'/H``, and the attention activations (q, k, v, output:
  ``6 h -> 6 h H'/H`` in the first-order form, the closed forms as in `activations`); the MLP,
  norms, embeddings, projector and TP all-reduces (of the h-wide layer output) stay.

It is a first-order model (no kernel efficiency curves, no overlap of TP communication); use a
fitted GPU profile when one exists. Defaults: an H100 SXM at ~40% of its 989 dense bf16 TFLOP/s.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from dflop.costmodel import activations
from dflop.costmodel.features import MODULE_FEATURES
from dflop.costmodel.memory import canonical_dtype, training_state_bytes
from dflop.costmodel.model import CostModel, ModuleCosts, Provenance
from dflop.errors import UserError
from dflop.models.architectures import architecture_of
from dflop.models.info import ModelInfo, info_of, padded_vision_heads

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Modules whose matmuls / convolutions autocast runs in bf16, keeping a bf16 copy of their weights
#: per microbatch until its backward (the token embedding is a lookup: no copy).
AUTOCAST_WEIGHT_MODULES = frozenset({"vision_embed", "vision_layer", "projector", "llm_layer", "llm_head"})


def analytic_cost_model(config: PreTrainedConfig, *, tp_degrees=(1, 2, 4, 8), achieved_tflops: float = 400.0,
                        tp_gbps: float = 300.0, hbm_gbps: float = 2000.0, op_overhead_ms: float = 0.03,
                        dtype: str = "bfloat16", preset: str | None = None,
                        info: ModelInfo | None = None) -> CostModel:
    """The FLOP-count `CostModel` of the model `config` describes (module docstring) at every TP
    degree in `tp_degrees`.

    achieved_tflops: sustained dense TFLOP/s per GPU; tp_gbps: TP all-reduce bandwidth (GB/s);
    hbm_gbps: memory bandwidth for the embedding lookup; op_overhead_ms: fixed milliseconds per
    layer (or part) per microbatch, forward and backward; preset: the ``arch/vision/llm`` name
    recorded as its provenance; info: `info_of(config)` where the caller holds it already
    (`ModelHandle.info`: counting builds the model on the meta device again). Sequence parallelism
    is priced per plan (`CostModel.llm_stage_terms(..., sequence_parallel_hidden=)`), not baked in here.
    """
    info = info_of(config) if info is None else info
    arch = architecture_of(config)
    flops_per_ms = achieved_tflops * 1e12 / 1e3
    nbytes = _DTYPE_BYTES[canonical_dtype(dtype)]  # compute dtype: activations
    param_nbytes = training_state_bytes(dtype).param  # float32 master weights (dflop.models.precision)
    mixed = nbytes != param_nbytes
    text = config.get_text_config()
    vision_mlp, llm_mlp = config.vision_config.intermediate_size, text.intermediate_size
    heads_v, heads_l = config.vision_config.num_attention_heads, text.num_attention_heads
    T, hv, hl, V = info.vision_tokens_per_tile, info.vision_hidden, info.llm_hidden, info.vocab_size
    modules = []
    for t in tp_degrees:
        padded_v = padded_vision_heads(config, t)
        attn_scale = padded_v / heads_v  # the attention part of the padded vision tower (docstring)
        vision_layer_params = info.padded_vision_layer_params(padded_v)
        def allreduce_ms(bytes_per_unit: float) -> float:
            return 0.0 if t == 1 else 2 * (t - 1) / t * bytes_per_unit / (tp_gbps * 1e9) * 1e3

        def act_layer(closed_form, h: int, inter: int, heads: int, scale: float = 1.0) -> dict[str, float]:
            """Bytes per token kept under recompute none and selective."""
            try:
                return {mode: closed_form(mode) for mode in ("none", "selective")}
            except UserError:  # a tower the closed forms do not model (InternViT-6B): first-order estimate
                none = nbytes * (4 * h + (6 * h * scale + 3 * inter) / t)
                return {"none": none, "selective": none - activations.core_saving_per_token(heads, t)}

        vision_act = act_layer(lambda mode: activations.vision_layer_bytes_per_token(config, mode, dtype, tp=t),
                               hv, vision_mlp, padded_v, attn_scale)
        llm_act = act_layer(lambda mode: activations.llm_layer_bytes_per_token(text, mode, dtype, tp=t), hl, llm_mlp,
                            heads_l)
        embed_tile, embed_const = activations.vision_embed_bytes(config, dtype)
        parts = {
            # (forward FLOPs per unit, forward TP comm ms per unit, activation bytes per unit, params)
            "vision_embed": ({"tiles": 2 * info.vision_embed_params * T / t}, 0.0,
                             {"tiles": embed_tile, "const": embed_const},
                             info.vision_embed_params),
            "vision_layer": ({"tiles": (2 * vision_layer_params * T + 4 * T * T * hv * attn_scale) / t},
                             2 * allreduce_ms(nbytes * T * hv), {"tiles": T * vision_act["none"]},
                             vision_layer_params),
            "projector": ({"tiles": 2 * info.projector_params * T / t}, allreduce_ms(nbytes * T * hl),
                          {"tiles": activations.projector_bytes_per_tile(config, dtype, tp=t)}, info.projector_params),
            "llm_embed": ({}, 0.0, {"tokens": activations.LLM_EMBED_BYTES_PER_TOKEN}, info.llm_embed_params),
            "llm_layer": ({"tokens": 2 * info.llm_layer_params / t, "sq_tokens": 2 * hl / t},
                          2 * allreduce_ms(nbytes * hl), {"tokens": llm_act["none"]},
                          info.llm_layer_params),
            "llm_head": ({"tokens": 2 * hl * V / t}, allreduce_ms(4),
                         {"tokens": activations.llm_head_bytes_per_token(text, dtype, tp=t)},
                         info.llm_head_params),
        }
        for name, (flops, comm_ms, act, params) in parts.items():
            features = MODULE_FEATURES[name][1]
            if mixed and name in AUTOCAST_WEIGHT_MODULES:  # each microbatch's bf16 copy of the weights
                act = dict(act, const=act.get("const", 0.0) + nbytes * params / t)
            unit = "tiles" if "tiles" in features else "tokens"
            fwd = {f: v / flops_per_ms for f, v in flops.items()}
            bwd = {f: 2 * v for f, v in fwd.items()}
            if name == "llm_embed":  # lookup: memory traffic, not FLOPs
                fwd[unit] = bwd[unit] = nbytes * hl / (hbm_gbps * 1e9) * 1e3
            fwd[unit] = fwd.get(unit, 0.0) + comm_ms
            bwd[unit] = bwd.get(unit, 0.0) + comm_ms
            fwd["const"] = bwd["const"] = op_overhead_ms
            transient = {}
            if name == "llm_head":
                per_token, per_microbatch = activations.llm_head_transient_bytes(text, dtype, tp=t)
                transient = {"tokens": per_token, "const": per_microbatch}
            targets = [("fwd_ms", fwd), ("bwd_ms", bwd), ("act_bytes", act), ("transient_bytes", transient)]
            if name in ("vision_layer", "llm_layer"):
                vision = name == "vision_layer"
                # the trailing MLP down projection early-stopping recomputation skips (docstring)
                skipped = 0.0 if vision and arch.vision_family == "internvit" else 1.0
                skipped_ms = skipped * (2 * (hv * vision_mlp * T if vision else hl * llm_mlp) / t / flops_per_ms
                                        + comm_ms / 2)
                selective = T * vision_act["selective"] if vision else llm_act["selective"]
                targets += _recompute_targets(name, fwd, bwd, act, dtype, hv if vision else hl, selective, T, t,
                                              flops_per_ms, skipped_ms, attn_scale if vision else 1.0)
            coef = {target: tuple(float(values.get(f, 0.0)) for f in features) for target, values in targets}
            tied = info.llm_embed_params if name == "llm_head" and info.tied_embeddings else 0
            modules.append(ModuleCosts(name, int(t), features, coef, float(params * param_nbytes / t), 0, (1, 1),
                                       (1, 1), tied_param_bytes=float(tied * param_nbytes / t)))
    return CostModel(modules, Provenance(preset=preset or info.arch, device=f"analytic {achieved_tflops:g} TFLOP/s",
                                         dtype=dtype))


def _recompute_targets(name, fwd, bwd, act, dtype, h, kept_selective, tiles_tokens, t, flops_per_ms, skipped_ms,
                       attn_scale=1.0):
    """``bwd_ms:<mode>`` and ``act_bytes:<mode>`` of a layer module (module docstring); kept_selective:
    activation bytes per unit under selective recomputation; skipped_ms: forward milliseconds per unit
    that early-stopping recomputation does not rerun; attn_scale: padded / real heads (the attention
    core's width)."""
    unit = "tiles" if name == "vision_layer" else "tokens"
    per_unit = tiles_tokens if unit == "tiles" else 1  # tokens per feature unit
    full_bwd = {f: bwd.get(f, 0.0) + fwd.get(f, 0.0) for f in set(bwd) | set(fwd)}
    full_bwd[unit] -= skipped_ms
    core_fwd = ({"tiles": 4 * tiles_tokens**2 * h * attn_scale / t / flops_per_ms} if unit == "tiles"
                else {"sq_tokens": 2 * h / t / flops_per_ms})
    selective_bwd = {f: bwd.get(f, 0.0) + core_fwd.get(f, 0.0) for f in set(bwd) | set(core_fwd)}
    kept_full = activations.layer_input_bytes_per_token(h, dtype) * per_unit
    return [("bwd_ms:selective", selective_bwd), ("act_bytes:selective", {unit: kept_selective, "const": act.get("const", 0.0)}),
            ("bwd_ms:full", full_bwd), ("act_bytes:full", {unit: kept_full})]
