"""Write-then-rename: a file appears whole under its name or not at all, and a failed write leaves nothing behind."""

from __future__ import annotations

import errno
import os

import pytest

from dsfp4.layout import atomic
from dsfp4.layout.atomic import atomic_write_bytes, atomic_write_json


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "entry.bin"
    path.write_bytes(b"old")
    atomic_write_bytes(path, b"new bytes")
    atomic_write_json(tmp_path / "a.json", {"k": 1})
    assert path.read_bytes() == b"new bytes" and (tmp_path / "a.json").read_text() == '{\n "k": 1\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "entry.bin"]


def test_a_full_disk_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "entry.bin"
    path.write_bytes(b"old")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["entry.bin"]
