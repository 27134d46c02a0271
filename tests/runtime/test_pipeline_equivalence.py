"""The distributed trainer computes what the unsplit model computes.

For one global batch (8 samples: images, multi-image posts, videos, text-only), the trainer's loss
and every parameter gradient (after its data-parallel, tied-embedding and tensor-parallel handling)
equal those of transformers' own model run on each sample in a single process (`reference.py`),
within float32 tolerance. Layouts cover world sizes 1-4: colocated, disjoint vision + LLM pipeline,
vision and LLM data parallelism, tensor parallelism (vocabulary-parallel embedding and loss, tied
embeddings across and within ranks), a frozen vision tower, InternVL; both scheduler policies, the
baseline's padding variant, GPipe, shuffled microbatch orders, activation recomputation, sequence
parallelism and sharded optimizer state (also with tensor parallelism); interleaved 1F1B (v = 2)
with a disjoint vision stage, recomputation, data, tensor and sequence parallelism, sharding; ZB-H1
(split backward) the same, in fewer cases.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from dflop.config import Config
from dflop.data.training import TrainingData
from dflop.models.handle import ModelHandle
from dflop.data.training import pool_samples
from dflop.shapes import read_shapes

from trainer_reference import MODELS, compare, config_dict, reference_gradients
from gloo_ranks import run_ranks

WORKER = Path(__file__).with_name("grad_worker.py")


def plan(vision, llm, placement="disjoint", m=2, batch=8, recompute=None, shard=False, **llm_techniques) -> dict:
    """vision / llm: (tp, pp, dp, layers_per_stage); recompute: (vision modes, llm modes) per stage;
    shard: shard_optimizer on both modules; llm_techniques: further LLM plan keys (sequence_parallel,
    schedule, chunks)."""
    (vt, vp, vd, vl), (lt, lp, ld, ll) = vision, llm
    world = lt * lp * ld + (0 if placement == "colocated" else vt * vp * vd)
    techniques = ({}, {}) if recompute is None else ({"recompute": recompute[0]}, {"recompute": recompute[1]})
    sharding = {"shard_optimizer": True} if shard else {}
    return {"vision": {"tp": vt, "pp": vp, "dp": vd, "layers_per_stage": vl, **techniques[0], **sharding},
            "llm": {"tp": lt, "pp": lp, "dp": ld, "layers_per_stage": ll, **techniques[1], **sharding,
                    **llm_techniques},
            "placement": placement, "microbatches": m, "global_batch_size": batch, "world_size": world}


def case(name, arch, layout, *, policy="dflop", shuffle_seed=None, freeze=(), schedule="1f1b", pad=False):
    return {"name": name, "arch": arch, "plan": layout, "freeze": list(freeze), "shuffle_seed": shuffle_seed,
            "config": {"train": {"global_batch_size": 8, "schedule": schedule}, "scheduler": {"policy": policy},
                       "model": {"freeze": {part: True for part in freeze}}},
            "overrides": {"pad_to_longest": pad}}


ONE, TWO = (1, 1, 1, [2]), (1, 1, 2, [2])
CASES = {
    1: [case("colocated-single-rank", "llava_ov", plan(ONE, ONE, "colocated"), shuffle_seed=1)],
    2: [case("colocated-tp2", "llava_ov", plan((2, 1, 1, [2]), (2, 1, 1, [2]), "colocated"), shuffle_seed=2),
        case("internvl-baseline-padded", "internvl", plan(ONE, ONE), policy="baseline", pad=True),
        # recomputation under TP: a frozen colocated InternViT checkpointed per layer, selective LLM
        case("internvl-colocated-tp2-recompute-frozen-tower", "internvl",
             plan((2, 1, 1, [2]), (2, 1, 1, [2]), "colocated", recompute=(["full"], ["selective"])),
             freeze=("vision",))],
    3: [case("vision1-llm-pp2", "llava_ov", plan(ONE, (1, 2, 1, [1, 1]), m=4)),
        case("vision-pp2-frozen-tower", "llava_ov", plan((1, 2, 1, [1, 1]), ONE, m=4), freeze=("vision",),
             shuffle_seed=3),
        case("internvl-vision-pp2-gpipe", "internvl", plan((1, 2, 1, [1, 1]), ONE, m=4), schedule="gpipe",
             shuffle_seed=4),
        # activation recomputation: selective on a vision stage, full and selective on LLM stages
        case("recompute-vision-selective-llm-full-selective", "llava_ov",
             plan(ONE, (1, 2, 1, [1, 1]), m=4, recompute=(["selective"], ["full", "selective"])))],
    4: [case("vision-dp2-llm-dp2-baseline", "llava_ov", plan(TWO, TWO), policy="baseline", shuffle_seed=5),
        case("vision-dp2-llm-dp2-dflop", "llava_ov", plan(TWO, TWO, m=2)),
        # DTensor gradients in the overlapped buckets; vision and LLM buckets on one rank
        case("colocated-tp2-dp2", "llava_ov", plan((2, 1, 2, [2]), (2, 1, 2, [2]), "colocated", m=2)),
        # the tied embedding's bucket (summed over the two LLM stages first) is never overlapped
        case("colocated-llm-pp2-dp2-tied", "llava_ov", plan((1, 1, 2, [2]), (1, 2, 2, [1, 1]), "colocated", m=2)),
        # sequence parallelism: the padded row's sequence shard crosses the LLM stage boundary; with
        # recomputation of both kinds on the sequence-sharded LLM stages
        case("colocated-tp2-llm-pp2-sp-recompute", "llava_ov",
             plan((2, 1, 1, [2]), (2, 2, 1, [1, 1]), "colocated", m=2, recompute=(["none"], ["full", "selective"]),
                  sequence_parallel=True), shuffle_seed=6),
        # a disjoint tensor-parallel vision tower feeding a sequence-parallel LLM stage
        case("disjoint-vision-tp2-llm-tp2-sp", "internvl", plan((2, 1, 1, [2]), (2, 1, 1, [2]), m=2,
                                                                sequence_parallel=True)),
        # shard_optimizer (FSDP2, ZeRO-2): each replica holds its 1/dp shard of the summed gradient;
        # the vision stage shards a frozen tower with a trained projector
        case("vision-dp2-llm-dp2-sharded-frozen-tower", "llava_ov", plan(TWO, TWO, m=2, shard=True),
             freeze=("vision",), shuffle_seed=6),
        # sharded stages colocated on one rank; the tied embedding's shards summed over the LLM stages;
        # recomputation inside the sharded stages
        case("colocated-llm-pp2-dp2-tied-sharded-recompute", "llava_ov",
             plan((1, 1, 2, [2]), (1, 2, 2, [1, 1]), "colocated", m=4, shard=True,
                  recompute=(["selective"], ["full", "none"]))),
        # shard_optimizer with tensor parallelism: FSDP2 over "dp" of a 2-D (dp, tp) mesh whose "tp"
        # holds the TP DTensors; the vocabulary-parallel embedding tied to the head, both sharded twice;
        # sequence parallelism's partial norm gradients summed over tp before FSDP2's reduce-scatter
        case("colocated-tp2-dp2-sharded-sp", "llava_ov", plan((2, 1, 2, [2]), (2, 1, 2, [2]), "colocated", m=2,
                                                              shard=True, sequence_parallel=True), shuffle_seed=7)],
}


# Interleaved 1F1B (llm.schedule: interleaved, v = 2 model chunks per rank; layers_per_stage and
# recompute per chunk, chunk c on LLM rank c mod pp). The tiny LLMs have 2 layers, so the 4 chunks
# are [0, 1, 1, 0]: embedding (rank 0) -> layer 0 (rank 1) -> layer 1 (rank 0) -> head (rank 1),
# every hop between ranks and both ranks running layers.
V2 = {"schedule": "interleaved", "chunks": 2}
CHUNKS = (1, 2, 1, [0, 1, 1, 0])
INTERLEAVED = {
    # the vision tower inside chunk 0; m = 4 has a steady phase (m = pp would run all forwards
    # first); recomputation per chunk
    2: [case("interleaved-colocated-pp2-v2-recompute", "llava_ov",
             plan(ONE, CHUNKS, "colocated", m=4, recompute=(["none"], ["none", "full", "selective", "none"]), **V2),
             shuffle_seed=8)],
    # a disjoint vision stage in front of the interleaved LLM (1F1B, warmed up to chunk 0's peak)
    3: [case("interleaved-vision1-llm-pp2-v2", "internvl", plan(ONE, CHUNKS, m=4, **V2), shuffle_seed=9)],
    4: [  # data parallelism with the tied embedding summed across ranks 0 and 1, optimizer sharded
          # per chunk; tensor + sequence parallelism with the sequence shard crossing every chunk boundary
        case("interleaved-colocated-pp2-v2-dp2-tied-sharded", "llava_ov",
             plan((1, 1, 2, [2]), (1, 2, 2, [0, 1, 1, 0]), "colocated", m=2, shard=True, **V2)),
        case("interleaved-colocated-tp2-pp2-v2-sp", "llava_ov",
             plan((2, 1, 1, [2]), (2, 2, 1, [0, 1, 1, 0]), "colocated", m=4, sequence_parallel=True, **V2),
             shuffle_seed=10)],
}

# ZB-H1 (llm.schedule: zb-h1): each LLM stage's backward split into B (input gradient, sent at once)
# and W (weight gradients, the first `stage` of them postponed to the step's end).
ZB = {"schedule": "zb-h1"}
ZB_H1 = {
    # colocated: stage 0 (no input gradient: its W is the whole backward) and stage 1 (split, W
    # through its checkpointed layer, which W recomputes)
    2: [case("zb-h1-colocated-pp2-recompute", "llava_ov",
             plan(ONE, (1, 2, 1, [1, 1]), "colocated", m=4, recompute=(["none"], ["selective", "full"]), **ZB),
             shuffle_seed=11)],
    # a disjoint vision stage: its unsplit backward waits for LLM stage 0's B (the features' gradient)
    3: [case("zb-h1-vision1-llm-pp2", "internvl", plan(ONE, (1, 2, 1, [1, 1]), m=4, **ZB), shuffle_seed=12)],
    4: [  # the vision tower's data-parallel buckets armed before the last W (in stage 0's W), the
          # LLM's optimizer sharded (FSDP2 reduce-scatter after every W), the tied embedding summed
          # over the stages; tensor + sequence parallelism (DTensor W, the norms' all-reduce hooks)
        case("zb-h1-colocated-pp2-dp2-tied-llm-sharded", "llava_ov",
             plan((1, 1, 2, [2]), (1, 2, 2, [1, 1]), "colocated", m=4, shard_optimizer=True, **ZB)),
        case("zb-h1-colocated-tp2-pp2-sp", "llava_ov",
             plan((2, 1, 1, [2]), (2, 2, 1, [1, 1]), "colocated", m=4, sequence_parallel=True, **ZB),
             shuffle_seed=13)],
}


@lru_cache(maxsize=None)
def _training_data(arch: str, pool_path: str, manifest: str) -> TrainingData:
    cfg = Config.from_dict(config_dict(arch, manifest))
    pool = read_shapes(pool_path)
    return TrainingData(pool_samples(pool, cfg.datasets, 0), ModelHandle.resolve(cfg.model).sample_rules())


@lru_cache(maxsize=None)
def _reference(arch: str, pool_path: str, manifest: str, rows: tuple[int, ...], freeze: tuple[str, ...]):
    torch.set_num_threads(1)
    vision, llm = MODELS[arch]
    return reference_gradients(arch, vision, llm, _training_data(arch, pool_path, manifest), rows, freeze=freeze)


def _run(world: int, tmp_path: Path, pools: dict, manifest, table: dict = CASES) -> list[tuple[dict, Path]]:
    cases = []
    for c in table[world]:
        out = tmp_path / c["name"]
        raw = config_dict(c["arch"], manifest, **c["config"])
        cases.append({**c, "out": str(out), "config": raw, "shapes": pools[c["arch"]]})
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps({"manifest": str(manifest), "cases": cases}))
    run_ranks(WORKER, spec, nproc=world, timeout=600)
    return [(c, Path(c["out"])) for c in cases]


@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted(CASES))
def test_loss_and_every_gradient_match_the_unsplit_model(world, tmp_path, pools, runtime_demo):
    _check(world, _run(world, tmp_path, pools, runtime_demo), runtime_demo)


@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted(INTERLEAVED))
def test_interleaved_1f1b_matches_the_unsplit_model(world, tmp_path, pools, runtime_demo):
    """Interleaved 1F1B (v = 2) against the same reference. Fails if a chunk's activations or
    gradients go to the wrong rank or chunk, a warm-up forward is skipped (a backward without its
    forward, or a wait that never ends), a chunk's gradient is lost, or a chunk runs the layers of another."""
    _check(world, _run(world, tmp_path, pools, runtime_demo, INTERLEAVED), runtime_demo)


@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted(ZB_H1))
def test_zb_h1_matches_the_unsplit_model(world, tmp_path, pools, runtime_demo):
    """ZB-H1 against the same reference. Fails if a W is skipped or run twice (a weight gradient
    missing or doubled), B leaks weight gradients W adds again, the input gradient sent upstream
    is not the stage's, or the sync / reduce-scatter reads gradients before the last W."""
    _check(world, _run(world, tmp_path, pools, runtime_demo, ZB_H1), runtime_demo)


def _check(world: int, runs: list[tuple[dict, Path]], runtime_demo) -> None:
    failures = []
    for c, out in runs:
        result = json.loads((out / "result.json").read_text())
        assert sorted(result["rows"]) == list(range(8)), "the global batch must be the whole pool"
        # The sync overlapped the last backward, which it can where that microbatch has work on
        # every replica (the scheduler may leave a microbatch empty when its fixed costs outweigh
        # the samples', as the FLOP-count stand-in cost model of these tiny models does).
        sharded = c["plan"]["llm"].get("shard_optimizer")  # FSDP2 reduces those gradients, not the buckets
        # Under interleaving the sync is armed only before the rank's last backward (its first
        # chunk's), when the buckets of its later chunks, launched first, can no longer complete.
        interleaved = c["plan"]["llm"].get("chunks", 1) > 1
        if (c["plan"]["vision"]["dp"] > 1 or c["plan"]["llm"]["dp"] > 1) and all(result["bins"][-1]) and not sharded \
                and not interleaved:
            assert result["overlapped_buckets"] > 0, c["name"]
        loss, count, grads = _reference(c["arch"], c["shapes"], str(runtime_demo), tuple(range(8)),
                                        tuple(c["freeze"]))
        failures += [f"{c['name']}: {p}" for p in compare(out, world, loss, count, grads)]
        for rank in range(world):  # every stage (chunk) recomputes as planned (the maths cannot tell)
            for part, stage, mode, attention in json.loads((out / f"recompute_rank{rank}.json").read_text()):
                assert mode == c["plan"][part].get("recompute", ["none"] * 9)[stage], (c["name"], rank, part)
                assert all(a.endswith("+recompute") == (mode == "selective") for a in attention), (c["name"], attention)
        if c["freeze"]:
            # The comparison can fail: the same run against the unfrozen model's gradients does.
            _, _, unfrozen = _reference(c["arch"], c["shapes"], str(runtime_demo), tuple(range(8)), ())
            assert compare(out, world, loss, count, unfrozen), "a frozen run must not match unfrozen gradients"
    assert not failures, "\n".join(failures[:30])
