"""The slot pool's two classes: narrow keys take narrow slots and evict only each other, each class under a policy of
its own; and the planner's split of a RAM budget into record-sized and narrow slots."""

from __future__ import annotations

import pytest

from dsfp4.runtime.plan.planner import narrow_slots
from dsfp4.runtime.store.slots import SlotPool


def _pool(policy: str = "lru") -> SlotPool:
    return SlotPool(5, policy, narrow=3, is_narrow=lambda key: key[1] >= 10)  # experts 10+ are cold


@pytest.mark.parametrize("policy", ["lru", "lfu", "hot"])
def test_narrow_keys_take_narrow_slots_and_evict_only_each_other(policy):
    pool = _pool(policy)
    wide = [pool.allocate((0, e))[0] for e in range(2)]
    narrow = [pool.allocate((0, e))[0] for e in (10, 11, 12)]
    assert sorted(wide) == [0, 1] and sorted(narrow) == [2, 3, 4]
    slot, evicted = pool.allocate((0, 13))
    assert slot in narrow and evicted[1] >= 10  # a cold key evicts a cold one, never a wide one
    slot, evicted = pool.allocate((0, 2))
    assert slot in wide and evicted[1] < 10
    for slot in narrow:
        pool.pin(slot)
    assert pool.allocate((0, 14)) is None  # every narrow slot pinned: no wide one is taken instead
    freed = pool.slot_of[(0, 13)]
    pool.drop((0, 13))
    assert pool.allocate((0, 14)) == (freed, None)


def test_fitting_takes_each_class_up_to_its_slots_in_order():
    pool = _pool()
    keys = [(0, 10), (0, 0), (0, 11), (0, 12), (0, 13), (0, 1), (0, 2), (1, 0)]
    assert pool.fitting(keys) == [(0, 10), (0, 0), (0, 11), (0, 12), (0, 1)]
    assert SlotPool(4).fitting(keys) == keys[:4]  # one class: the first n
    assert SlotPool(4, narrow=0).class_of((0, 10)) == 0


def test_without_narrow_slots_every_key_takes_a_wide_one():
    pool = SlotPool(2, "lru")
    assert [pool.allocate((0, e))[0] for e in (10, 0)] == [0, 1]
    with pytest.raises(AssertionError):
        SlotPool(2, "lru", narrow=2, is_narrow=lambda key: True)  # narrow slots need wide ones beside them


MB = 1 << 20


@pytest.mark.parametrize(
    ("room", "n_cold", "beside", "want"),
    [
        (100 * MB, 0, 0, None),  # no cold records: record-sized slots
        (1000 * MB, 60, 0, None),  # RAM holds every record at full size: mapped runs read them widened in place
        (100 * MB, 60, 91, None),  # so it does beside the device's slots
        (300 * MB, 80, 0, (45, 25)),  # a slot for each of the 20 wide records, the rest of the room in narrow slots
        (250 * MB, 90, 0, (47, 37)),
        (100 * MB, 99, 0, (22, 20)),  # at least `least` wide slots
        (205 * MB, 80, 0, None),  # the 20 wide records do not fit beside 2 narrow slots: record-sized slots, shared
        (100 * MB, 60, 0, None),
    ],
)
def test_the_ram_budget_splits_into_wide_slots_first_then_narrow_ones(room, n_cold, beside, want):
    record, cold, total, least = 10 * MB, 4 * MB, 100, 2
    got = narrow_slots(room, record, cold, n_cold, total, least, beside)
    assert got == want
    if got is not None:
        ram, narrow = got
        assert (ram - narrow) * record + narrow * cold <= room and least <= narrow <= n_cold
        assert ram - narrow == max(total - n_cold, least)
