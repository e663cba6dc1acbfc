"""The license the package declares is the one it ships, and the build backend it asks for can write it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_mit_license_is_shipped_and_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT" and project["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) the dsfp4 authors" in text


def test_the_setuptools_floor_builds_an_spdx_license():
    # setuptools reads `license = "MIT"` (PEP 639) and license-files from 77 on; 76 and earlier fail to build
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    floor = next(re.fullmatch(r"setuptools>=(\d+)", r) for r in requires if r.startswith("setuptools"))
    assert floor is not None and int(floor.group(1)) >= 77
