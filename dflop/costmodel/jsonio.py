"""The cost-model JSON format (never pickle): coefficients, feature spec and provenance.

Layout (``version`` 1)::

    {
      "format": "dflop-costmodel", "version": 1,
      "units": {"fwd_ms": "milliseconds", "bwd_ms": "milliseconds", "act_bytes": "bytes", ...},
      "provenance": {"preset": ..., "device": ..., "dtype": "float32", "profile": "...parquet",
                     "profile_sha256": ..., "n_profile_rows": ..., "created": ..., "dflop_version": ...},
      "modules": [
        {"module": "llm_layer", "tp": 1, "features": ["tokens", "tokens_pow1.5", "sq_tokens", "const"],
         "coef": {"fwd_ms": [...], "bwd_ms": [...], "act_bytes": [...]},
         "param_bytes": 3.1e6, "n_shapes": 24, "profiled_batch": [1, 8], "profiled_seq_len": [16, 2048]},
        ...
      ],
      "step_costs": {"optimizer": {"const_s": ..., "per_byte_s": ...}, "optimizer_call_s": ...,
                     "allreduce": [{"ranks": 2, "const_s": ..., "per_byte_s": ...}, ...],
                     "p2p": {"const_s": ..., "per_byte_s": ...},
                     "loading": {"features": ["const", "n_tiles", "n_frames", "n_images", "text_tokens",
                                              "media_pixels"],
                                 "coef_s": [...], "n_samples": ...}}
    }

``step_costs`` (optional; each entry optional) are the measured costs of a step outside the
modules (`dflop.costmodel.model.StepCosts`): seconds of an operation on n bytes are
``const_s + n * per_byte_s`` (seconds, so the file round-trips exactly); ``loading`` is one
sample's load on the host, ``coef_s @ features`` of its shape (`dflop.costmodel.model.LoadLine`).

A module's prediction for a target is ``coef[target] @ features`` where the features of a set of
samples are defined in `dflop.costmodel.features` (``tokens`` = sum of lengths, ``tokens_pow1.5``
= sum of lengths**1.5, ``sq_tokens`` = sum of squared lengths, ``cpu_attn_pairs`` /
``cpu_attn_blocks`` = sum of the query-key pairs / key-block calls the CPU flash-attention kernel
runs per sample (CPU profiles only), ``tiles`` = sum of tiles, ``const`` = 1). Layer modules are
per layer; a module's feature list is one of `dflop.costmodel.features.allowed_features`. Layer
modules may also carry ``bwd_ms:<mode>`` / ``act_bytes:<mode>`` for recompute selective / full.
Any module may carry ``transient_bytes`` (what its forward + backward holds at its peak beyond what
it saves; one layer's for layer modules, and ``transient_bytes:<mode>`` per recompute mode): a
model without any (written before they were fitted) prices them 0, and `load_cost_model` says so.
``llm_head`` may carry ``tied_param_bytes``: its bytes that are the token embedding's (a model with
tied embeddings), counted once on a stage holding both (absent: 0). A module may carry
``optimizer_s``: its optimizer step's seconds beyond ``step_costs.optimizer_call_s``
(`dflop.costmodel.model.ModuleCosts.optimizer_s`; absent: not measured, the bytes line prices it).
Floats are written with Python's shortest round-trip repr, so a loaded model predicts bit-identically;
NaN and infinities are never written and refused on reading (`dflop.finite`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jsonschema

from dflop.costmodel.features import FEATURE_NAMES, MODULE_FEATURES, allowed_features
from dflop.costmodel.model import (LOAD_FEATURES, OPTIONAL_TARGETS, TARGETS, BytesLine, CostModel, LoadLine, ModuleCosts,
                                  Provenance, StepCosts)
from dflop.errors import UserError
from dflop.finite import check_finite_document
from dflop.io import write_text_atomic

log = logging.getLogger(__name__)

FORMAT_NAME = "dflop-costmodel"
FORMAT_VERSION = 1

UNITS = {"fwd_ms": "milliseconds", "bwd_ms": "milliseconds", "act_bytes": "bytes", "transient_bytes": "bytes",
         "param_bytes": "bytes"}

_coefficients = {"type": "array", "items": {"type": "number", "minimum": 0}}
_range = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}

_line = {"type": "object", "required": ["const_s", "per_byte_s"],
         "properties": {"const_s": {"type": "number", "minimum": 0}, "per_byte_s": {"type": "number", "minimum": 0}},
         "additionalProperties": False}

SCHEMA = {
    "type": "object",
    "required": ["format", "version", "provenance", "modules"],
    "properties": {
        "step_costs": {
            "type": "object",
            "properties": {
                "optimizer": _line,
                "optimizer_call_s": {"type": "number", "minimum": 0},
                "p2p": _line,
                "loading": {"type": "object", "required": ["features", "coef_s", "n_samples"],
                            "properties": {"features": {"const": list(LOAD_FEATURES)},
                                           "coef_s": {**_coefficients, "minItems": len(LOAD_FEATURES),
                                                      "maxItems": len(LOAD_FEATURES)},
                                           "n_samples": {"type": "integer", "minimum": 0}},
                            "additionalProperties": False},
                "allreduce": {"type": "array", "items": {
                    "type": "object", "required": ["ranks", "const_s", "per_byte_s"],
                    "properties": {"ranks": {"type": "integer", "minimum": 2}, **_line["properties"]},
                    "additionalProperties": False}},
            },
            "additionalProperties": False,
        },
        "format": {"const": FORMAT_NAME},
        "version": {"const": FORMAT_VERSION},
        "units": {"type": "object"},
        "provenance": {
            "type": "object",
            "required": ["preset", "device", "dtype"],
            "properties": {
                "preset": {"type": ["string", "null"]},
                "device": {"type": "string"},
                "dtype": {"type": "string"},
                "profile": {"type": "string"},
                "profile_sha256": {"type": "string"},
                "n_profile_rows": {"type": "integer", "minimum": 0},
                "created": {"type": "string"},
                "dflop_version": {"type": "string"},
            },
            "additionalProperties": False,
        },
        "modules": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["module", "tp", "features", "coef", "param_bytes"],
                "properties": {
                    "module": {"enum": list(MODULE_FEATURES)},
                    "tp": {"type": "integer", "minimum": 1},
                    "features": {"type": "array", "items": {"enum": list(FEATURE_NAMES)}, "minItems": 1},
                    "coef": {
                        "type": "object",
                        "required": list(TARGETS),
                        "properties": {t: _coefficients for t in TARGETS + OPTIONAL_TARGETS},
                        "additionalProperties": False,
                    },
                    "param_bytes": {"type": "number", "minimum": 0},
                    "tied_param_bytes": {"type": "number", "minimum": 0},
                    "optimizer_s": {"type": "number", "minimum": 0},
                    "n_shapes": {"type": "integer", "minimum": 0},
                    "profiled_batch": _range,
                    "profiled_seq_len": _range,
                },
                "additionalProperties": False,
            },
        },
    },
}


def cost_model_to_dict(model: CostModel) -> dict:
    """The JSON-ready dict of `model` (layout in the module docstring)."""
    p = model.provenance
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "units": UNITS,
        "provenance": {
            "preset": p.preset, "device": p.device, "dtype": p.dtype, "profile": p.profile,
            "profile_sha256": p.profile_sha256, "n_profile_rows": p.n_profile_rows,
            "created": p.created, "dflop_version": p.dflop_version,
        },
        "modules": [
            {
                "module": m.module,
                "tp": m.tp,
                "features": list(m.features),
                "coef": {t: [float(c) for c in m.coef[t]] for t in TARGETS + OPTIONAL_TARGETS if t in m.coef},
                "param_bytes": float(m.param_bytes),
                **({"tied_param_bytes": float(m.tied_param_bytes)} if m.tied_param_bytes else {}),
                **({"optimizer_s": float(m.optimizer_s)} if m.optimizer_s is not None else {}),
                "n_shapes": m.n_shapes,
                "profiled_batch": [int(v) for v in m.profiled_batch],
                "profiled_seq_len": [int(v) for v in m.profiled_seq_len],
            }
            for m in sorted(model.modules.values(), key=lambda m: (m.module, m.tp))
        ],
        **({"step_costs": _step_costs_to_dict(model.step_costs)} if _has_step_costs(model.step_costs) else {}),
    }


def _has_step_costs(costs: StepCosts) -> bool:
    return (costs.optimizer is not None or costs.p2p is not None or bool(costs.allreduce)
            or costs.loading is not None or costs.optimizer_call_s is not None)


def _line_to_dict(line: BytesLine) -> dict:
    return {"const_s": float(line.const_s), "per_byte_s": float(line.per_byte_s)}


def _line_from_dict(entry: dict) -> BytesLine:
    return BytesLine(float(entry["const_s"]), float(entry["per_byte_s"]))


def _step_costs_to_dict(costs: StepCosts) -> dict:
    out = {}
    if costs.optimizer is not None:
        out["optimizer"] = _line_to_dict(costs.optimizer)
    if costs.optimizer_call_s is not None:
        out["optimizer_call_s"] = float(costs.optimizer_call_s)
    if costs.allreduce:
        out["allreduce"] = [{"ranks": ranks, **_line_to_dict(line)} for ranks, line in sorted(costs.allreduce.items())]
    if costs.p2p is not None:
        out["p2p"] = _line_to_dict(costs.p2p)
    if costs.loading is not None:
        out["loading"] = {"features": list(LOAD_FEATURES), "coef_s": [float(c) for c in costs.loading.coef],
                          "n_samples": int(costs.loading.n_samples)}
    return out


def _step_costs_from_dict(data: dict, source: str) -> StepCosts:
    ranks = [int(e["ranks"]) for e in data.get("allreduce", [])]
    if len(set(ranks)) < len(ranks):
        raise UserError(f"{source}: step_costs/allreduce lists a group size twice: {sorted(ranks)}")
    return StepCosts(optimizer=_line_from_dict(data["optimizer"]) if "optimizer" in data else None,
                     allreduce={int(e["ranks"]): _line_from_dict(e) for e in data.get("allreduce", [])},
                     p2p=_line_from_dict(data["p2p"]) if "p2p" in data else None,
                     optimizer_call_s=float(data["optimizer_call_s"]) if "optimizer_call_s" in data else None,
                     loading=(LoadLine(tuple(float(c) for c in data["loading"]["coef_s"]), int(data["loading"]["n_samples"]))
                              if "loading" in data else None))


def cost_model_from_dict(data: object, *, source: str = "cost model") -> CostModel:
    """Check `data` against the format and build the model; errors name the source and the key."""
    if isinstance(data, dict) and data.get("format") == FORMAT_NAME and data.get("version") != FORMAT_VERSION:
        raise UserError(
            f"{source}: cost model format version {data.get('version')!r} is not supported "
            f"(this dflop reads version {FORMAT_VERSION}); re-run `dflop fit`"
        )
    check_finite_document(data, source)  # the schema's "minimum": 0 lets NaN through
    try:
        jsonschema.validate(data, SCHEMA)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(k) for k in exc.absolute_path) or "top level"
        raise UserError(f"{source}: invalid cost model at {where}: {exc.message}") from None
    modules = []
    for i, entry in enumerate(data["modules"]):
        features = tuple(entry["features"])
        expected = allowed_features(entry["module"])
        if features not in expected:
            raise UserError(
                f"{source}: modules/{i} ({entry['module']}) has features {list(features)}, "
                f"expected {' or '.join(str(list(e)) for e in expected)}"
            )
        tied = entry.get("tied_param_bytes", 0.0)
        if tied and (entry["module"] != "llm_head" or tied > entry["param_bytes"]):
            raise UserError(f"{source}: modules/{i}/tied_param_bytes ({tied:g}) must be on llm_head and at most "
                            f"its param_bytes ({entry['param_bytes']:g}); {entry['module']} has it")
        for target in (t for t in TARGETS + OPTIONAL_TARGETS if t in entry["coef"]):
            if len(entry["coef"][target]) != len(features):
                raise UserError(
                    f"{source}: modules/{i}/coef/{target} has {len(entry['coef'][target])} "
                    f"coefficients for {len(features)} features"
                )
        modules.append(ModuleCosts(
            module=entry["module"],
            tp=int(entry["tp"]),
            features=features,
            coef={t: tuple(float(c) for c in entry["coef"][t]) for t in TARGETS + OPTIONAL_TARGETS
                  if t in entry["coef"]},
            param_bytes=float(entry["param_bytes"]),
            tied_param_bytes=float(entry.get("tied_param_bytes", 0.0)),
            optimizer_s=float(entry["optimizer_s"]) if "optimizer_s" in entry else None,
            n_shapes=int(entry.get("n_shapes", 0)),
            profiled_batch=tuple(entry.get("profiled_batch", (0, 0))),
            profiled_seq_len=tuple(entry.get("profiled_seq_len", (0, 0))),
        ))
    return CostModel(modules, Provenance(**data["provenance"]), _step_costs_from_dict(data.get("step_costs", {}), source))


def save_cost_model(model: CostModel, path: str | Path) -> None:
    """Write `model` to `path` as JSON, atomically (temporary file, then rename)."""
    text = json.dumps(cost_model_to_dict(model), indent=1, allow_nan=False) + "\n"
    write_text_atomic(path, text)


def load_cost_model(path: str | Path) -> CostModel:
    """Read a cost model JSON written by `save_cost_model`; a model without transient bytes is
    logged once here (its stages' peaks are then state + in-flight activations only)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: cost model not found (run `dflop fit` first)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    model = cost_model_from_dict(data, source=str(path))
    if not model.has_transients:
        log.warning("%s: no transient_bytes (fitted before they were measured): a stage's peak memory is priced "
                    "as its training state and in-flight activations only, without what a module holds beyond "
                    "them (the LM head's logits and loss gradients); refit it with `dflop fit`", path)
    return model
