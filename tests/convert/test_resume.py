"""Resuming and refusing: interrupted, failed and killed conversions, --force, the lock, dry-run notes."""

from __future__ import annotations

import fcntl
import os

import pytest

import dsfp4.convert.part as part_module
import dsfp4.convert.pipeline as pipeline
from dsfp4.convert.part import PartRun
from dsfp4.convert.plan import ConvertOptions
from dsfp4.errors import OutputError
from dsfp4.layout.atomic import LOCK_NAME
from dsfp4.layout.manifest import MANIFEST_NAME, Manifest
from tests.fixtures.files import tree_bytes


def test_interrupted_conversion_resumes_to_identical_bytes(checkpoints, converted, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real, calls = PartRun.finalize, []

    def dying(run):
        calls.append(run.part.name)
        if len(calls) == 3:  # two parts are done, the third has all its bytes but no marker
            (out / run.part.backbone_file).with_suffix(".safetensors.partial").write_bytes(b"junk")
            raise KeyboardInterrupt
        return real(run)

    monkeypatch.setattr(PartRun, "finalize", dying)
    with pytest.raises(KeyboardInterrupt):
        pipeline.convert(checkpoints["fp8"], out, ConvertOptions(), progress=False)
    assert not (out / MANIFEST_NAME).exists()
    monkeypatch.setattr(PartRun, "finalize", real)
    result = pipeline.convert(checkpoints["fp8"], out, ConvertOptions(), progress=False)
    assert result.resumed_parts == 2
    assert tree_bytes(out) == tree_bytes(converted)


def test_resuming_with_other_options_is_refused_and_force_starts_over(checkpoints, tmp_path, monkeypatch):
    from dsfp4.errors import OutputError

    out = tmp_path / "out"
    monkeypatch.setattr(PartRun, "finalize", lambda run: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        pipeline.convert(checkpoints["fp8"], out, ConvertOptions(), progress=False)
    monkeypatch.undo()
    with pytest.raises(OutputError, match="interrupted conversion of another source"):
        pipeline.convert(checkpoints["fp8"], out, ConvertOptions(format="mxfp4"), progress=False)
    keep = out / "notes.txt"
    keep.write_text("mine")
    pipeline.convert(checkpoints["fp8"], out, ConvertOptions(format="mxfp4", force=True), progress=False)
    assert Manifest.read(out).record.format == "mxfp4" and keep.read_text() == "mine"


def test_failure_inside_a_part_leaves_no_manifest_and_resumes(checkpoints, converted, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real, calls = part_module.expert_record, []

    def failing(*a):
        calls.append(1)
        if len(calls) == 12:  # in the second MoE part, with other experts in flight
            raise RuntimeError("disk on fire")
        return real(*a)

    monkeypatch.setattr(part_module, "expert_record", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        pipeline.convert(checkpoints["fp8"], out, ConvertOptions(workers=3), progress=False)
    assert not (out / MANIFEST_NAME).exists()
    monkeypatch.setattr(part_module, "expert_record", real)
    pipeline.convert(checkpoints["fp8"], out, ConvertOptions(), progress=False)
    assert tree_bytes(out) == tree_bytes(converted)


KILL_DIMS = dict(
    hidden_size=512,
    moe_intermediate_size=256,
    n_routed_experts=32,
    num_hidden_layers=5,
    intermediate_size=512,
    q_lora_rank=128,
    kv_lora_rank=128,
    num_attention_heads=4,
    vocab_size=1024,
    n_group=4,
    topk_group=2,
)


@pytest.mark.slow
def test_killed_conversion_resumes_to_identical_bytes(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tests.fixtures.tiny_checkpoint import build_checkpoint

    src = build_checkpoint(tmp_path / "src", "fp8", KILL_DIMS, synthetic=True)
    cmd = [
        sys.executable,
        "-m",
        "dsfp4.cli.main",
        "convert",
        "--fp4",
        str(src),
        str(tmp_path / "out"),
        "-q",
        "--workers",
        "1",
        "--device",
        "cpu",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = tmp_path / "out" / ".dsfp4-convert" / "layer-000.json"
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "out" / MANIFEST_NAME).exists(), "the conversion finished before it could be killed"
    subprocess.run(cmd, check=True, capture_output=True)
    clean = tmp_path / "clean"
    pipeline.convert(src, clean, ConvertOptions(device="cpu"), progress=False)
    assert tree_bytes(tmp_path / "out") == tree_bytes(clean)


def test_a_second_run_on_the_same_output_is_refused(checkpoints, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a running conversion holds it
    try:
        with pytest.raises(OutputError, match=r"another dsfp4 process \(convert or repack\) is writing"):
            pipeline.convert(checkpoints["fp8"], out, ConvertOptions(), progress=False)
    finally:
        os.close(fd)
    pipeline.convert(checkpoints["fp8"], out, ConvertOptions(), progress=False)  # a stale lock file is fine
    assert (out / MANIFEST_NAME).exists()


def test_dry_run_reports_what_a_real_run_would_find(checkpoints, converted, tmp_path, monkeypatch):
    fresh = pipeline.convert(checkpoints["fp8"], tmp_path / "new", ConvertOptions(dry_run=True), progress=False)
    assert fresh.notes[0].startswith("disk    needs") and len(fresh.notes) == 1
    done = pipeline.convert(checkpoints["fp8"], converted, ConvertOptions(dry_run=True), progress=False)
    assert "already holds a converted model" in done.notes[0]
    forced = pipeline.convert(checkpoints["fp8"], converted, ConvertOptions(dry_run=True, force=True), progress=False)
    assert any(n.startswith("force") for n in forced.notes)
    monkeypatch.setattr(PartRun, "finalize", lambda run: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        pipeline.convert(checkpoints["fp8"], tmp_path / "half", ConvertOptions(), progress=False)
    monkeypatch.undo()
    half = pipeline.convert(checkpoints["fp8"], tmp_path / "half", ConvertOptions(dry_run=True), progress=False)
    assert any(n.startswith("resume  0 of 5 parts") for n in half.notes)
