"""The expert store of a run split across cards (--devices): one ExpertStore a card, each with its own device slots,
slot table, uploads and copy stream for its layers' records, all sharing the first card's pinned RAM cache, SSD
readers and counters (ExpertStore's `shares`). A layer's store is its card's (`store_of`): the MoE layers hold theirs,
and a prefetch of the next layer's guesses goes to that layer's card. This class is what the rest of the runtime
asks of a model's store as a whole (the engine, the decode graphs, the layer-wise pass, the stats).

What a split leaves out: zero-copy mapping (RAM's records read in place where device and RAM hold them all), which
is one device's (placement says so in the engine's notes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager

import numpy as np
import torch

from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.plan.lane_split import NO_LANE, LaneSplit
from dsfp4.runtime.plan.planner import Plan
from dsfp4.runtime.store.counters import StoreCounters
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.host_lane import HostLane
from dsfp4.runtime.store.layer_step import LayerAsk, LayerExperts
from dsfp4.runtime.store.slots import SlotPool

# (layer, expert)
Key = tuple[int, int]


class SplitStore:
    def __init__(
        self,
        manifest: Manifest,
        cards: list[torch.device],
        plan: Plan,
        make: Callable[[torch.device, Plan, ExpertStore | None], ExpertStore],
        lane: LaneSplit = NO_LANE,
    ):
        """A store a card of `plan.cards` (on `cards`), each made by `make(device, its plan, the store it shares)`
        (the run's one constructor: runtime/models/load.py), the first owning the RAM tier; open_host allocates it."""
        self.plan, self.manifest, self.layout = plan, manifest, manifest.record
        self.device, self.lane_split = cards[0], lane
        self.cuda = self.device.type == "cuda"
        self.cards: list[ExpertStore] = []
        for device, share in zip(cards, plan.cards, strict=True):
            mine = dataclasses.replace(
                plan,
                device=share.device,
                gpu_slots=share.gpu_slots,
                total_records=share.records,
                expert_layers=share.expert_layers,
                cards=(),
            )
            self.cards.append(make(device, mine, self.cards[0] if self.cards else None))
        self._card_of = {layer: c for c, share in enumerate(plan.cards) for layer in share.layers}
        for store in self.cards:
            store.route = self.store_of
        # never: mapping is one device's
        self.mapped = False
        self.warm_records, self.warm_s = 0, 0.0
        self.notes: list[str] = []

    def store_of(self, layer: int) -> ExpertStore:
        """The store of the card that holds `layer`."""
        return self.cards[self._card_of[layer]]

    def open_host(self) -> None:
        """The shared RAM cache (the first card's) and every card's transfers over it."""
        for store in self.cards:
            store.open_host()
        self.notes = list(self.cards[0].notes)

    @property
    def ram_pool(self) -> SlotPool:
        return self.cards[0].ram_pool

    @property
    def lane(self) -> HostLane | None:
        return self.cards[0].lane

    @property
    def counters(self) -> StoreCounters:
        """Every card's counts: they share one set."""
        return self.cards[0].counters

    @property
    def visible(self) -> bool:
        """Every card's kernels reach all of its layers' records without the host (a card of none trivially)."""
        return all(s.visible or not s.plan.total_records for s in self.cards)

    @property
    def all_resident(self) -> bool:
        return all(s.all_resident or not s.plan.total_records for s in self.cards)

    def step(self, ask: LayerAsk) -> LayerExperts:
        return self.store_of(ask.layer).step(ask)

    def offsets(self, layer: int, wave: list[int] | None = None) -> torch.Tensor:
        return self.store_of(layer).offsets(layer, wave)

    def prefetch(self, layer: int, experts: list[int], protect: set[Key]) -> None:
        self.store_of(layer).prefetch(layer, experts, protect)

    def read_ahead(self, keys: Iterable[Key], protected: set[Key]) -> None:
        """Each card reads its layers' records of `keys` (none of `keys` or `protected` evicted)."""
        keys = list(keys)
        keep = protected | set(keys)
        for c, store in enumerate(self.cards):
            store.read_ahead([k for k in keys if self._card_of[k[0]] == c], keep)

    def count_resident(self, layers: Iterable[int], uses: int) -> None:
        for layer in layers:
            self.store_of(layer).count_resident((layer,), uses)

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        with ExitStack() as stack:
            for store in self.cards:
                stack.enter_context(store.uncounted())
            yield

    def sync(self) -> None:
        for store in self.cards:
            store.sync()

    def close(self) -> None:
        """The cards' stores, the owner of the RAM tier and the readers last."""
        for store in reversed(self.cards):
            store.close()

    def residency(self) -> np.ndarray:
        """[layers, experts] int8 as ExpertStore's, over every card."""
        return np.maximum.reduce([s.residency() for s in self.cards])


def layer_store(experts: ExpertStore | SplitStore, layer: int) -> ExpertStore:
    """The store a model's layer asks for its experts: its card's in a split run."""
    return experts.store_of(layer) if isinstance(experts, SplitStore) else experts


def fewest_slots(experts: ExpertStore | SplitStore) -> int:
    """The device slots a token's experts of one layer may use at most: the store's, or the fewest of a split run's
    cards that hold MoE layers."""
    if isinstance(experts, SplitStore):
        return min((s.plan.gpu_slots for s in experts.cards if s.plan.total_records), default=0)
    return experts.plan.gpu_slots
