"""Write-then-rename, so a reader never sees a half-written file under its final name; and the lock a
writer of a model folder holds (a conversion, a repack), so two never write it at once."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any

from dsfp4.errors import ConfigError, OutputError

LOCK_NAME = ".dsfp4.lock"


def require_folder(path: Path, what: str) -> Path:
    """`path`, a file to write, if it is not a folder and the folder it goes in exists and may be written (a read-only
    mount too); else a ConfigError naming `what` (a flag), before any work."""
    if Path(path).is_dir():
        raise ConfigError(f"{what} {path}: a folder, not a file; give a file name (e.g. {Path(path) / 'out'})")
    folder = Path(path).parent
    if not folder.is_dir():
        raise ConfigError(f"{what} {path}: the folder {folder} does not exist; create it or choose another")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: the folder {folder} cannot be written; choose another with {what}")
    return Path(path)


def lock_folder(folder: Path, busy: str) -> int:
    """Take `folder`'s writer lock: the descriptor to close when done, or OutputError(busy) if held."""
    fd = os.open(Path(folder) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        os.close(fd)
        raise OutputError(busy) from e
    return fd


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`data` at `path` whole or not at all: written beside it, synced, then renamed over it; a failed write (a full
    disk) removes what it had written. The temporary name is the writer's own (process and thread), so writers of one
    path in a shared folder (a prompt cache) never write or remove each other's."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())
