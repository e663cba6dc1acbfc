"""Where the records start a run: every record on the device when the slots hold them all; every record placed once
(hottest on the device, the rest read from pinned RAM in place) when device and RAM hold them all and the kernels
may read RAM; else the hot profile's hottest records in device slots and in RAM (inclusive, as the tiers run)."""

from __future__ import annotations

import time

import torch

from dsfp4.layout.hot_profile import HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.plan.planner import Plan
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.policy import HOT_SHARE
from dsfp4.runtime.store.slots import SlotPool
from dsfp4.runtime.store.use_counts import DeviceUseCounts

# (layer, expert)
Key = tuple[int, int]


def hottest_first(manifest: Manifest, plan: Plan, profile: HotProfile | None) -> list[Key]:
    """Every (layer, expert) record the plan uses, in the order tiers should take them: the hot profile's
    ranking first (when there is one), the rest in file order."""
    used = plan.expert_layers
    ranked = [k for k in profile.ranked() if k[0] in used] if profile is not None else []
    taken = set(ranked)
    n = manifest.args.n_routed_experts
    rest = [(layer, e) for layer in sorted(used) for e in range(n) if (layer, e) not in taken]
    return ranked + sorted(rest, key=manifest.file_position)


def place_records(store: ExpertStore, profile: HotProfile | None, zero_copy: bool) -> None:
    """Place the records for a run's start (module docstring); `zero_copy`: kernels may read pinned RAM in place."""
    p = store.plan
    if store.cuda and p.gpu_slots >= p.total_records > 0:
        # every expert fits: all on the device, and decode steps can be captured
        fill(store)
    elif zero_copy and not p.cold_slots and p.gpu_slots + p.ram_slots >= p.total_records > 0:
        # the rest read from RAM in place: graphs too
        map_all(store, hottest_first(store.manifest, p, profile))
    elif profile is not None:
        warm_start(store, profile)


def warm_start(store: ExpertStore, profile: HotProfile) -> None:
    """Hottest records to the device slots and to RAM (preload). Each layer's share is read in file order, adjacent
    records together: after a hot-first repack, the hot prefix of every layer is read in one sequential pass."""
    preload(store, [k for k in profile.ranked() if k[0] in store.plan.expert_layers])


def fill(store: ExpertStore) -> None:
    """Every record of the used layers onto the device (the plan's slots hold them all): from then on the MoE
    layers find every expert on the device and never wait for the host."""
    n, p = store.manifest.args.n_routed_experts, store.plan
    assert p.gpu_slots >= p.total_records, "fill() needs a device slot per record"
    preload(store, [(layer, e) for layer in p.expert_layers for e in range(n)])


def map_all(store: ExpertStore, ranked: list[Key]) -> None:
    """Place every record of the used layers once: the first gpu_slots of `ranked` (every used record, hottest
    first) in device slots, the others in the pinned RAM cache, where the kernels read them in place over PCIe
    (zero-copy: as many bytes as a copy, without the copy's wait or a slot). From then on nothing moves, MoE
    layers never ask the host, and their uses are counted on the device."""
    p, n = store.plan, store.manifest.args.n_routed_experts
    used = [(layer, e) for layer in sorted(p.expert_layers) for e in range(n)]
    assert sorted(ranked) == used, "map_all() ranks every used record once"
    assert p.gpu_slots + p.ram_slots >= p.total_records, "map_all() needs a device or RAM slot per record"
    assert not p.cold_slots, "map_all() widens cold records in record-sized RAM slots"
    # each record once: a slot for every one
    preload(store, ranked, inclusive=False)
    tier = store.residency()  # [blocks, experts]: 2 on the device, 1 in RAM only
    # the RAM slots of the records read in place
    host = torch.full(tier.shape, -1, dtype=torch.int32)
    for (layer, e), rslot in store.ram_pool.slot_of.items():
        host[layer, e] = rslot if tier[layer, e] == 1 else -1
    assert int((tier > 0).sum()) == p.total_records, "a record found no slot"
    store.map(host, DeviceUseCounts(tier == 2, store.device))


def hold_hottest(pool: SlotPool, ranked: list[Key], keep_free: int) -> None:
    """Under a policy that holds a hot set ("hot"), the hottest HOT_SHARE of each slot class's records, by `ranked`
    (hottest first), are held: never evicted; at least `keep_free` slots of a class stay free to turn over (a wave of
    loads needs them)."""
    for policy, slots, takes in pool.classes():
        if hasattr(policy, "hold"):
            present = [k for k in ranked if k in pool and takes(k)]
            policy.hold(present[: max(0, min(int(HOT_SHARE * slots), slots - keep_free))])


def preload(store: ExpertStore, ranked: list[Key], inclusive: bool = True) -> None:
    """The first gpu_slots of `ranked` onto the device and, as the tiers are inclusive, the first that the RAM slots
    hold into RAM (SlotPool.fitting: the device's among them, so a record the device evicts is still a RAM hit, and
    RAM's held hot set starts at the hottest); waits for all of it. A device larger than RAM, or `inclusive` False
    (map_all: every record once), takes the device's records through RAM, layer by layer in file order, and RAM then
    holds the next ones."""
    t0 = time.perf_counter()
    p, pool = store.plan, store.ram_pool
    if inclusive and p.gpu_slots <= p.ram_slots:
        to_gpu, to_ram = ranked[: p.gpu_slots], pool.fitting(ranked)
        # in file order, adjacent records together
        store.read_ahead(to_ram, set())
        store.sync()
        for key in sorted(to_gpu, key=store.manifest.file_position):
            # from its RAM copy
            store.start(key, set(), wait=True)
        store.sync()
        hold_hottest(store.ram_pool, ranked, p.gpu_slots + p.staging)
        store.warm_records, store.warm_s = len(to_ram), time.perf_counter() - t0
        return
    to_gpu, to_ram = ranked[: p.gpu_slots], pool.fitting(ranked[p.gpu_slots :])
    for layer in sorted({layer for layer, _ in to_gpu}):
        keys = sorted((k for k in to_gpu if k[0] == layer), key=store.manifest.file_position)
        # through RAM, as much at once as its slots of each size hold
        while keys:
            now = pool.fitting(keys)
            store.read_ahead(now, set())
            for key in now:
                store.start(key, set(), wait=True)
            taken = set(now)
            keys = [k for k in keys if k not in taken]
    # the device part's RAM copies become evictable, so the RAM part reads without a break
    store.sync()
    store.read_ahead(to_ram, set())
    store.sync()
    hold_hottest(store.ram_pool, ranked, p.gpu_slots + p.staging)
    store.warm_records, store.warm_s = len(to_gpu) + len(to_ram), time.perf_counter() - t0
