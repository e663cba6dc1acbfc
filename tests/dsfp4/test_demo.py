"""`dsfp4 demo` runs offline end to end, and needs nothing beyond dsfp4's own dependencies."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from dsfp4.cli.main import cli


def test_demo_builds_converts_verifies_and_answers(tmp_path):
    r = CliRunner().invoke(cli, ["demo", "--dir", str(tmp_path), "--device", "cpu", "--max-tokens", "8"])
    assert r.exit_code == 0, r.output
    for step in ("1/4 building", "2/4 converting", "3/4 verifying", "OK:", "4/4 answering", "[length] prompt"):
        assert step in r.stderr
    assert r.stdout.strip()
    assert (tmp_path / "model" / "manifest.json").is_file()


@pytest.mark.slow
def test_demo_runs_without_transformers(tmp_path):
    code = (
        "import sys; sys.modules['transformers'] = None\n"  # any import of transformers fails
        "from dsfp4.cli.main import main; sys.argv = ['dsfp4', 'demo', '--device', 'cpu', '--max-tokens', '4']\n"
        "main()"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_v4_demo_builds_converts_verifies_and_answers(tmp_path):
    args = ["demo", "--family", "v4", "--dir", str(tmp_path), "--device", "cpu", "--max-tokens", "4"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert "DeepSeek-V4 checkpoint" in r.stderr and "MXFP4 experts repacked" in r.stderr and "[length]" in r.stderr
    manifest = (tmp_path / "model" / "manifest.json").read_text()
    assert '"family": "deepseek_v4"' in manifest
