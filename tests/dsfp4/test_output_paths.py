"""Outputs checked before the work: a folder where a file goes, a file where a folder goes, a read-only filesystem
(named as such, not as full); budgets blamed on the flag given; an interrupted export says it resumes."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.layout import output_path
from dsfp4.layout.manifest import MANIFEST_NAME
from dsfp4.runtime.plan import budget
from tests.fixtures.cli import assert_one_line_error, run_cli


@pytest.fixture
def read_only(monkeypatch):
    """Every filesystem reads as mounted read-only (statvfs' flag), as a small read-only mount does."""
    statvfs = os.statvfs
    monkeypatch.setattr(output_path.os, "statvfs", lambda p: SimpleNamespace(f_flag=statvfs(p).f_flag | os.ST_RDONLY))


@pytest.mark.parametrize(("gpu", "cpu", "flag"), [("30G", None, "--gpu-mem"), (None, "1T", "--cpu-mem")])
def test_a_cpu_budget_larger_than_the_host_is_blamed_on_the_flag_given(monkeypatch, gpu, cpu, flag):
    monkeypatch.setattr(budget, "available_ram", lambda: 8 * budget.GiB)
    monkeypatch.setattr(budget, "process_rss", lambda: budget.GiB // 2)
    with pytest.raises(ConfigError) as e:
        budget.resolve_budgets(gpu, cpu, None, torch.device("cpu"))
    message = str(e.value)
    assert message.startswith(f"{flag} ") and "6.90 GiB free" in message and "0 B" not in message


def test_a_string_format_version_is_named_as_such(converted, tmp_path):
    model = shutil.copytree(converted, tmp_path / "model")
    d = json.loads((model / MANIFEST_NAME).read_text())
    (model / MANIFEST_NAME).write_text(json.dumps({**d, "format_version": "1"}))
    r = run_cli("verify", model, "-q")
    assert_one_line_error(r, 'format_version is "1" (a string), not a number')
    assert "reads 1: " not in r.stderr


def test_convert_to_a_read_only_filesystem_says_so_not_full(checkpoints, tmp_path, read_only):
    r = run_cli("convert", "--fp4", checkpoints["fp8"], tmp_path / "out", "-q")
    assert_one_line_error(r, "is on a read-only filesystem; choose another OUT")
    assert "free" not in r.stderr


def test_export_checks_its_output_before_reading_the_model(tmp_path, read_only):
    # MODEL is no model at all: OUT's error comes first
    r = run_cli("export", tmp_path, tmp_path / "ct", "--format", "compressed-tensors")
    assert_one_line_error(r, "OUT", "read-only filesystem")


def test_export_to_a_file_is_refused_before_reading_the_model(tmp_path):
    (tmp_path / "f").write_text("x")
    r = run_cli("export", tmp_path, tmp_path / "f", "--format", "gguf")
    assert_one_line_error(r, "OUT", "a file, not a folder")


def test_eval_save_logits_into_a_folder_is_refused_before_the_model_loads(converted, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some words to score " * 10)
    (tmp_path / "lp").mkdir()
    save = ("--save-logits", tmp_path / "lp")
    r = run_cli("eval", converted, "--text", text, "--device", "cpu", "--context", "8", *save)
    assert_one_line_error(r, "--save-logits", "a folder, not a file")
    assert list((tmp_path / "lp").iterdir()) == [] and not (tmp_path / "lp.tmp").exists()


def test_ctrl_c_during_export_says_how_to_resume(converted, tmp_path, monkeypatch):
    from dsfp4.convert.export import writer

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer.SafetensorsWriter, "write", interrupted)
    r = run_cli("export", converted, tmp_path / "ct", "--format", "compressed-tensors", "-q")
    assert r.exit_code == 130 and "interrupted: run the same command again to resume" in r.stderr
