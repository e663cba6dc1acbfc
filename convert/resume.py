"""The output folder of a conversion in progress: refuse to clobber, resume where a run stopped.

While converting, OUT holds `.dsfp4-convert/state.json` (the resume key: plan fingerprint and source shard
times) and one marker per finished part, and a run holds the folder's writer lock (`.dsfp4.lock`). A part's files are
written under temporary names and renamed before its marker, so a killed run leaves finished parts
intact and nothing that looks complete: manifest.json comes last.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dsfp4.convert.source.checkpoint import AUX_FILES
from dsfp4.errors import OutputError
from dsfp4.layout.atomic import LOCK_NAME, atomic_write_json, lock_folder
from dsfp4.layout.manifest import BACKBONE_DIR, MANIFEST_NAME

STATE_DIR = ".dsfp4-convert"
OWNED = (MANIFEST_NAME, BACKBONE_DIR, "experts", STATE_DIR, "hot.json", *AUX_FILES)


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


class ResumeState:
    """Decides, without touching OUT, whether a run starts fresh, resumes, overwrites (--force) or is
    refused; prepare() then takes the lock and sets OUT up."""

    def __init__(self, out: Path, key: str, force: bool):
        self.out, self.key, self.force = Path(out), key, force
        self.dir = self.out / STATE_DIR
        self.mode = "fresh"
        self._lock_fd: int | None = None
        state = self.dir / "state.json"
        if self.out.exists() and not self.out.is_dir():
            raise OutputError(f"{self.out} exists and is not a folder; choose another OUT")
        if force:
            self.mode = "overwrite" if any(self._owned()) else "fresh"
        elif (self.out / MANIFEST_NAME).exists():
            raise OutputError(f"{self.out} already holds a converted model; pass --force to overwrite it")
        elif state.is_file():
            if json.loads(state.read_text()).get("key") != key:
                raise OutputError(
                    f"{self.out} holds an interrupted conversion of another source (or a changed one) or with "
                    f"other options; pass --force to start over"
                )
            self.mode = "resume"
        elif self.out.is_dir() and any(p.name != LOCK_NAME for p in self.out.iterdir()):
            raise OutputError(f"{self.out} exists and is not empty; pass --force to overwrite it")

    def _owned(self) -> list[Path]:
        return [self.out / n for n in OWNED if (self.out / n).exists()]

    def reclaimable_bytes(self) -> int:
        """Disk space that --force frees before converting."""
        return sum(_tree_bytes(p) for p in self._owned()) if self.mode == "overwrite" else 0

    def done(self, part: str) -> dict | None:
        """The marker of a finished part whose files are still there with their recorded sizes."""
        marker = self.dir / f"{part}.json"
        if self.mode != "resume" or not marker.is_file():
            return None
        info = json.loads(marker.read_text())
        for rel, nbytes in info["sizes"].items():
            path = self.out / rel
            if not path.is_file() or path.stat().st_size != nbytes:
                return None
        return info

    def prepare(self) -> None:
        """Lock OUT against a second run, clear it under --force, create the folders and the state."""
        self.out.mkdir(parents=True, exist_ok=True)
        busy = f"another dsfp4 process (convert or repack) is writing {self.out}; wait for it or choose another OUT"
        self._lock_fd = lock_folder(self.out, busy)
        # only what a conversion writes: other files in OUT stay
        if self.mode == "overwrite":
            for path in self._owned():
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        for sub in ("backbone", "experts", STATE_DIR):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        if self.mode != "resume":
            atomic_write_json(self.dir / "state.json", {"key": self.key})

    def mark(self, part: str, info: dict) -> None:
        atomic_write_json(self.dir / f"{part}.json", info)

    def finish(self) -> None:
        """After manifest.json is written: drop the state and the lock."""
        shutil.rmtree(self.dir)
        # the lock file stays: unlinking it would let two later writers lock different files
        self.release()

    def release(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)
