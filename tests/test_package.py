"""The installed package: every subpackage imports from outside the repo, the console script runs, and
convert/ and runtime/ never import each other."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_subpackages_import_from_outside_the_repo(tmp_path):
    code = (
        "import dsfp4, dsfp4.cli.main, dsfp4.convert.source.hf_config, dsfp4.convert.pipeline, dsfp4.layout.manifest, "
        "dsfp4.runtime, dsfp4.kernels; import importlib.util as u; "
        "assert u.find_spec('convert') is None and u.find_spec('layout') is None; print(dsfp4.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip()


def test_console_script_runs(tmp_path):
    exe = Path(sys.executable).with_name("dsfp4")
    out = subprocess.run([str(exe), "--help"], cwd=tmp_path, capture_output=True, text=True, check=True)
    for command in ("convert", "download", "profile-hot", "run", "inspect", "verify"):
        assert command in out.stdout


def _imports(folder: str) -> set[str]:
    names = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
    return names


def test_convert_and_runtime_stay_apart():
    assert not any(n.startswith("dsfp4.runtime") for n in _imports("convert"))
    assert not any(n.startswith("dsfp4.convert") for n in _imports("runtime"))
    assert not any(n.startswith(("dsfp4.convert", "dsfp4.runtime")) for n in _imports("layout"))
