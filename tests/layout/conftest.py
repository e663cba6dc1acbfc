"""The layout tests' converted model with a hot profile of its main MoE layers."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest


@pytest.fixture
def model(converted, tmp_path) -> Path:
    """A copy of the converted tiny model, its hot.json counting each main MoE layer's experts in a shuffled order."""
    path = Path(shutil.copytree(converted, tmp_path / "model"))
    manifest = Manifest.read(path)
    rng = np.random.default_rng(1)
    counts = {layer: tuple(int(c) for c in rng.permutation(8) * 3) for layer in (1, 2)}  # the main MoE layers
    HotProfile(manifest.conversion_sha256(), 12, counts).write(path / HOT_NAME)
    return path
