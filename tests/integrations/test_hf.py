"""DFLOP's batch sampler for the HF Trainer (`dflop.integrations.hf`): the partition is the scheduler's,
every rank yields the same number of microbatches, an epoch covers its global batches exactly once,
and the HF Trainer's loss over the variable microbatches is the exact mean of the whole batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflop.config import Config
from dflop.errors import UserError
from dflop.integrations.hf import DflopBatchSampler, Sampling
from dflop.pricing.pool import Pool
from dflop.scheduler import partition

HERE = Path(__file__).resolve().parent


def tiny_config(memory_gb: float = 1000.0, seed: int = 3, ilp: str = "never") -> Config:
    return Config.from_dict({"run": {"seed": seed}, "scheduler": {"ilp": ilp},
                             "model": {"arch": "llava_ov", "vision": "siglip-tiny", "llm": "qwen2.5-tiny"},
                             "data": {"datasets": [{"name": "mix", "path": "unused.json"}]},
                             "cluster": {"device": "cpu", "nodes": 1, "gpus_per_node": 4,
                                         "gpu_memory_gb": memory_gb}})


@pytest.fixture(scope="module")
def sampling(mix_pool):
    return Sampling.from_config(tiny_config(), shapes=mix_pool.head(203).copy())


def sampler(sampling, world, rank, accum, batch=24) -> DflopBatchSampler:
    return DflopBatchSampler(sampling, global_batch_size=batch, world_size=world, rank=rank, grad_accum=accum)


@pytest.mark.parametrize("world,accum", [(2, 2), (3, 1), (4, 3)])
def test_partition_is_the_schedulers(sampling, world, accum):
    """Each rank's microbatches are its bins of `dflop.scheduler.partition` on the seeded global batch
    (independent order: `np.random.default_rng([seed, epoch])`), priced with the pp = 1 plan, seeded
    with seed + step, in the partition's execution order."""
    per_rank = [list(sampler(sampling, world, r, accum)) for r in range(world)]
    pricing = sampling.pricing(world, accum)
    whole = Pool.from_shapes(sampling.pool)
    order = np.random.default_rng([sampling.seed, 0]).permutation(len(whole))
    for step in range(3):
        rows = order[step * 24:(step + 1) * 24]
        pc = pricing.batch(whole.take(rows))
        ref = partition(pc.costs, accum, world, 1, seed=sampling.seed + step, p2p_s=pricing.p2p_s,
                        allreduce_s=pc.allreduce_s)
        for p, mb in enumerate(ref.bins()):
            for r in range(world):
                assert per_rank[r][step * accum + p] == [int(rows[i]) for i in mb[r]], (step, p, r)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("accum", [1, 2])
def test_epoch_covers_each_batch_once_with_equal_counts(sampling, world, accum):
    """Over an epoch: every rank yields steps x accum non-empty microbatches; together they hold the
    epoch's first steps x B samples of its permutation, each once; epoch 1 is another order."""
    batch = 12
    steps = len(sampling.pool) // batch
    seen = []
    for rank in range(world):
        s = sampler(sampling, world, rank, accum, batch)
        got = list(s)
        assert len(got) == len(s) == steps * accum
        assert all(len(mb) > 0 for mb in got)
        seen += [i for mb in got for i in mb]
    order = np.random.default_rng([sampling.seed, 0]).permutation(len(sampling.pool))
    assert sorted(seen) == sorted(order[:steps * batch].tolist())
    s = sampler(sampling, world, 0, accum, batch)
    s.set_epoch(1)
    assert list(s) != list(sampler(sampling, world, 0, accum, batch))


def test_memory_guard_is_one_line_naming_the_sample(mix_pool):
    tight = Sampling.from_config(tiny_config(memory_gb=0.01), shapes=mix_pool.head(50).copy())
    with pytest.raises(UserError, match=r"step 0: sample llava_ov_mix-7-\d+ fits in no microbatch") as err:
        next(iter(sampler(tight, 2, 0, 1, batch=8)))
    assert "\n" not in str(err.value)


def test_missing_shapes_row_names_the_item(mix_pool):
    keys = [("llava_ov_mix", "llava_ov_mix-7-1"), ("llava_ov_mix", "nope")]
    with pytest.raises(UserError, match=r"train dataset item 1 \(llava_ov_mix/nope\) has no usable shapes row"):
        Sampling.from_config(tiny_config(), shapes=mix_pool.head(5).copy(), keys=keys)


@pytest.mark.distributed
def test_hf_trainer_loss_and_gradients_are_the_whole_batch_mean(demo_manifest, tmp_path):
    """One optimizer step of HF's Trainer with DflopTrainer on 2 gloo ranks x 2 accumulation steps
    (variable sample counts per microbatch) gives the loss and gradients of one process running the
    whole global batch at once (one padded forward, mean over its answer tokens)."""
    from gloo_ranks import run_ranks

    run_ranks(HERE / "hf_worker.py", demo_manifest, tmp_path, timeout=300)
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result["sizes"]) == 2 and len(set(result["sizes"][0])) + len(set(result["sizes"][1])) > 2, \
        f"microbatch sizes do not vary: {result['sizes']}"  # else the test shows nothing about variable sizes
    sys.path.insert(0, str(HERE))
    from hf_worker import reference, setup

    _, _, shapes = setup(demo_manifest)
    rows = np.random.default_rng([1, 0]).permutation(len(shapes))[:8]  # step 0 of run.seed 1's epoch 0
    assert result["rows"] == sorted(rows.tolist())
    ref_loss, ref_grads = reference(demo_manifest, tmp_path, rows.tolist())
    assert abs(result["loss"] - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (result["loss"], ref_loss)
    grads = torch.load(tmp_path / "grads.pt")
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        scale = max(1e-3, float(ref.abs().max()))
        assert torch.allclose(grads[name], ref, rtol=1e-4, atol=1e-5 * scale), \
            (name, float((grads[name] - ref).abs().max()), scale)


def test_a_resumed_epoch_still_reaches_the_sampler(sampling):
    """A resume wraps the sharded batch sampler in accelerate's `SkipBatchSampler`; `set_epoch` on the
    resumed loader must still pick the sampler's epoch, or a resume in epoch e > 0 trains epoch 0."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, skip_first_batches

    from dflop.integrations.hf import pass_through

    mine = sampler(sampling, 2, 1, 2)
    loader = DataLoaderShard(list(range(len(sampling.pool))), batch_sampler=BatchSamplerShard(mine, 2, 1),
                             collate_fn=list)
    pass_through(loader, mine)
    resumed = skip_first_batches(loader, 3)
    resumed.set_epoch(2)
    assert mine.epoch == 2
    reference = sampler(sampling, 2, 1, 2)
    reference.set_epoch(2)
    assert list(resumed) == list(reference)[3:]  # this rank's epoch-2 microbatches after the 3 skipped


def test_only_deterministic_members_split_across_ranks(sampling):
    """Every rank partitions alone: a wall-clock-limited ILP could give ranks different splits."""
    from dataclasses import replace

    with_ilp = replace(sampling, scheduler=replace(sampling.scheduler, ilp="auto"))
    with pytest.raises(UserError, match="ilp must be 'never'"):
        sampler(with_ilp, 2, 0, 2)
    sampler(with_ilp, 1, 0, 2)  # one rank: nothing to disagree with
    assert Sampling.from_config(tiny_config(ilp="always"), shapes=sampling.pool).scheduler.ilp == "never"
