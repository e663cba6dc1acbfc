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


class Weights:
    """Reads backbone tensors of a converted model onto `device`; plain tensors in `dtype`."""

    def __init__(self, model_dir: Path, manifest: Manifest, device: torch.device, dtype: torch.dtype):
        self.dir, self.manifest, self.device, self.dtype = Path(model_dir), manifest, device, dtype
        self.used: set[str] = set()
        self._files: dict[str, object] = {}

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

    def _read(self, file: str, stored: str) -> torch.Tensor:
        try:
            if file not in self._files:
                # one file mapped at a time: its pages count in the process's RSS while it is open
                self._files = {file: safe_open(str(self.dir / file), framework="pt", device=str(self.device))}
            return self._files[file].get_tensor(stored)
        except (OSError, SafetensorError) as e:
            raise ManifestError(f"{self.dir / file}: cannot read tensor {stored} ({e}); run `dsfp4 verify`") from e

    def plain(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A norm, bias, router or embedding: one tensor, cast to `dtype` (default: the runtime dtype)."""
        entry = self._entry(name, shape)
        if FORMATS[entry.format].scale is not None:
            raise ManifestError(f"{self.dir}: tensor {name} is stored as {entry.format}, expected a plain tensor")
        return self._read(entry.file, entry.tensors["weight"]).to(dtype or self.dtype)

    def matrix(self, name: str, shape: tuple[int, int]) -> QuantizedWeight:
        """A projection in its stored format; kernels decide how to multiply by it."""
        entry = self._entry(name, shape)
        parts = tuple(self._read(entry.file, entry.tensors[c]) for c, _ in FORMATS[entry.format].components)
        return QuantizedWeight(entry.format, parts, tuple(shape), name)

    def close(self) -> None:
        self._files = {}

    def check_all_used(self, skip_prefixes: tuple[str, ...] = ()) -> None:
        unused = sorted(n for n in self.manifest.tensors if n not in self.used and not n.startswith(skip_prefixes))
        if unused:
            raise ManifestError(
                f"{self.dir}: tensor {unused[0]} in the manifest has no place in the model "
                f"({len(unused)} unused); the manifest does not match this dsfp4"
            )
