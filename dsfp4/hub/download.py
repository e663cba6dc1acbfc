"""`dsfp4 download`: fetch a checkpoint from the Hugging Face hub, the files the converter needs.

On huggingface_hub's client, so HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE apply. Files go to the standard
cache, in its layout (blobs/, snapshots/<commit>/, refs/), or to a folder given with --local-dir. The
revision is resolved to a commit first and every file is fetched at that commit. A record of the commit
and of each file's size, hash and mtime is kept (download_record.py): in the folder (`.dsfp4-download.json`), or
beside the cached repo's snapshots; a file it lists is not fetched again while its size and mtime are the recorded
ones (hashed again when either differs, or every one with --verify; fetched again when that fails). Each file is
fetched by `remote_file.fetch`: resumable, retried, checked. A run holds a lock, so two runs never write the same
files.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dsfp4.errors import OutputError
from dsfp4.hub.download_record import RECORD_NAME, cached_record, checked_files, read_record, still_checked
from dsfp4.hub.remote_file import HubError, RemoteFile, fetch, network_errors
from dsfp4.layout.atomic import atomic_write_bytes, atomic_write_json, lock_folder
from dsfp4.units import format_bytes, free_bytes

# in a --local-dir: partial files, named by blob
PARTIAL_DIR = ".dsfp4-partial"


@dataclass(frozen=True)
class Selection:
    """Which files of a repo a download takes: glob patterns (one without "/" names top-level files only); files to
    leave out by what small files of the repo say (`leave_out(name -> parsed JSON of each of `reads`)` -> names,
    shown with `why`); the repos the selection was made for (another one gets a note)."""

    patterns: tuple[str, ...]
    reads: tuple[str, ...] = ()
    leave_out: Callable[[dict[str, dict]], list[str]] | None = None
    why: str = ""
    known_repos: tuple[str, ...] = ()


@dataclass
class DownloadPlan:
    repo: str
    revision: str
    commit: str
    # the folder the files end up in (a snapshot folder in the cache)
    target: Path
    files: list[RemoteFile]
    # None: the standard cache
    local_dir: Path | None = None
    selection: Selection = Selection(("*",))
    # None: HF_ENDPOINT, else huggingface.co
    endpoint: str | None = None
    # left out by the selection's rule (--no-mtp)
    skipped: list[str] = field(default_factory=list)
    # already here and verified by an earlier run
    done: set[str] = field(default_factory=set)
    # here, checked by an earlier run, and no longer the file it checked: fetched again
    changed: set[str] = field(default_factory=set)
    # each selected file as the hub lists it (shared by a plan of some of the files, so the record stays whole)
    listing: dict[str, RemoteFile] = field(default_factory=dict)
    # the mtime of each file in `done` when it was checked
    mtimes: dict[str, int] = field(default_factory=dict)
    # bytes free where the files go
    free: int = 0

    @property
    def cached(self) -> bool:
        return self.local_dir is None

    @property
    def repo_dir(self) -> Path:
        """The cache's folder of this repo, or the local folder."""
        return self.target.parents[1] if self.cached else self.target

    def place(self, f: RemoteFile) -> tuple[Path, Path, Path]:
        """(where the bytes go, their partial file, the path the file is read by)."""
        if self.cached:
            blob = self.repo_dir / "blobs" / f.blob
            return blob, blob.with_name(f.blob + ".incomplete"), self.target / f.name
        return self.target / f.name, self.target / PARTIAL_DIR / f"{f.blob}.part", self.target / f.name

    @property
    def record(self) -> Path:
        return cached_record(self.repo_dir, self.commit) if self.cached else self.target / RECORD_NAME

    def _todo(self) -> list[RemoteFile]:
        return [
            f
            for f in self.files
            if f.name not in self.done and (f.name in self.changed or not self.place(f)[0].is_file())
        ]

    @property
    def partial(self) -> int:
        """Bytes of files to fetch that earlier runs left in partial files."""
        parts = [(f, self.place(f)[1]) for f in self._todo()]
        return sum(min(p.stat().st_size, f.size) for f, p in parts if p.is_file())

    @property
    def need(self) -> int:
        """Bytes still to fetch. Files already at their place are checked, not fetched."""
        return sum(f.size for f in self._todo()) - self.partial

    def table(self) -> str:
        total = sum(f.size for f in self.files)
        lines = [f"{self.repo} at {self.revision} = commit {self.commit}", f"into {self.target}"]
        lines += [f"  {format_bytes(f.size):>11}  {f.name}{self._state(f.name)}" for f in self.files]
        lines += [f"  {'skipped':>11}  {name}  ({self.selection.why})" for name in self.skipped]
        lines.append(
            f"{len(self.files)} files, {format_bytes(total)}; to fetch {format_bytes(self.need)}, "
            f"{format_bytes(self.free)} free"
        )
        known = self.selection.known_repos
        if known and self.repo not in known:
            lines.append(f"note: {self.repo} is not one of the checkpoints dsfp4 knows ({', '.join(known)})")
        return "\n".join(lines)

    def _state(self, name: str) -> str:
        if name in self.changed:
            return "  (changed since an earlier run checked it: fetched again)"
        return "  (done)" * (name in self.done)


@contextlib.contextmanager
def hub_errors(repo: str, revision: str) -> Iterator[None]:
    """huggingface_hub's and the network's exceptions as one-line HubErrors naming the fix."""
    from huggingface_hub import errors as hf

    try:
        yield
    except hf.GatedRepoError as e:
        raise HubError(f"{repo} is gated: accept its terms on the hub, then give --token or set HF_TOKEN") from e
    except hf.RepositoryNotFoundError as e:
        raise HubError(f"{repo}: no such repository on the hub, or it is private (check the name or --token)") from e
    except hf.RevisionNotFoundError as e:
        raise HubError(f"{repo}: revision {revision} not found (give a branch, tag or commit of this repo)") from e
    except hf.HFValidationError as e:
        raise HubError(f"{repo}: not a valid repo id or revision ({e})") from e
    except hf.OfflineModeIsEnabled as e:
        raise HubError("HF_HUB_OFFLINE is set: downloading needs the hub; unset it to download") from e
    except hf.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "an error"
        raise HubError(f"{repo}: the hub answered {status}; run the same command again to resume") from e
    except network_errors() as e:
        raise HubError(
            f"{repo}: network failure ({type(e).__name__}: {e}); run the same command again to resume"
        ) from e


def _selected(name: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    # a pattern without "/" names top-level files only
    def hit(p: str) -> bool:
        return fnmatch.fnmatch(name, p) and ("/" in p or "/" not in name)

    return any(map(hit, include)) and not any(map(hit, exclude))


def _target(repo: str, commit: str, local_dir: Path | None) -> Path:
    if local_dir is not None:
        return Path(local_dir)
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots" / commit


@contextlib.contextmanager
def locked(plan: DownloadPlan) -> Iterator[None]:
    """The writer lock of the folder (cache: of the repo, where huggingface_hub keeps its locks)."""
    folder = plan.repo_dir.parent / ".locks" / plan.repo_dir.name if plan.cached else plan.target
    folder.mkdir(parents=True, exist_ok=True)
    fd = lock_folder(folder, f"another dsfp4 download is writing {plan.target}; wait for it")
    try:
        yield
    finally:
        os.close(fd)


def fetch_file(
    plan: DownloadPlan, f: RemoteFile, token: str | None, on_bytes: Callable[[int], None] = lambda n: None
) -> Path:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    dest, part, path = plan.place(f)
    url = hf_hub_url(plan.repo, f.name, revision=plan.commit, endpoint=plan.endpoint)
    fetch(url, f, dest, part, build_hf_headers(token=token), on_bytes)
    # the cache's snapshot entry is a relative link to the blob
    if path != dest:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        path.symlink_to(os.path.relpath(dest, path.parent))
    return path


def plan_download(
    repo: str,
    revision: str = "main",
    local_dir: Path | None = None,
    selection: Selection = Selection(("*",)),
    exclude: tuple[str, ...] = (),
    token: str | None = None,
    endpoint: str | None = None,
    verify: bool = False,
) -> DownloadPlan:
    """Resolve the revision, list the files to fetch with their sizes and what is already here (`verify`: every
    file an earlier run checked hashed again, not only those whose size or mtime changed). When the selection leaves
    files out by what small files say, those (a few KB: config.json, the shard index) are fetched first."""
    from huggingface_hub import HfApi

    with hub_errors(repo, revision):
        info = HfApi(endpoint=endpoint, token=token).model_info(repo, revision=revision, files_metadata=True)
        files = [
            RemoteFile(s.rfilename, int(s.size or 0), *((s.lfs.sha256,) * 2 if s.lfs else (None, s.blob_id)))
            for s in info.siblings or ()
            if _selected(s.rfilename, selection.patterns, exclude)
        ]
        if not files:
            raise HubError(f"{repo}: no files at {revision} match {', '.join(selection.patterns)}")
        target = _target(repo, str(info.sha), local_dir)
        plan = DownloadPlan(repo, revision, str(info.sha), target, files, local_dir, selection, endpoint)
        plan.listing = {f.name: f for f in files}
        small = {f.name: f for f in files}
        if selection.leave_out is not None and all(n in small for n in selection.reads):
            with locked(plan):
                read = {n: json.loads(fetch_file(plan, small[n], token).read_text()) for n in selection.reads}
            plan.skipped = selection.leave_out(read)
            plan.files = [f for f in files if f.name not in plan.skipped]
    # the small files first: a failure shows early
    plan.files.sort(key=lambda f: (f.size, f.name))
    _check_done(plan, verify)
    plan.free = free_bytes(plan.target)[1]
    return plan


def _check_done(plan: DownloadPlan, verify: bool) -> None:
    """Sort the files an earlier run of this commit fetched and checked: still there as it checked them (`done`,
    their mtimes kept), or no longer (`changed`)."""
    checked = checked_files(read_record(plan.record, plan.commit))
    for f in plan.files:
        c, path = checked.get(f.name), plan.target / f.name
        if c is None or not path.is_file():
            continue
        # an mtime recorded for another listing of the name proves nothing
        if still_checked(path, f, c.mtime_ns if c.file == f else None, verify):
            plan.done.add(f.name)
            plan.mtimes[f.name] = path.stat().st_mtime_ns
        else:
            plan.changed.add(f.name)


def _write_record(plan: DownloadPlan) -> None:
    """The record of what is fetched and checked so far, each checked file with its mtime then."""

    def entry(f: RemoteFile) -> dict:
        mtime = {"mtime_ns": plan.mtimes[f.name]} if f.name in plan.done and f.name in plan.mtimes else {}
        return {"size": f.size, "sha256": f.sha256, "blob": f.blob, **mtime}

    listing = plan.listing or {f.name: f for f in plan.files}
    files = {name: entry(f) for name, f in listing.items() if name not in plan.skipped}
    record = {"repo": plan.repo, "revision": plan.revision, "commit": plan.commit, "files": files}
    atomic_write_json(plan.record, record | {"skipped": plan.skipped, "verified": sorted(plan.done)})


def fetch_recorded(
    plan: DownloadPlan, f: RemoteFile, token: str | None, on_bytes: Callable[[int], None] = lambda n: None
) -> None:
    """Fetch and check one file, then record it as verified, with its mtime (a later run of this commit skips it
    while its size and mtime stay)."""
    path = fetch_file(plan, f, token, on_bytes)
    plan.done.add(f.name)
    plan.changed.discard(f.name)
    plan.mtimes[f.name] = path.stat().st_mtime_ns
    _write_record(plan)


def download(
    plan: DownloadPlan,
    token: str | None = None,
    on_bytes: Callable[[int], None] = lambda n: None,
    on_file: Callable[[str], None] = lambda name: None,
) -> Path:
    """Fetch and check the plan's files not yet done, recording each; the folder holding them all."""
    if plan.need > plan.free:
        raise OutputError(
            f"{plan.target}: the download needs {format_bytes(plan.need)}, {format_bytes(plan.free)} is free; "
            f"free some space or choose another --local-dir"
        )
    with hub_errors(plan.repo, plan.revision), locked(plan):
        for f in plan.files:
            if f.name in plan.done:
                continue
            on_file(f.name)
            fetch_recorded(plan, f, token, on_bytes)
        # the mtimes of files hashed again (an older record had none)
        _write_record(plan)
        # the cache's name for the revision
        if plan.cached and plan.revision != plan.commit:
            ref = plan.repo_dir / "refs" / plan.revision
            ref.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(ref, plan.commit.encode())
    return plan.target
