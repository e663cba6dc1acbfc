"""Shared fixtures: tiny DeepSeek-V3 checkpoints built once per session, converted outputs, helpers."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on the CPU (set before they load)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n`: a worker a core; torch's own threads would oversubscribe them
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # and the tests' subprocesses'

from dsfp4.convert.pipeline import convert
from dsfp4.convert.plan import ConvertOptions
from tests.fixtures.converted import convert_fp8
from tests.fixtures.tiny_checkpoint import build_checkpoint


def _installed(name: str) -> None:
    """Import the installed distribution of top-level name `name` ahead of the checkout's folder of that name, which
    the root on sys.path would put first: transformers from 5.25 imports Hugging Face's `kernels` package, and
    kernels/ here is dsfp4.kernels (nothing imports it by its top-level name). Nothing happens where none is
    installed."""
    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != root]
    try:
        if name not in sys.modules and importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    finally:
        sys.path[:] = saved


_installed("kernels")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cpu_threads():
    """Sets torch's CPU threads for the test (a worker of `pytest -n` runs with one), restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The three source variants of the same tiny model: fp8 (official layout), bf16, nvfp4 (ModelOpt)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {v: build_checkpoint(root / v, v) for v in ("fp8", "bf16", "nvfp4")}


@pytest.fixture(scope="session")
def converted(checkpoints, tmp_path_factory) -> Path:
    """The fp8 checkpoint converted with default options."""
    return convert_fp8(checkpoints, tmp_path_factory, "fp8")


@pytest.fixture(scope="session")
def v4_checkpoint(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V4 checkpoint in the official layout, weights from transformers (fixtures/v4_checkpoint.py)."""
    from tests.fixtures.v4_checkpoint import build_v4_checkpoint

    return build_v4_checkpoint(tmp_path_factory.mktemp("v4") / "hf")


@pytest.fixture(scope="session")
def v4_converted(v4_checkpoint, tmp_path_factory) -> Path:
    """The tiny V4 checkpoint converted with default options (MXFP4 experts repacked, FP8 backbone)."""
    out = tmp_path_factory.mktemp("v4") / "model"
    convert(v4_checkpoint, out, ConvertOptions(), progress=False)
    return out


@pytest.fixture(scope="session")
def mxfp4_converted(checkpoints, tmp_path_factory) -> Path:
    """The fp8 checkpoint converted with MXFP4 experts (the exports' fixture)."""
    return convert_fp8(checkpoints, tmp_path_factory, "mxfp4", format="mxfp4")
