"""`batch_costs`: one global batch's per-sample, per-stage costs for the scheduler (`BatchCosts`).

Because every fitted cost is a constant plus a sum of per-sample terms, the arrays returned here
reproduce `CostModel.vision_stage_time` / `llm_stage_time` / `*_stage_memory` for any grouping of
the samples into microbatches and bins.

Layouts:
- disjoint (default): ``pp_v`` vision stages then ``pp_l`` LLM stages, each on its own GPUs;
  ``in_flight_per_stage`` has ``pp_v + pp_l`` entries, vision stages first.
- colocated (``colocated=True``): the whole vision tower runs on LLM stage 0.
  ``vision_layers_per_stage`` is a single entry (all vision layers); the vision arrays of the
  result have 0 stages and LLM stage 0 carries the vision terms, constants, activations and
  training state; ``in_flight_per_stage`` has ``pp_l`` entries.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

import numpy as np

from dflop.costmodel.types import BatchCosts
from dflop.errors import UserError

if TYPE_CHECKING:
    from dflop.costmodel.model import CostModel, StageTerms


def batch_costs(
    model: "CostModel",
    n_tiles: Sequence[int],
    seq_len: Sequence[int],
    *,
    vision_layers_per_stage: Sequence[int],
    llm_layers_per_stage: Sequence[int],
    tp_v: int,
    tp_l: int,
    mem_limit_bytes: float,
    in_flight_per_stage: Sequence[int],
    colocated: bool = False,
    vision_recompute: Sequence[str] | None = None,
    llm_recompute: Sequence[str] | None = None,
    vision_shard_over: int = 1,
    llm_shard_over: int = 1,
    llm_sequence_parallel_hidden: int = 0,
) -> BatchCosts:
    """Per-sample costs of n samples on every stage of a layout.

    n_tiles: [n] tiles each sample sends through the vision tower (0 for text-only samples);
    seq_len: [n] tokens each sample occupies in the packed LLM sequence;
    vision_layers_per_stage / llm_layers_per_stage: layers on each stage (first stage holds the
        embeddings, last the projector / head);
    mem_limit_bytes: usable memory of one GPU (``inf`` for no limit);
    in_flight_per_stage: microbatches each stage holds at its peak under the schedule
        (`dflop.plan.Layout.in_flight`; a fraction under interleaving);
    vision_recompute / llm_recompute: each stage's recompute mode (None: none everywhere);
    vision_shard_over / llm_shard_over: data-parallel replicas each module's optimizer state is
        sharded over (1: not sharded; `dflop.plan.Techniques`);
    llm_sequence_parallel_hidden: the LLM's hidden size when it runs sequence-parallel, else 0
        (`CostModel.llm_stage_terms`).

    Each stage's memory limit in the result is ``(mem_limit_bytes - training state - transient
    constant) / in_flight - per-microbatch activation constant``: the bytes one microbatch's
    per-sample memory (activations and transient share, `BatchCosts.llm_mem_bytes`) may use. It is
    negative when the training state alone does not fit.
    """
    tiles = np.asarray(n_tiles).reshape(-1)
    lens = np.asarray(seq_len).reshape(-1)
    if len(tiles) != len(lens):
        raise UserError(f"n_tiles has {len(tiles)} samples but seq_len has {len(lens)}")
    pp_v, pp_l = len(vision_layers_per_stage), len(llm_layers_per_stage)
    if pp_l < 1:
        raise UserError("llm_layers_per_stage needs at least one stage")
    if colocated and pp_v != 1:
        raise UserError(
            f"colocated placement puts the whole vision tower on LLM stage 0: vision_layers_per_stage "
            f"must have one entry, got {pp_v}"
        )
    if not colocated and pp_v < 1:
        raise UserError("vision_layers_per_stage needs at least one stage (or pass colocated=True)")
    n_in_flight = pp_l if colocated else pp_v + pp_l
    if len(in_flight_per_stage) != n_in_flight:
        layout = "colocated: pp_l" if colocated else "disjoint: pp_v + pp_l"
        raise UserError(
            f"in_flight_per_stage has {len(in_flight_per_stage)} entries, expected {n_in_flight} ({layout})"
        )

    vision_modes = list(vision_recompute) if vision_recompute is not None else ["none"] * pp_v
    llm_modes = list(llm_recompute) if llm_recompute is not None else ["none"] * pp_l
    if len(vision_modes) != pp_v or len(llm_modes) != pp_l:
        raise UserError(f"recompute modes {vision_modes} / {llm_modes} do not match {pp_v} vision and {pp_l} LLM stages")
    vision = [
        model.vision_stage_terms(tiles, n_layers=layers, first=k == 0, last=k == pp_v - 1, tp=tp_v,
                                 recompute=vision_modes[k], shard_over=vision_shard_over)
        for k, layers in enumerate(vision_layers_per_stage)
    ]
    llm = [
        model.llm_stage_terms(lens, n_layers=layers, first=j == 0, last=j == pp_l - 1, tp=tp_l,
                              recompute=llm_modes[j], shard_over=llm_shard_over,
                              sequence_parallel_hidden=llm_sequence_parallel_hidden)
        for j, layers in enumerate(llm_layers_per_stage)
    ]
    if colocated:
        llm[0] = _merge(vision[0], llm[0])
        vision = []
        vision_in_flight: Sequence[int] = []
        llm_in_flight = in_flight_per_stage
    else:
        vision_in_flight, llm_in_flight = in_flight_per_stage[:pp_v], in_flight_per_stage[pp_v:]

    n = len(lens)
    return BatchCosts(
        vision_fwd=_stack([t.fwd_s for t in vision], n),
        vision_bwd=_stack([t.bwd_s for t in vision], n),
        llm_fwd=_stack([t.fwd_s for t in llm], n),
        llm_bwd=_stack([t.bwd_s for t in llm], n),
        vision_fwd_const=np.array([t.fwd_const_s for t in vision], dtype=np.float64),
        vision_bwd_const=np.array([t.bwd_const_s for t in vision], dtype=np.float64),
        llm_fwd_const=np.array([t.fwd_const_s for t in llm], dtype=np.float64),
        llm_bwd_const=np.array([t.bwd_const_s for t in llm], dtype=np.float64),
        llm_act_bytes=_stack([t.act_bytes for t in llm], n),
        vision_act_bytes=_stack([t.act_bytes for t in vision], n),
        llm_mem_limit_bytes=_limits(llm, llm_in_flight, mem_limit_bytes, first_index=len(vision_in_flight)),
        vision_mem_limit_bytes=_limits(vision, vision_in_flight, mem_limit_bytes, first_index=0),
        llm_mem_bytes=_stack([t.act_bytes + t.transient_bytes / float(f) for t, f in zip(llm, llm_in_flight)], n),
        vision_mem_bytes=_stack([t.act_bytes + t.transient_bytes / float(f) for t, f in zip(vision, vision_in_flight)], n),
    )


def _merge(a: "StageTerms", b: "StageTerms") -> "StageTerms":
    """The terms of one stage running both a's and b's modules."""
    return replace(
        a,
        fwd_const_s=a.fwd_const_s + b.fwd_const_s,
        bwd_const_s=a.bwd_const_s + b.bwd_const_s,
        act_const_bytes=a.act_const_bytes + b.act_const_bytes,
        fwd_s=a.fwd_s + b.fwd_s,
        bwd_s=a.bwd_s + b.bwd_s,
        act_bytes=a.act_bytes + b.act_bytes,
        static=a.static + b.static,
        optimizer_s=a.optimizer_s + b.optimizer_s,
        # the stage runs one module at a time: the larger transient, per term (`StageTerms`' bound)
        transient_const_bytes=max(a.transient_const_bytes, b.transient_const_bytes),
        transient_bytes=np.maximum(a.transient_bytes, b.transient_bytes),
    )


def _stack(rows: list[np.ndarray], n: int) -> np.ndarray:
    return np.stack(rows) if rows else np.zeros((0, n))


def _limits(
    terms: list["StageTerms"], in_flight: Sequence[int], mem_limit_bytes: float, *, first_index: int
) -> np.ndarray:
    limits = []
    for k, (t, f) in enumerate(zip(terms, in_flight), start=first_index):
        if not f >= 1:  # a fraction under interleaving (chunk activations over chunks per rank)
            raise UserError(f"in_flight_per_stage[{k}] must be >= 1, got {f}")
        limits.append((float(mem_limit_bytes) - t.static.static_bytes - t.transient_const_bytes) / float(f)
                      - t.act_const_bytes)
    return np.array(limits, dtype=np.float64)
