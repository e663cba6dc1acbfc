"""Backbone weights, taken from the manifest by name as each module is built (the module that uses a
weight asks for it, with the shape it expects), so nothing is guessed from file names and a missing,
misshapen or unused tensor is an error naming it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dsfp4.errors import ManifestError
from dsfp4.kernels.linear import QuantizedWeight
from dsfp4.layout.formats import FORMATS
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.models.card_map import CardMap
from dsfp4.runtime.models.host_memory import HostArena
from dsfp4.runtime.plan.host_backbone import HostBackbone


class Weights:
    """Reads backbone tensors of a converted model onto `device`; plain tensors in `dtype`. Those `on_host` holds go
    to `arena` instead (pinned host memory the device reads in place: runtime/models/host_memory.py). A split run's
    tensors and caches go to their layer's card (`cards`: runtime/models/card_map.py); `device` is then the first."""

    def __init__(
        self,
        model_dir: Path,
        manifest: Manifest,
        device: torch.device,
        dtype: torch.dtype,
        on_host: HostBackbone | None = None,
        arena: HostArena | None = None,
        cards: CardMap | None = None,
    ):
        self.dir, self.manifest, self.device, self.dtype = Path(model_dir), manifest, device, dtype
        self.on_host, self.arena, self.cards = on_host or HostBackbone(), arena, cards
        self.used: set[str] = set()
        self._files: dict[tuple[str, str], object] = {}

    def _entry(self, name: str, shape: tuple[int, ...]):
        entry = self.manifest.tensors.get(name)
        if entry is None:
            raise ManifestError(f"{self.dir}/manifest.json has no tensor {name}; convert the model again")
        if tuple(entry.shape) != tuple(shape):
            raise ManifestError(
                f"{self.dir}: tensor {name} has shape {list(entry.shape)}, the model expects {list(shape)}"
            )
        self.used.add(name)
        return entry

    def device_of(self, name: str) -> torch.device:
        """Where the backbone tensor `name` lives: the device, or its layer's card in a split run."""
        return self.device if self.cards is None else self.cards.of_name(name)

    def _read(self, file: str, stored: str, host: bool, name: str) -> torch.Tensor:
        """The stored tensor of `name` on its device, or on the CPU (`host`) for the arena."""
        key = (file, "cpu" if host else str(self.device_of(name)))
        try:
            if key not in self._files:
                # one file mapped at a time: its pages count in the process's RSS while it is open
                self._files = {k: f for k, f in self._files.items() if k[0] == file}
                self._files[key] = safe_open(str(self.dir / file), framework="pt", device=key[1])
            return self._files[key].get_tensor(stored)
        except (OSError, SafetensorError) as e:
            raise ManifestError(f"{self.dir / file}: cannot read tensor {stored} ({e}); run `dsfp4 verify`") from e

    def plain(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A norm, bias, router or embedding: one tensor, cast to `dtype` (default: the runtime dtype)."""
        entry = self._entry(name, shape)
        if FORMATS[entry.format].scale is not None:
            raise ManifestError(f"{self.dir}: tensor {name} is stored as {entry.format}, expected a plain tensor")
        host = self.on_host.holds(name)
        t = self._read(entry.file, entry.tensors["weight"], host, name).to(dtype or self.dtype)
        return self.arena.put(t) if host else t

    def matrix(self, name: str, shape: tuple[int, int]) -> QuantizedWeight:
        """A projection in its stored format; kernels decide how to multiply by it."""
        entry = self._entry(name, shape)
        host = self.on_host.holds(name)
        parts = tuple(self._read(entry.file, entry.tensors[c], host, name) for c, _ in FORMATS[entry.format].components)
        parts = tuple(self.arena.put(p) for p in parts) if host else parts
        return QuantizedWeight(entry.format, parts, tuple(shape), name)

    def cache(self, layer: int, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed cache of layer `layer` (default: the runtime dtype): on the device, or in the arena where the
        plan keeps the layer's caches in host memory (on_host.caches)."""
        dtype = dtype or self.dtype
        if self.on_host.holds_cache(layer):
            return self.arena.zeros(shape, dtype)
        device = self.device if self.cards is None else self.cards.of_layer(layer)
        return torch.zeros(shape, dtype=dtype, device=device)

    def close(self) -> None:
        self._files = {}

    def check_all_used(self, skip_prefixes: tuple[str, ...] = ()) -> None:
        unused = sorted(n for n in self.manifest.tensors if n not in self.used and not n.startswith(skip_prefixes))
        if unused:
            raise ManifestError(
                f"{self.dir}: tensor {unused[0]} in the manifest has no place in the model "
                f"({len(unused)} unused); the manifest does not match this dsfp4"
            )
