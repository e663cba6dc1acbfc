"""What the README tells a new user to type: the CPU-only PyTorch install names PyTorch's CPU index (plain pip
installs the CUDA build and its nvidia packages), and the test command is the one .ci/run runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_the_cpu_only_torch_install_uses_pytorchs_cpu_index():
    text = (ROOT / "README.md").read_text()
    installs = re.findall(r"`(pip install torch[^`]*)`", text)
    cpu = [c for c in installs if "cpu" in c.lower() or CPU_INDEX in c]
    assert cpu and all(f"--index-url {CPU_INDEX}" in c for c in cpu), installs
    assert not any(re.fullmatch(r"pip install torch==[0-9.]+", c) for c in installs), installs


def test_ci_runs_the_readmes_test_command():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci/run").read_text()
    command = re.search(r"pip install -e '\.\[test\]' && (python -m pytest -q[^\n]*)", readme)
    assert command and f"{command.group(1)}\n" in ci, command
