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
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, TypeVar

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
