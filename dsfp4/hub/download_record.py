"""The record `dsfp4 download` keeps of what it fetched and checked, and the check of a file against it.

The record (`.dsfp4-download.json` in a --local-dir, `.dsfp4-download-<commit>.json` beside a cached repo's
snapshots) names the commit and, for each file, its size, sha256 (LFS files) and git blob id; a file checked by this
dsfp4 also has the mtime it had then (`mtime_ns`; older records have none, and those files are hashed once again).
A file is still as checked when its size and mtime are the recorded ones; when either differs, or when asked
(`--verify`), it is hashed again. `download` fetches again what fails; `convert` refuses it, naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dsfp4.errors import ChecksumError, ConfigError
from dsfp4.hub import remote_file
from dsfp4.hub.remote_file import RemoteFile

RECORD_NAME = ".dsfp4-download.json"
SNAPSHOTS = "snapshots"


@dataclass(frozen=True)
class Checked:
    """A file the record says was fetched and checked: as listed, and its mtime then (None: not recorded)."""

    file: RemoteFile
    mtime_ns: int | None


def cached_record(repo_dir: Path, commit: str) -> Path:
    """The record of a download into the standard cache, beside the repo's snapshots."""
    return repo_dir / f".dsfp4-download-{commit}.json"


def record_of(folder: Path) -> Path | None:
    """The record of the download `folder` holds: a --local-dir's own, or a cached snapshot's; None: none there."""
    folder = Path(folder)
    if (folder / RECORD_NAME).is_file():
        return folder / RECORD_NAME
    cached = cached_record(folder.parents[1], folder.name) if folder.parent.name == SNAPSHOTS else None
    return cached if cached is not None and cached.is_file() else None


def read_record(path: Path, commit: str | None = None) -> dict:
    """The record at `path` ({} when it cannot be read, or is of another commit than `commit`)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(record, dict) or (commit is not None and record.get("commit") != commit):
        return {}
    return record


def checked_files(record: dict) -> dict[str, Checked]:
    """The files the record lists as fetched and checked, by name."""
    files = record.get("files")
    files = files if isinstance(files, dict) else {}
    out = {}
    verified = record.get("verified", ())
    for name in verified if isinstance(verified, list) else ():
        entry = files.get(name)
        # a hand-edited or damaged entry is no check: its file is fetched and checked again
        if isinstance(entry, dict) and entry.get("blob") and isinstance(entry.get("size"), int):
            f = RemoteFile(name, entry["size"], entry.get("sha256"), str(entry["blob"]))
            mtime = entry.get("mtime_ns")
            out[name] = Checked(f, mtime if isinstance(mtime, int) else None)
    return out


def still_checked(path: Path, f: RemoteFile, mtime_ns: int | None, verify: bool = False) -> bool:
    """Whether `path` still holds `f` as it was checked: its size, then its mtime as recorded; the full hash when the
    mtime differs or is not recorded, or with `verify`."""
    st = path.stat()
    if st.st_size != f.size:
        return False
    if not verify and mtime_ns is not None and st.st_mtime_ns == mtime_ns:
        return True
    return remote_file.matches(path, f)


def check_download(folder: Path, verify: bool = False) -> int:
    """The files of the download in `folder` still as `dsfp4 download` checked them -> how many were checked;
    ChecksumError naming the first that is not, and the fix. A folder without a record has nothing to check against
    (ConfigError when `verify` asks for it)."""
    folder = Path(folder)
    path = record_of(folder)
    if path is None:
        if verify:
            raise ConfigError(
                f"--verify: {folder} has no {RECORD_NAME} (`dsfp4 download` writes it) to check its files against; "
                "drop --verify, or download the checkpoint with dsfp4"
            )
        return 0
    record = read_record(path)
    files = checked_files(record)
    for name, c in files.items():
        where = folder / name
        # left out on purpose (--no-mtp, --delete-source): the conversion says what it misses
        if where.is_file() and not still_checked(where, c.file, c.mtime_ns, verify):
            again = f"dsfp4 download {record.get('repo', 'REPO')} --revision {record.get('commit', 'COMMIT')}"
            again += f" --local-dir {folder}" if path.name == RECORD_NAME else ""
            kind = "size" if where.stat().st_size != c.file.size else "sha256" if c.file.sha256 else "git blob id"
            raise ChecksumError(
                f"{where}: its {kind} differs from the file `dsfp4 download` fetched and checked; it is damaged: "
                f"download it again ({again})"
            )
    return len(files)
