"""A fixed number of equal slots holding expert records, keyed by (layer, expert).

Bookkeeping only (the bytes live in the tier that owns the pool): which key sits in which slot, which
slots are pinned (a load in flight, or an expert the current layer needs), and which key to evict,
ranked by an eviction policy. Single-threaded by design: only the runtime's main thread calls it.
"""

from __future__ import annotations

from collections.abc import Container, Hashable

from dsfp4.runtime.store.policy import POLICIES

Key = Hashable


class SlotPool:
    def __init__(self, n_slots: int, policy: str = "lru"):
        self.policy = POLICIES[policy](n_slots)
        self.slot_of: dict[Key, int] = {}
        self.key_of: list[Key | None] = [None] * n_slots
        self.pins = [0] * n_slots
        self._free = list(range(n_slots - 1, -1, -1))

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def lookup(self, key: Key) -> int | None:
        """The key's slot (and count it as a use), or None."""
        slot = self.slot_of.get(key)
        if slot is not None:
            self.policy.touch(key)
        return slot

    def allocate(self, key: Key, protected: Container[Key] = ()) -> tuple[int, Key | None] | None:
        """A slot for `key` (a free one, else the policy's victim among unpinned, unprotected keys):
        (slot, evicted key or None), or None when every slot is pinned or protected."""
        assert key not in self.slot_of, key
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            pinned = _Pinned(self, protected)
            evicted = self.policy.victim(pinned)
            if evicted is None:
                return None
            slot = self.slot_of.pop(evicted)
            self.policy.remove(evicted)
        self.slot_of[key], self.key_of[slot] = slot, key
        self.policy.touch(key)
        return slot, evicted

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        assert self.pins[slot] > 0, slot
        self.pins[slot] -= 1

    def drop(self, key: Key) -> None:
        """Forget a key (its load failed): the slot becomes free."""
        slot = self.slot_of.pop(key)
        self.policy.remove(key)
        self.key_of[slot] = None
        self._free.append(slot)


class _Pinned:
    """Keys the policy must not pick: protected ones and those in pinned slots."""

    def __init__(self, pool: SlotPool, protected: Container[Key]):
        self.pool, self.protected = pool, protected

    def __contains__(self, key: Key) -> bool:
        return key in self.protected or self.pool.pins[self.pool.slot_of[key]] > 0
