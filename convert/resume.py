"""The output folder of a conversion in progress: refuse to clobber, resume where a run stopped.

While converting, OUT holds `.dsfp4-convert/state.json` (the plan's fingerprint) and one marker per
finished part. A part's files are written under temporary names and renamed before its marker, so a
killed run leaves finished parts intact and nothing that looks complete: manifest.json comes last.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dsfp4.convert.source import AUX_FILES
from dsfp4.errors import OutputError
from dsfp4.layout.atomic import atomic_write_json
from dsfp4.layout.manifest import MANIFEST_NAME

STATE_DIR = ".dsfp4-convert"
OWNED = (MANIFEST_NAME, "backbone", "experts", STATE_DIR, "hot.json", *AUX_FILES)


class ResumeState:
    """Prepares OUT for a plan: fresh, resumed (same fingerprint), or refused."""

    def __init__(self, out: Path, fingerprint: str, force: bool):
        self.out = Path(out)
        self.dir = self.out / STATE_DIR
        self.resumed = False
        state = self.dir / "state.json"
        if self.out.exists() and not self.out.is_dir():
            raise OutputError(f"{self.out} exists and is not a folder; choose another OUT")
        if force:
            self._clear()
        elif (self.out / MANIFEST_NAME).exists():
            raise OutputError(f"{self.out} already holds a converted model; pass --force to overwrite it")
        elif state.is_file():
            if json.loads(state.read_text()).get("fingerprint") != fingerprint:
                raise OutputError(
                    f"{self.out} holds an interrupted conversion of another source or with "
                    f"other options; pass --force to start over"
                )
            self.resumed = True
        elif self.out.is_dir() and any(self.out.iterdir()):
            raise OutputError(f"{self.out} exists and is not empty; pass --force to overwrite it")
        for sub in ("backbone", "experts", STATE_DIR):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        if not self.resumed:
            atomic_write_json(state, {"fingerprint": fingerprint})

    def _clear(self) -> None:
        """Remove what a conversion writes, and nothing else a user may keep in the folder."""
        for name in OWNED:
            path = self.out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def done(self, part: str) -> dict | None:
        """The marker of a finished part whose files are still there with their recorded sizes."""
        marker = self.dir / f"{part}.json"
        if not marker.is_file():
            return None
        info = json.loads(marker.read_text())
        for rel, nbytes in info["sizes"].items():
            path = self.out / rel
            if not path.is_file() or path.stat().st_size != nbytes:
                return None
        return info

    def mark(self, part: str, info: dict) -> None:
        atomic_write_json(self.dir / f"{part}.json", info)

    def finish(self) -> None:
        shutil.rmtree(self.dir)
