"""Per-device op orders of the pipeline schedules the simulator knows, and their warm-up counts.

A schedule is a static order of ops on each device; `dflop.sim.pipeline` times those orders. Ops
are (kind, position) or, with model chunks, (kind, chunk, position): kind `F` forward, `B`
backward (the whole backward, or under a split-backward schedule only its input-gradient part),
`W` the weight-gradient part of a split backward; position ``j`` is the ``j``-th microbatch of the
step's execution order.

- ``1f1b``: PipeDream-flush / Megatron-LM's non-interleaved schedule: stage ``s`` of ``p`` runs
  ``min(p - s - 1, m)`` warm-up forwards, then one forward / one backward, then the rest of the
  backwards. At most ``min(p - s, m)`` microbatches are in flight on stage ``s``.
- ``gpipe``: all forwards, then all backwards (``m`` in flight).
- ``interleaved``: Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21, "virtual pipeline
  stages"). The model is cut into ``p * v`` chunks; chunk (virtual stage) ``c`` lives on rank
  ``c mod p``, so rank ``r`` holds chunks ``r, r + p, ...``. A rank walks its ``m * v`` chunk
  forwards in groups of ``p`` microbatches per chunk (microbatches 0..p-1 through chunk 0, then
  through chunk 1, ..., then microbatches p..2p-1 through chunk 0, ...) and its backwards in the
  same grouping with the chunks reversed; ``interleaved_warmup`` forwards first, then one forward /
  one backward, then the rest. Megatron requires ``m`` to be a multiple of ``p``, and so do we.
- ``zb-h1``: the handcrafted ZB-H1 schedule of Qi et al., "Zero Bubble Pipeline Parallelism"
  (ICLR 2024): backward split into B (gradient of the stage's input, which the previous stage
  waits for) and W (gradient of the stage's weights, which nobody waits for). Warm-up and the
  F/B alternation are 1F1B's (so the microbatches whose B is still due are 1F1B's ``p - s``);
  stage ``s`` postpones its first ``s`` W passes and runs them at the end, where they fill the
  cool-down's gaps. With identical microbatches, ``m >= p`` and ``T_W <= min(T_F, T_B)`` this
  order's step is ``m (T_F + T_B + T_W) + (p - 1)(T_F + T_B - T_W)``: the paper's ZB-H1 bubble.
"""

from __future__ import annotations

F, B, W = 0, 1, 2

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")
SPLIT_BACKWARD = ("zb-h1",)  # schedules whose backward is a B op then a W op


def _one_f_one_b(warmup: int, m: int) -> list[tuple[int, int]]:
    """``warmup`` forwards, then alternate forward / backward, then the remaining backwards."""
    warmup = min(warmup, m)
    ops = [(F, j) for j in range(warmup)]
    for i in range(m - warmup):
        ops += [(F, warmup + i), (B, i)]
    return ops + [(B, j) for j in range(m - warmup, m)]


def stage_op_order(schedule: str, stage: int, n_stages: int, m: int) -> list[tuple[int, int]]:
    """Static op order of one stage of a 1F1B or GPipe pipeline, as (kind, position) pairs;
    kind 0 = forward, 1 = backward.

    1F1B: ``min(p - s - 1, m)`` warm-up forwards, then alternate one forward / one backward,
    then the remaining backwards. GPipe: all forwards, then all backwards. (`interleaved_op_order`
    and `zb_h1_op_order` give the other schedules' orders.)
    """
    if schedule == "gpipe":
        return [(F, j) for j in range(m)] + [(B, j) for j in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"stage_op_order gives the orders of '1f1b' and 'gpipe', got {schedule!r}")
    return _one_f_one_b(n_stages - stage - 1, m)


def interleaved_warmup(rank: int, p: int, v: int, m: int) -> int:
    """Warm-up chunk forwards of ``rank`` under interleaved 1F1B, as Megatron-LM computes them.

    ``2 (p - rank - 1) + (v - 1) p``, at most ``m v``; when ``m == p`` Megatron runs every forward
    first (all ``m v`` are warm-up). The rank then holds at most warm-up + 1 chunk activations
    (the steady phase runs a forward before each backward).
    """
    total = m * v
    if m == p:
        return total
    return min(2 * (p - rank - 1) + (v - 1) * p, total)


def check_interleaved(p: int, v: int, m: int) -> None:
    """Raise ValueError (one line) unless Megatron's interleaved schedule applies to (p, v, m)."""
    if v < 2:
        raise ValueError(f"interleaved 1F1B needs at least 2 model chunks per rank, got {v}")
    if p < 1 or m % p:
        raise ValueError(f"interleaved 1F1B needs the microbatch count ({m}) to be a multiple of the "
                         f"pipeline ranks ({p}), as Megatron-LM does")


def _chunk_and_position(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """The ``k``-th chunk forward (or backward) of a rank: which chunk, which microbatch position.

    Microbatches go in groups of ``p``: the group's ``p`` forwards through chunk 0, then through
    chunk 1, ...; backwards walk the chunks from the last.
    """
    group, within = divmod(k, p * v)
    chunk = within // p
    if not forward:
        chunk = v - 1 - chunk
    return chunk, group * p + k % p


def interleaved_op_order(rank: int, p: int, v: int, m: int) -> list[tuple[int, int, int]]:
    """Megatron-LM's interleaved 1F1B order on ``rank`` as (kind, chunk, position) triples.

    ``chunk`` is the rank's local chunk index ``k``: virtual stage ``k p + rank``.
    """
    check_interleaved(p, v, m)
    total = m * v
    warmup = interleaved_warmup(rank, p, v, m)
    ops = [(F, *_chunk_and_position(k, p, v, True)) for k in range(warmup)]
    for k in range(total - warmup):
        ops.append((F, *_chunk_and_position(warmup + k, p, v, True)))
        ops.append((B, *_chunk_and_position(k, p, v, False)))
    ops += [(B, *_chunk_and_position(k, p, v, False)) for k in range(total - warmup, total)]
    return ops


def zb_h1_op_order(stage: int, p: int, m: int) -> list[tuple[int, int]]:
    """ZB-H1's order on ``stage`` of ``p`` as (kind, position) pairs with kinds F, B, W.

    1F1B's order with each backward split into B then W, except that the stage's first ``stage``
    W passes are postponed: the steady phase runs F, B (and a W once ``stage`` B's are done), the
    cool-down B, W, and the postponed W's close the step. W passes run in microbatch order.
    """
    ops: list[tuple[int, int]] = []
    w_done = b_done = 0
    for kind, j in _one_f_one_b(p - stage - 1, m):
        ops.append((kind, j))
        if kind == B:
            b_done += 1
            if b_done > stage:
                ops.append((W, w_done))
                w_done += 1
    return ops + [(W, j) for j in range(w_done, m)]



def llm_rank_op_order(schedule: str, rank: int, p: int, m: int, chunks: int = 1) -> list[tuple[int, int, int]]:
    """The ops of LLM pipeline rank ``rank`` of ``p`` under ``schedule`` as (kind, local chunk,
    position) triples (chunk 0 unless interleaved; ZB-H1's W ops have kind `W`)."""
    if schedule == "interleaved":
        return interleaved_op_order(rank, p, chunks, m)
    if chunks != 1:
        raise ValueError(f"schedule {schedule!r} runs one model chunk per rank, got chunks={chunks}")
    if schedule == "zb-h1":
        return [(kind, 0, j) for kind, j in zb_h1_op_order(rank, p, m)]
    return [(kind, 0, j) for kind, j in stage_op_order(schedule, rank, p, m)]


def first_chunk_peak(rank0_ops: list[tuple[int, int, int]]) -> int:
    """The most microbatches in flight on the LLM's first stage (chunk 0 of rank 0's ops): the
    count the vision stages in front of it warm up to (`vision_op_order`)."""
    count = lead = 0
    for kind, chunk, _ in rank0_ops:
        if chunk == 0:
            count += (kind == F) - (kind == B)
            lead = max(lead, count)
    return lead


def vision_op_order(schedule: str, stage: int, n_vision: int, lead: int, m: int) -> list[tuple[int, int]]:
    """Vision stage ``stage`` of ``n_vision`` in front of the LLM, whatever the LLM runs: 1F1B with
    ``lead + n_vision - stage - 1`` warm-up forwards, ``lead`` = `first_chunk_peak` (GPipe under
    ``gpipe``). Under a plain 1F1B LLM this is 1F1B over the whole pipeline."""
    if schedule == "gpipe":
        return stage_op_order("gpipe", stage, n_vision, m)
    return _one_f_one_b(lead + n_vision - stage - 1, m)
