"""Code standards that CI enforces: ruff clean, and no source file past the 500-line budget."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
# the environment's own ruff first: a venv run by its python (not activated) has it only beside that python
BESIDE = Path(sys.executable).with_name("ruff")
RUFF = str(BESIDE) if BESIDE.is_file() else shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed")
def test_ruff_clean():
    out = subprocess.run([RUFF, "check", "--no-cache", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_no_file_past_the_line_budget():
    files = [
        p
        for d in ("dsfp4", "convert", "layout", "runtime", "kernels", "scripts", "tests")
        for p in (ROOT / d).rglob("*.py")
    ]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files past {MAX_LINES} lines: {long}"
