"""The license the package declares is the one it ships, and the build backend it asks for can write it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# read as text: tomllib is Python 3.11's, and the package supports 3.10
PYPROJECT = (ROOT / "pyproject.toml").read_text()


def test_the_mit_license_is_shipped_and_declared():
    assert re.search(r'^license = "MIT"$', PYPROJECT, re.M) and re.search(
        r'^license-files = \["LICENSE"\]$', PYPROJECT, re.M
    )
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) the dsfp4 authors" in text


def test_the_setuptools_floor_builds_an_spdx_license():
    # setuptools reads `license = "MIT"` (PEP 639) and license-files from 77 on; 76 and earlier fail to build
    floor = re.search(r'^requires = \["setuptools>=(\d+)"\]$', PYPROJECT, re.M)
    assert floor is not None and int(floor.group(1)) >= 77
