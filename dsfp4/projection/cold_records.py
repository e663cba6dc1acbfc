"""The cold records a projection counts (layout/cold.py): which records are stored in cold codes and how many bytes
each moves, by layer where a cold recipe (layout/recipe.py) gives layers different bits."""

from __future__ import annotations

import functools
from dataclasses import dataclass

# (layer, expert)
Key = tuple[int, int]


@dataclass(frozen=True)
class ColdRecords:
    """Records stored in cold codes: `keys`, each `nbytes` long on the SSD and over PCIe (widened on the device, at no
    cost counted here), or its layer's bytes in `layer_nbytes` ((layer, bytes), where a recipe's layers differ);
    `nbytes` is then the largest, what a narrow slot holds. `slots`: of the RAM slots, those sized for them
    (Plan.cold_slots; 0: they take record-sized ones)."""

    keys: frozenset[Key] = frozenset()
    nbytes: int = 0
    slots: int = 0
    layer_nbytes: tuple[tuple[int, int], ...] = ()

    @functools.cached_property
    def _by_layer(self) -> dict[int, int]:
        return dict(self.layer_nbytes)

    def size(self, key: Key) -> int:
        """The bytes of the cold record of key (layer, expert)."""
        return self._by_layer.get(key[0], self.nbytes)
