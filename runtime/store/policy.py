"""Eviction policies for a fixed set of slots keyed by (layer, expert).

A policy only ranks keys; the slot pool decides what may be evicted (never a pinned slot or an expert
the current layer needs) and asks `victim(protected)` for the best candidate among the rest. The same
classes drive the runtime's tiers and the replay tool, so what the replay measures is what runs.

A new policy is a class that meets `EvictionPolicy`: built as `cls(capacity)` (the slots of one pool's class),
a class attribute `name`, and `touch` (a key placed or used), `remove` (a key left the pool) and `victim`
(the key to evict, skipping `protected`); `hold` (`HoldingPolicy`) is optional: the warm start
(store/placement.py) gives its hottest keys to a policy that has it. It is registered in POLICIES (by its name:
what SlotPool builds) and run through TIER_POLICIES, whose keys are the choices of --policy and RunOptions.policy,
each naming the (device, RAM) pools' policies.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable
from typing import Protocol

Key = Hashable
# LFU memory: uses of the pool, in pool sizes (tuned on traces: docs/BENCHMARKS.md)
HALF_LIFE_TURNOVERS = 4


class EvictionPolicy(Protocol):
    """What a slot pool asks of its policy: it is told of every key placed, used and gone, and names a victim."""

    # its key in POLICIES
    name: str

    def touch(self, key: Key) -> None:
        """key was placed in the pool or used there."""

    def remove(self, key: Key) -> None:
        """key left the pool (evicted, or its load failed)."""

    def victim(self, protected: Container[Key]) -> Key | None:
        """The resident key to evict next, none of `protected`; None when every resident key is protected."""


class HoldingPolicy(EvictionPolicy, Protocol):
    """A policy that can keep a set of keys (a warm start's hottest records) out of eviction."""

    def hold(self, keys: Iterable[Key]) -> None:
        """Never pick these keys as victims."""


class LRU:
    """Least recently used: recency alone (published measurements favour it on flat routing)."""

    name = "lru"

    def __init__(self, capacity: int):
        self._order: OrderedDict[Key, None] = OrderedDict()

    def touch(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, protected: Container[Key]) -> Key | None:
        return next((k for k in self._order if k not in protected), None)


class LFUDecay:
    """Frequency with exponential decay: each use adds 1, halved every `half_life` uses of the pool.

    Scores persist after eviction (a ghost history, one float per key): a key's frequency is what it
    was used, not what it was used while cached, so a pool smaller than one token's working set keeps
    a stable hot subset instead of cycling every key through (which makes recency score nothing).
    Scores use forward decay (a use at time t adds 2^(t/half_life)), so ranking needs no rescan; a heap
    with lazy deletion finds the smallest resident score. Ties go to the least recent.
    """

    name = "lfu"

    def __init__(self, capacity: int, half_life: float | None = None):
        self.half_life = float(half_life or HALF_LIFE_TURNOVERS * max(capacity, 1))
        self._score: dict[Key, float] = {}
        self._resident: set[Key] = set()
        self._heap: list[tuple[float, int, Key]] = []
        self._clock = 0
        # clock at the last rescale, so 2^(t/half_life) stays in range
        self._base = 0

    def touch(self, key: Key) -> None:
        self._clock += 1
        exponent = (self._clock - self._base) / self.half_life
        # rescale every score by the same factor: the order is unchanged
        if exponent > 500:
            factor = 2.0**-exponent
            self._score = {k: s * factor for k, s in self._score.items() if s * factor > 0}
            self._base, exponent = self._clock, 0.0
            self._rebuild()
        score = self._score.get(key, 0.0) + math.pow(2.0, exponent)
        self._score[key] = score
        self._resident.add(key)
        heapq.heappush(self._heap, (score, self._clock, key))
        # drop stale entries now and then
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self._score.get(k, 0.0), self._clock, k) for k in self._resident]
        heapq.heapify(self._heap)

    def remove(self, key: Key) -> None:
        # its score stays; its heap entries go stale and are skipped
        self._resident.discard(key)

    def victim(self, protected: Container[Key]) -> Key | None:
        skipped, found = [], None
        while self._heap:
            score, t, key = self._heap[0]
            # stale entry
            if key not in self._resident or self._score.get(key) != score:
                heapq.heappop(self._heap)
                continue
            if key in protected:
                skipped.append(heapq.heappop(self._heap))
                continue
            found = key
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found


class HeldLRU(LRU):
    """LRU over the keys not held: the keys given to `hold` (a warm start's hottest records) are never victims,
    the rest of the pool turns over by recency. Held keys are kept out of the recency order, so an eviction costs
    what plain LRU's does."""

    name = "hot"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.held: set[Key] = set()

    def hold(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self.held.add(key)
            self._order.pop(key, None)

    def touch(self, key: Key) -> None:
        if key not in self.held:
            super().touch(key)


# what one pool can run, built with its capacity
POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {p.name: p for p in (LRU, LFUDecay, HeldLRU)}
# What a run chooses (--policy): the (device, RAM) pools' policies. "mix" keeps a stable frequent set in
# a device tier too small for a token's working set, where recency thrashes, and recency in RAM. "hot" holds
# HOT_SHARE of RAM for the warm start's hottest records and runs LRU on the rest (docs/BENCHMARKS.md: SSD-bound
# projections under calibrated DeepSeek-V3 traces)
TIER_POLICIES = {"lru": ("lru", "lru"), "lfu": ("lfu", "lfu"), "mix": ("lfu", "lru"), "hot": ("lfu", "hot")}
# of the RAM slots, held for the hottest records when the policy is "hot"
HOT_SHARE = 0.75
