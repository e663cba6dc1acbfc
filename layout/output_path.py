"""Where a command will write, checked before any work (before a model loads, before a disk-space sum): the
nearest existing folder must be a folder that can be written, a read-only filesystem named as such (not reported
as full), and a file's path must not be a folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dsfp4.errors import OutputError


def existing_folder(path: Path) -> Path:
    """The nearest existing folder at or above `path`: where its files will be created."""
    probe = Path(path)
    while not probe.exists():
        probe = probe.parent
    return probe


def writable_folder(path: Path, what: str) -> Path:
    """The nearest existing folder at or above `path`, if it can be written; else OutputError naming `what` (a flag
    or argument) and why."""
    probe = existing_folder(path)
    if not probe.is_dir():
        raise OutputError(f"{what} {path}: {probe} is a file, not a folder; choose another {what}")
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        raise OutputError(f"{what} {path}: {probe} is on a read-only filesystem; choose another {what}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: {probe} cannot be written (permissions); choose another {what}")
    return probe


def check_output_file(path: Path, what: str) -> Path:
    """`path` may be written as a file: not a folder, and in a folder that can be written."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} {path}: a folder, not a file; give a file name")
    writable_folder(path, what)
    return path


def free_space(path: Path, what: str) -> tuple[Path, int]:
    """(nearest existing folder, its filesystem's free bytes) of where `path` will be written, once it is known
    to be writable (writable_folder)."""
    probe = writable_folder(path, what)
    return probe, shutil.disk_usage(probe).free
