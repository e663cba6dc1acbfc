"""A fixed number of slots holding expert records, keyed by (layer, expert).

Bookkeeping only (the bytes live in the tier that owns the pool): which key sits in which slot, which
slots are pinned (a load in flight, or an expert the current layer needs), and which key to evict,
ranked by an eviction policy. Slots come in up to two classes: the first ones wide (a record of the model's
format), the last `narrow` ones sized for cold records (layout/cold.py), which the keys `is_narrow` picks take;
each class turns over under a policy of its own. Single-threaded by design: only the runtime's main thread calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterator

from dsfp4.runtime.store.policy import POLICIES, EvictionPolicy

Key = Hashable


class SlotPool:
    def __init__(
        self, n_slots: int, policy: str = "lru", narrow: int = 0, is_narrow: Callable[[Key], bool] | None = None
    ):
        # some wide slots beside narrow ones
        assert 0 <= narrow < n_slots or narrow == n_slots == 0, (n_slots, narrow)
        assert is_narrow is not None or not narrow, "narrow slots need is_narrow"
        self.sizes = (n_slots - narrow, narrow) if narrow else (n_slots,)
        self.policies: list[EvictionPolicy] = [POLICIES[policy](n) for n in self.sizes]
        self.is_narrow = is_narrow
        self.slot_of: dict[Key, int] = {}
        self.key_of: list[Key | None] = [None] * n_slots
        self.pins = [0] * n_slots
        wide = self.sizes[0]
        self._free = [list(range(wide - 1, -1, -1)), list(range(n_slots - 1, wide - 1, -1))]

    def class_of(self, key: Key) -> int:
        """0: a wide slot; 1: a narrow one (the pool has narrow slots and `is_narrow` picks the key)."""
        return int(len(self.sizes) > 1 and self.is_narrow(key))

    def classes(self) -> Iterator[tuple[EvictionPolicy, int, Callable[[Key], bool]]]:
        """Each class's (policy, slots, whether a key takes it)."""
        for c, (policy, n) in enumerate(zip(self.policies, self.sizes, strict=True)):
            yield policy, n, lambda key, c=c: self.class_of(key) == c

    def fitting(self, keys: list[Key]) -> list[Key]:
        """The keys of `keys`, in order, as many of each class as its slots hold (a warm start's share)."""
        room, out = list(self.sizes), []
        for key in keys:
            c = self.class_of(key)
            if room[c]:
                room[c] -= 1
                out.append(key)
        return out

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def lookup(self, key: Key) -> int | None:
        """The key's slot (and count it as a use), or None."""
        slot = self.slot_of.get(key)
        if slot is not None:
            self.policies[self.class_of(key)].touch(key)
        return slot

    def allocate(self, key: Key, protected: Container[Key] = ()) -> tuple[int, Key | None] | None:
        """A slot of the key's class for `key` (a free one, else the class policy's victim among unpinned, unprotected
        keys): (slot, evicted key or None), or None when every slot of the class is pinned or protected."""
        assert key not in self.slot_of, key
        c = self.class_of(key)
        policy, evicted = self.policies[c], None
        if self._free[c]:
            slot = self._free[c].pop()
        else:
            evicted = policy.victim(_Pinned(self, protected))
            if evicted is None:
                return None
            slot = self.slot_of.pop(evicted)
            policy.remove(evicted)
        self.slot_of[key], self.key_of[slot] = slot, key
        policy.touch(key)
        return slot, evicted

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        assert self.pins[slot] > 0, slot
        self.pins[slot] -= 1

    def drop(self, key: Key) -> None:
        """Forget a key (its load failed): the slot becomes free."""
        slot = self.slot_of.pop(key)
        c = self.class_of(key)
        self.policies[c].remove(key)
        self.key_of[slot] = None
        self._free[c].append(slot)


class _Pinned:
    """Keys the policy must not pick: protected ones and those in pinned slots."""

    def __init__(self, pool: SlotPool, protected: Container[Key]):
        self.pool, self.protected = pool, protected

    def __contains__(self, key: Key) -> bool:
        return key in self.protected or self.pool.pins[self.pool.slot_of[key]] > 0
