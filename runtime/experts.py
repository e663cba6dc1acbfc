"""Expert records on demand: the one interface through which the model gets routed experts.

This reader preads a record from its layer file each time it is asked (no cache); the expert store
issue backs the same interface with GPU slots, a pinned RAM cache and O_DIRECT reads.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dsfp4.errors import ChecksumError
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.record import RecordLayout, record_sha256
from dsfp4.layout.safetensors_file import pread_exact


class ExpertReader:
    """load(layer, experts) -> {expert: record bytes as a uint8 tensor on `device`}."""

    def __init__(self, model_dir: Path, manifest: Manifest, device: torch.device):
        self.dir, self.manifest, self.device = Path(model_dir), manifest, device
        self.layout: RecordLayout = manifest.record
        self._fds: dict[int, int] = {}
        self._verified: set[tuple[int, int]] = set()
        self.n_loads = 0
        self.bytes_read = 0

    def _fd(self, layer: int) -> int:
        if layer not in self._fds:
            self._fds[layer] = os.open(self.dir / self.manifest.experts[layer].file, os.O_RDONLY)
        return self._fds[layer]

    def load(self, layer: int, experts: list[int]) -> dict[int, torch.Tensor]:
        ef = self.manifest.experts[layer]
        out = {}
        for e in experts:
            raw = pread_exact(self._fd(layer), self.layout.nbytes, ef.offsets[e], self.dir / ef.file)
            if (layer, e) not in self._verified:  # first read of each record
                if record_sha256(memoryview(raw.numpy())) != ef.sha256[e]:
                    raise ChecksumError(
                        f"{self.dir / ef.file}: the record of expert {e} (layer {layer}) fails "
                        f"its sha256 check; run `dsfp4 verify` and convert again"
                    )
                self._verified.add((layer, e))
            out[e] = raw.to(self.device)
            self.n_loads += 1
            self.bytes_read += self.layout.nbytes
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
