"""Where the records start a split run (--devices): each card's device slots take the hottest records of its own
layers (all of them where its slots hold them all), then the shared RAM cache the hottest of every layer, as one
store's placement does (placement.py). Zero-copy mapping is one device's: a split streams what its slots do not hold.
"""

from __future__ import annotations

import time

from dsfp4.layout.hot_profile import HotProfile
from dsfp4.runtime.store.placement import hold_hottest, hottest_first, preload
from dsfp4.runtime.store.split_store import SplitStore

NO_MAPPING = (
    "zero-copy: the device slots and RAM hold every record, but a split reads none of RAM's in place (mapping is one "
    "device's); the records stream through each card's slots"
)


def place_split(store: SplitStore, profile: HotProfile | None, zero_copy: bool) -> str | None:
    """Place the records for a split run's start -> a note for the engine when zero-copy would have mapped them."""
    p, t0 = store.plan, time.perf_counter()
    every = all(s.plan.gpu_slots >= s.plan.total_records for s in store.cards)
    if every or profile is not None:
        ranked = hottest_first(store.manifest, p, profile if not every else None)
        if not every:
            ranked = [k for k in profile.ranked() if k[0] in p.expert_layers]
        for card in store.cards:
            mine = [k for k in ranked if k[0] in card.plan.expert_layers][: card.plan.gpu_slots]
            # through RAM, layer by layer: each card's own slots
            preload(card, mine, inclusive=False)
        # then RAM the hottest of all, the devices' among them (inclusive tiers, as one store's)
        to_ram = store.ram_pool.fitting(ranked)
        store.read_ahead(to_ram, set())
        store.sync()
        hold_hottest(store.ram_pool, ranked, p.gpu_slots + p.staging)
        store.warm_records, store.warm_s = len(to_ram) + p.gpu_slots, time.perf_counter() - t0
    mappable = zero_copy and not every and p.gpu_slots + p.ram_slots >= p.total_records > 0
    return NO_MAPPING if mappable and not p.cold_slots else None
