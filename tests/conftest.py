"""Shared fixtures: tiny DeepSeek-V3 checkpoints built once per session, converted outputs, helpers."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on the CPU (set before they load)
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from tiny_checkpoint import build_checkpoint  # noqa: E402

from dsfp4.convert.pipeline import convert  # noqa: E402
from dsfp4.convert.plan import ConvertOptions  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The three source variants of the same tiny model: fp8 (official layout), bf16, nvfp4 (ModelOpt)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {v: build_checkpoint(root / v, v) for v in ("fp8", "bf16", "nvfp4")}


@pytest.fixture(scope="session")
def converted(checkpoints, tmp_path_factory) -> Path:
    """The fp8 checkpoint converted with default options."""
    out = tmp_path_factory.mktemp("converted") / "fp8"
    convert(checkpoints["fp8"], out, ConvertOptions(), progress=False)
    return out


@pytest.fixture(scope="session")
def v4_checkpoint(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V4 checkpoint in the official layout, weights from transformers (tests/v4_checkpoint.py)."""
    from v4_checkpoint import build_v4_checkpoint

    return build_v4_checkpoint(tmp_path_factory.mktemp("v4") / "hf")


@pytest.fixture(scope="session")
def v4_converted(v4_checkpoint, tmp_path_factory) -> Path:
    """The tiny V4 checkpoint converted with default options (MXFP4 experts repacked, FP8 backbone)."""
    out = tmp_path_factory.mktemp("v4") / "model"
    convert(v4_checkpoint, out, ConvertOptions(), progress=False)
    return out


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_header(path: Path, edit) -> None:
    """Apply edit(header_dict) to a safetensors file's header, keeping the data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_cli(*args):
    """Invoke the dsfp4 command in-process; stderr is kept apart from stdout."""
    from click.testing import CliRunner

    from dsfp4.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_one_line_error(result, *needles, after_start: bool = False):
    """Exit status 1 and exactly one stderr line, "error: ...", naming every needle. after_start: the run
    had begun (its plan table came first), so only the last line is the error."""
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    if after_start:
        assert lines[0].startswith("budgets"), result.stderr
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert sum(line.startswith("error") for line in result.stderr.splitlines()) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def reshard(src: Path, dst: Path, shard_of) -> None:
    """Write checkpoint src again at dst with its tensors in other shards: shard_of(tensor name) -> file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards: dict[str, dict] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(src / shard, "pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shards.setdefault(shard_of(k), {})[k] = f.get_tensor(k)
    for name, part in shards.items():
        save_file(part, dst / name)
    weight_map = {k: name for name, part in shards.items() for k in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for p in src.iterdir():
        if not p.name.endswith("safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy(p, dst / p.name)
