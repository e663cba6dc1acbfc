"""Code standards that CI enforces: ruff clean, no source file past the 500-line budget, and in the package no
function past 100 lines nor class past 25 methods."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
MAX_FUNCTION_LINES = 100
MAX_METHODS = 25
PACKAGE = ("dsfp4", "convert", "layout", "runtime", "kernels")  # dsfp4/ links the other four: read once
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


def _package_nodes() -> list[tuple[str, ast.AST]]:
    out = []
    for d in PACKAGE:
        for p in (ROOT / d).rglob("*.py"):
            out += [(str(p.relative_to(ROOT)), n) for n in ast.walk(ast.parse(p.read_text()))]
    return out


def test_no_function_past_100_lines_nor_class_past_25_methods():
    long, large = {}, {}
    for path, n in _package_nodes():
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno >= MAX_FUNCTION_LINES:
            long[f"{path}:{n.name}"] = n.end_lineno - n.lineno + 1
        if isinstance(n, ast.ClassDef):
            methods = sum(isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) for m in n.body)
            if methods > MAX_METHODS:
                large[f"{path}:{n.name}"] = methods
    assert not long, f"functions past {MAX_FUNCTION_LINES} lines: {long}"
    assert not large, f"classes past {MAX_METHODS} methods: {large}"
