"""Hot-first repack: the same tokens after it, a contiguous hot prefix read sequentially by the warm
start, and an interrupted or killed repack leaves a model that loads and gives the same tokens."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsfp4.layout.repack as repack_module
from dsfp4.errors import ChecksumError, ManifestError, OutputError
from dsfp4.layout.atomic import lock_folder
from dsfp4.layout.direct_io import RecordFile
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.repack import repack
from dsfp4.layout.verify import verify
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.load import plan_run
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.placement import warm_start

CPU = torch.device("cpu")


def _tokens(model_dir: Path) -> list[int]:
    with Engine(model_dir, device="cpu", max_context=64) as engine:
        return engine.generate("Which experts are hot?", max_tokens=8, temperature=0).token_ids


def _profile(model_dir: Path) -> HotProfile:
    return HotProfile.read(model_dir / HOT_NAME)


def test_repack_keeps_tokens_and_puts_each_layer_hot_prefix_first(model, monkeypatch):
    before, conversion = _tokens(model), Manifest.read(model).conversion_sha256()
    profile = _profile(model)
    r = repack(model, profile)
    assert (r.rewritten, r.unchanged) == (2, 0)
    m = Manifest.read(model)
    n = m.record.nbytes
    for layer in (1, 2):
        assert [m.experts[layer].offsets[e] for e in profile.order(layer)] == [i * n for i in range(8)]
    assert m.experts[3].file == "experts/layer-003.bin"  # the MTP layer is not profiled: left as it was
    assert sorted(p.name for p in (model / "experts").iterdir()) == sorted(
        Path(e.file).name for e in m.experts.values()
    )
    assert m.conversion_sha256() == conversion
    verify(model)
    assert _tokens(model) == before  # hot.json is still this conversion's: the warm start used it
    assert repack(model, profile).rewritten == 0

    reads: list[tuple[str, int, int]] = []  # (file, offset, bytes) of each read call
    real = RecordFile.read_into

    def spy(self, bufs, offset):
        reads.append((self.path.name, offset, sum(len(b) for b in bufs)))
        return real(self, bufs, offset)

    monkeypatch.setattr(RecordFile, "read_into", spy)
    plan = plan_run(m, CPU, torch.float32, 64, RunOptions(device="cpu"), False)
    store = ExpertStore(model, m, CPU, type(plan)(**{**plan.__dict__, "gpu_slots": 4, "ram_slots": 8}))
    warm_start(store, profile)
    store.close()
    ranked = profile.ranked()
    for layer in (1, 2):  # its share of RAM's 8 hottest (the device's 4 among them): one sequential pass
        file = Path(m.experts[layer].file).name
        ours = [(o, b) for f, o, b in reads if f == file]
        warm = sum(1 for k in ranked[:8] if k[0] == layer)
        assert ours[0][0] == 0 and len(ours) <= 2 and sum(b for _, b in ours) == warm * n
        assert all(o2 == o1 + b1 for (o1, b1), (o2, _) in zip(ours, ours[1:], strict=False))


class Interrupt(BaseException):
    pass


@pytest.mark.slow
def test_an_interrupted_repack_leaves_a_model_that_loads_and_finishes_on_rerun(model, monkeypatch):
    before, profile = _tokens(model), _profile(model)
    real_copy = repack_module._copy_layer
    calls = []

    def copy_then_stop(model_dir, manifest, layer, target, dst, device):  # the second layer stops halfway through
        calls.append(dst)
        if len(calls) == 2:
            dst.write_bytes(b"\0" * manifest.record.nbytes * 3)
            raise Interrupt
        return real_copy(model_dir, manifest, layer, target, dst, device)

    monkeypatch.setattr(repack_module, "_copy_layer", copy_then_stop)
    with pytest.raises(Interrupt):
        repack(model, profile)
    m = Manifest.read(model)
    assert m.experts[1].file != "experts/layer-001.bin" and m.experts[2].file == "experts/layer-002.bin"
    verify(model)
    assert _tokens(model) == before

    real_write = Manifest.write

    def write_then_stop(self, out_dir):  # killed after the swap, before the old file is removed
        real_write(self, out_dir)
        raise Interrupt

    monkeypatch.setattr(repack_module, "_copy_layer", real_copy)
    monkeypatch.setattr(Manifest, "write", write_then_stop)
    with pytest.raises(Interrupt):
        repack(model, profile)
    monkeypatch.setattr(Manifest, "write", real_write)
    assert (model / "experts/layer-002.bin").exists()  # left behind, unnamed by the manifest
    assert _tokens(model) == before
    r = repack(model, profile)
    assert (r.rewritten, r.unchanged) == (0, 2)
    assert len(list((model / "experts").iterdir())) == 3  # leftovers (a .tmp, the old layer file) removed
    verify(model)


KILLED = """
import sys, time
import dsfp4.layout.repack as r
from dsfp4.layout.hot_profile import HotProfile
real = r._copy_layer
def slow(*args):
    out = real(*args)
    print("copied", flush=True)
    time.sleep(60)
    return out
r._copy_layer = slow
r.repack(sys.argv[1], HotProfile.read(sys.argv[1] + "/hot.json"))
"""


@pytest.mark.slow
def test_a_killed_repack_leaves_a_model_that_loads(model):
    before = _tokens(model)
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(model)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "copied"  # the first layer's new file is written, not yet swapped
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert any(p.suffix == ".tmp" for p in (model / "experts").iterdir())
    verify(model)
    assert _tokens(model) == before
    assert repack(model, _profile(model)).rewritten == 2
    assert _tokens(model) == before


def test_repack_writes_through_the_page_cache_where_o_direct_is_refused(model, monkeypatch):
    before, real_open = _tokens(model), os.open

    def refuse_direct(path, flags, *args):  # as tmpfs before Linux 6.6 does
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(repack_module.os, "open", refuse_direct)
    assert repack(model, _profile(model)).rewritten == 2
    monkeypatch.undo()
    verify(model)
    assert _tokens(model) == before


def test_repack_refuses_a_foreign_profile_a_busy_folder_and_a_damaged_record(model):
    profile = _profile(model)
    with pytest.raises(ManifestError, match="another model or conversion"):
        repack(model, HotProfile("0" * 64, 1, profile.counts))
    with pytest.raises(ManifestError, match="not a MoE layer of 8 experts"):
        repack(model, HotProfile(profile.conversion, 1, {1: (1,) * 4}))
    fd = lock_folder(model, "busy")
    try:
        with pytest.raises(OutputError, match="convert or repack"):
            repack(model, profile)
    finally:
        os.close(fd)
    m = Manifest.read(model)
    e = profile.order(2)[3]
    with open(model / m.experts[2].file, "r+b") as f:
        f.seek(m.experts[2].offsets[e] + 100)
        f.write(b"\xff\xfe")
    with pytest.raises(ChecksumError, match=f"expert {e} fails its sha256"):
        repack(model, profile)
    assert Manifest.read(model).experts[2] == m.experts[2]  # layer 2 untouched; no temporary file left
    assert not any(p.suffix == ".tmp" for p in (model / "experts").iterdir())
