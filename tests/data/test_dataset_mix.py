"""data.datasets[].weight: a weighted two-dataset config trains with the mix it names (the trainer's
epoch order, the HF sampler and the planner's sampled batches), bad weights are one-line config
errors, and no weight keeps each sample once per epoch."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dflop.config import Config, ConfigError
from dflop.data.sampling import dataset_mix
from dflop.planner.expected import sample_batches
from dflop.scheduler.online import GlobalBatches

SIZES = {"small": 1000, "large": 3000}  # the small dataset is upweighted 3:1 against its size's 1:3


def config(weights: dict | None, **extra) -> Config:
    datasets = [{"name": name, "path": f"{name}.json", **({"weight": weights[name]} if weights else {})}
                for name in SIZES]
    return Config.from_dict({"data": {"datasets": datasets}, **extra})


def pool_datasets() -> list[str]:
    return [name for name, n in SIZES.items() for _ in range(n)]


def shares(indices: np.ndarray) -> float:
    """Fraction of `indices` (pool rows) from the small dataset (rows 0..999)."""
    return float(np.mean(np.asarray(indices) < SIZES["small"]))


def test_trainer_epoch_order_follows_the_weights():
    cfg = config({"small": 3, "large": 1})
    mix = dataset_mix(pool_datasets(), cfg.datasets)
    batches = GlobalBatches(4000, 40, seed=5, mix=mix)
    epoch = np.concatenate([batches.rows(s) for s in range(batches.per_epoch)])
    assert shares(epoch) == pytest.approx(0.75, abs=0.03)  # binomial sd ~0.007 at 4000 draws
    small = epoch[epoch < SIZES["small"]]
    assert len(np.unique(small)) == SIZES["small"]  # drawn 3x its size: every sample, repeated
    large = epoch[epoch >= SIZES["small"]]
    assert len(np.unique(large)) == len(large)  # drawn less than its size: no repeats


def test_hf_sampler_draws_the_same_mix(mix_pool):
    from dflop.integrations.hf import DflopBatchSampler, Sampling

    shapes = pd.concat([mix_pool.head(100).assign(dataset="small"),
                        mix_pool.iloc[100:400].assign(dataset="large")], ignore_index=True)
    cfg = config({"small": 3, "large": 1}, model={"arch": "llava_ov", "vision": "siglip-tiny", "llm": "qwen2.5-tiny"},
                 cluster={"device": "cpu", "gpus_per_node": 2, "gpu_memory_gb": 1000})
    sampling = Sampling.from_config(cfg, shapes=shapes)
    drawn = [i for r in range(2) for mb in DflopBatchSampler(sampling, global_batch_size=20, world_size=2, rank=r,
                                                             grad_accum=2) for i in mb]
    assert len(drawn) == 400
    assert float(np.mean(np.asarray(drawn) < 100)) == pytest.approx(0.75, abs=0.08)  # sd 0.02; unweighted: 0.25


def test_planner_sampled_batches_follow_the_weights():
    mix = dataset_mix(pool_datasets(), config({"small": 3, "large": 1}).datasets)
    batches = sample_batches(4000, 50, 80, seed=2, draw_p=mix.probabilities)
    assert shares(np.concatenate(batches)) == pytest.approx(0.75, abs=0.03)


def test_no_weight_keeps_each_sample_once_per_epoch():
    cfg = config(None)
    assert dataset_mix(pool_datasets(), cfg.datasets) is None
    batches = GlobalBatches(4000, 40, seed=5)
    epoch = np.concatenate([batches.rows(s) for s in range(batches.per_epoch)])
    assert np.array_equal(epoch, np.random.default_rng([5, 0]).permutation(4000))


@pytest.mark.parametrize("weights,key", [
    ({"small": -1, "large": 1}, r"data\.datasets\[0\]\.weight"),
    ({"small": 0, "large": 0}, r"data\.datasets\[\]\.weight: all zero"),
    ({"small": "a lot", "large": 1}, r"data\.datasets\[0\]\.weight"),
    ({"small": True, "large": 1}, r"data\.datasets\[0\]\.weight"),
    ({"small": float("nan"), "large": 1}, r"data\.datasets\[0\]\.weight"),
])
def test_bad_weights_are_one_line_errors_naming_the_key(weights, key):
    with pytest.raises(ConfigError, match=key) as err:
        config(weights)
    assert "\n" not in str(err.value)


def test_a_weight_on_some_datasets_only_is_refused():
    datasets = [{"name": "small", "path": "s.json", "weight": 2}, {"name": "large", "path": "l.json"}]
    with pytest.raises(ConfigError, match=r"data\.datasets\[1\]\.weight: missing"):
        Config.from_dict({"data": {"datasets": datasets}})
