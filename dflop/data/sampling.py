"""Per-dataset sampling rules, applied to a stream of samples without holding the dataset.

Rules (the config's ``data.datasets[].sample``):

- ``all``: every sample.
- ``first:N``: the first N samples in file order (stops reading after them).
- ``random:N``: a uniform random N-subset, by reservoir sampling (Algorithm R) seeded with
  (seed, dataset). Output in file order. When the dataset size is known up front (Parquet
  metadata), the same reservoir runs over indices first, so only the chosen samples are ever held
  and the choice is identical to the streaming one.
- ``P%``: each sample kept iff a hash of (seed, sample_id) falls below P/100 of the hash range.
  Deterministic, independent of file order, and nested: the 10% subset lies inside the 20% one.

The mix of the chosen samples (``data.datasets[].weight``, `DatasetMix`): how often training
draws from each dataset, for the trainer's epoch order, the planner's sampled batches and the HF
sampler alike.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from dflop.errors import UserError

T = TypeVar("T")

_RULE = re.compile(r"^(?:(all)|first:(\d+)|random:(\d+)|(\d+(?:\.\d+)?)%)$")


class SamplingRuleError(ValueError):
    """A sampling rule that does not parse; the message names the rule."""


@dataclass(frozen=True)
class SamplingRule:
    """A parsed rule: kind is 'all', 'first', 'random' or 'percent'."""

    kind: str
    count: int = 0
    percent: float = 100.0

    def __str__(self) -> str:
        if self.kind in ("first", "random"):
            return f"{self.kind}:{self.count}"
        if self.kind == "percent":
            return f"{self.percent:g}%"
        return "all"


def parse_sampling_rule(rule: str) -> SamplingRule:
    """Parse 'all', 'first:N', 'random:N' or 'P%' (0 < P <= 100)."""
    match = _RULE.match(rule.strip()) if isinstance(rule, str) else None
    if match is None:
        raise SamplingRuleError(
            f"sampling rule {rule!r}: expected all, first:N, random:N or P% (e.g. 10%)"
        )
    is_all, first, rand, percent = match.groups()
    if is_all:
        return SamplingRule("all")
    if first is not None:
        return SamplingRule("first", count=int(first))
    if rand is not None:
        return SamplingRule("random", count=int(rand))
    value = float(percent)
    if not 0 < value <= 100:
        raise SamplingRuleError(f"sampling rule {rule!r}: percentage must be in (0, 100]")
    return SamplingRule("percent", percent=value)


def sample_stream(
    items: Iterable[T],
    rule: SamplingRule | str,
    *,
    seed: int,
    stream_name: str,
    key: Callable[[T], str],
    total: int | None = None,
) -> Iterator[T]:
    """Yield the items `rule` selects, in input order.

    stream_name: mixed into the random:N seed so that datasets sharing a seed are sampled
        independently (use the dataset name).
    key: the item's stable id, hashed by the P% rule.
    total: number of items, when known without reading them; lets random:N hold only the chosen
        items instead of a reservoir of N items.
    """
    if isinstance(rule, str):
        rule = parse_sampling_rule(rule)
    if rule.kind == "all":
        yield from items
    elif rule.kind == "first":
        yield from itertools.islice(items, rule.count)
    elif rule.kind == "percent":
        threshold = rule.percent / 100.0 * 2**64
        for item in items:
            if _unit_hash(seed, key(item)) < threshold:
                yield item
    elif total is not None:
        chosen = set(reservoir_indices(total, rule.count, seed=seed, stream_name=stream_name))
        last = max(chosen, default=-1)
        for index, item in enumerate(itertools.islice(items, last + 1)):
            if index in chosen:
                yield item
    else:
        yield from _reservoir(items, rule.count, _rng(seed, stream_name))


def reservoir_indices(total: int, count: int, *, seed: int, stream_name: str) -> list[int]:
    """Sorted indices that random:count picks out of `total` items (same as the streaming pick)."""
    return list(_reservoir(range(total), count, _rng(seed, stream_name)))


def _reservoir(items: Iterable[T], count: int, rng: random.Random) -> Iterator[T]:
    """Algorithm R: after item i (0-based, i >= count) it replaces slot randrange(i + 1) if < count.

    The random draws depend only on positions, never on the items, which is what makes the
    index-only pick in reservoir_indices equal to this one.
    """
    reservoir: list[tuple[int, T]] = []
    for index, item in enumerate(items):
        if index < count:
            reservoir.append((index, item))
            continue
        slot = rng.randrange(index + 1)
        if slot < count:
            reservoir[slot] = (index, item)
    reservoir.sort(key=lambda pair: pair[0])
    return (item for _, item in reservoir)


def _rng(seed: int, stream_name: str) -> random.Random:
    # String seeds are hashed with SHA-512 by random.Random: stable across runs and platforms.
    return random.Random(f"dflop-sampling:{seed}:{stream_name}")


def _unit_hash(seed: int, key: str) -> int:
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True)
class DatasetMix:
    """The datasets' sampling ratios (``data.datasets[].weight``) over a pool of samples.

    groups: [N] dataset index of every pool sample; shares: [D] fraction of draws from each
    dataset (the weights over their sum). A dataset drawn more often than it has samples repeats
    them (reshuffled each pass); one drawn less often leaves some out of the epoch.
    """

    groups: np.ndarray
    shares: np.ndarray

    @property
    def probabilities(self) -> np.ndarray:
        """[N] probability of drawing each pool sample in one draw: its dataset's share over the
        dataset's size (the planner's sampled batches draw with these)."""
        sizes = np.bincount(self.groups, minlength=len(self.shares)).astype(np.float64)
        per_sample = np.divide(self.shares, sizes, out=np.zeros_like(self.shares), where=sizes > 0)
        p = per_sample[self.groups]
        return p / p.sum()

    def order(self, rng: np.random.Generator) -> np.ndarray:
        """[N] pool indices of one epoch: N draws of a dataset by `shares`, each dataset's draws
        taking its samples in a fresh permutation (cycled as often as needed)."""
        n = len(self.groups)
        present = np.bincount(self.groups, minlength=len(self.shares)) > 0
        shares = np.where(present, self.shares, 0.0)
        picks = rng.choice(len(shares), size=n, p=shares / shares.sum())
        out = np.empty(n, dtype=np.int64)
        for d in np.flatnonzero(present):
            members = np.flatnonzero(self.groups == d)
            need = int((picks == d).sum())
            passes = -(-need // len(members))
            stream = np.concatenate([rng.permutation(members) for _ in range(passes)]) if passes else members[:0]
            out[picks == d] = stream[:need]
        return out


def dataset_mix(dataset_of: Sequence[str], datasets: Sequence) -> DatasetMix | None:
    """The mix of the config's `datasets` (`dflop.config.DatasetSpec`) over a pool whose sample k
    comes from dataset ``dataset_of[k]``; None when no dataset has a weight (each sample once per
    epoch: datasets count by their size)."""
    weights = [d.weight for d in datasets]
    if all(w is None for w in weights):
        return None
    index = {d.name: i for i, d in enumerate(datasets)}
    groups = np.empty(len(dataset_of), dtype=np.int64)
    for k, name in enumerate(dataset_of):
        if name not in index:
            raise UserError(f"shapes sample {k} is from dataset {name!r}, which data.datasets does not name")
        groups[k] = index[name]
    shares = np.asarray([float(w) for w in weights], dtype=np.float64)
    present = np.bincount(groups, minlength=len(shares)) > 0
    if not (shares * present).sum() > 0:
        raise UserError("data.datasets[].weight: every dataset with a positive weight has no usable sample")
    return DatasetMix(groups, shares / shares.sum())
