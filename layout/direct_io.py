"""Reading expert records with O_DIRECT: straight from the SSD into our own (pinned) buffers, so the
page cache never holds a second copy of what the RAM cache already budgets for.

O_DIRECT needs the file offset, the length and the buffer address aligned (4096 covers every common
block size; records are laid out that way). Filesystems without it (tmpfs, some network mounts) fall
back to ordinary reads, with a note, and drop the pages they read from the page cache.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np

from dsfp4.errors import FormatError

DIRECT_ALIGN = 4096


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array of nbytes (anonymous memory, not yet touched)."""
    mm = mmap.mmap(-1, max(nbytes, 1))
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes)


def open_direct(path: Path, flags: int, mode: int = 0o644) -> tuple[int, bool]:
    """(fd, direct): the file opened with O_DIRECT where its filesystem allows it, else without. Some
    filesystems take the flag at open and refuse the I/O, so one aligned block is read (or, for a file
    opened to write, written: the caller overwrites it) before O_DIRECT is trusted."""
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT, mode)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            probe = memoryview(aligned_buffer(DIRECT_ALIGN))
            try:
                (os.pwritev if flags & (os.O_WRONLY | os.O_RDWR) else os.preadv)(fd, [probe], 0)
                return fd, True
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EINVAL:
                    raise
    return os.open(path, flags, mode), False


class RecordFile:
    """One layer file, opened with O_DIRECT when its filesystem allows it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd, self.direct = open_direct(self.path, os.O_RDONLY)

    def read_into(self, bufs: list[np.ndarray], offset: int) -> None:
        """Fill bufs, in order, with the file's consecutive bytes from offset: one sequential read (for
        O_DIRECT each buffer aligned and a multiple of 4096 long)."""
        views = [memoryview(b) for b in bufs]
        total, done = sum(len(v) for v in views), 0
        while views:
            n = os.preadv(self.fd, views, offset + done)
            if n == 0:
                raise FormatError(
                    f"{self.path}: ends at {offset + done} bytes, the records read need {offset + total}; "
                    f"the file is truncated (run `dsfp4 verify`)"
                )
            done += n
            # a read may stop short (2 GiB at most per call)
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]
        # keep the page cache out of the RAM budget
        if not self.direct:
            os.posix_fadvise(self.fd, offset, total, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        os.close(self.fd)
