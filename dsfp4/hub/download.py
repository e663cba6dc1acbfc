"""`dsfp4 download`: fetch a checkpoint from the Hugging Face hub, the files the converter needs.

On huggingface_hub's client, so HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE apply. Files go to the standard
cache, in its layout (blobs/, snapshots/<commit>/, refs/), or to a folder given with --local-dir. The
revision is resolved to a commit first and every file is fetched at that commit. A record of the commit
and of each file's size and hash is kept: in the folder (`.dsfp4-download.json`), or beside the cached
repo's snapshots. Each file is fetched by `remote_file.fetch`: resumable, retried, checked. A run holds a
lock, so two runs never write the same files.
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
from dsfp4.hub.remote_file import HubError, RemoteFile, fetch, network_errors
from dsfp4.layout.atomic import atomic_write_bytes, atomic_write_json, lock_folder
from dsfp4.units import format_bytes, free_bytes

RECORD_NAME = ".dsfp4-download.json"
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
        return self.repo_dir / f".dsfp4-download-{self.commit}.json" if self.cached else self.target / RECORD_NAME

    def _todo(self) -> list[RemoteFile]:
        return [f for f in self.files if f.name not in self.done and not self.place(f)[0].is_file()]

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
        lines += [f"  {format_bytes(f.size):>11}  {f.name}{'  (done)' * (f.name in self.done)}" for f in self.files]
        lines += [f"  {'skipped':>11}  {name}  ({self.selection.why})" for name in self.skipped]
        lines.append(
            f"{len(self.files)} files, {format_bytes(total)}; to fetch {format_bytes(self.need)}, "
            f"{format_bytes(self.free)} free"
        )
        known = self.selection.known_repos
        if known and self.repo not in known:
            lines.append(f"note: {self.repo} is not one of the checkpoints dsfp4 knows ({', '.join(known)})")
        return "\n".join(lines)


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
) -> DownloadPlan:
    """Resolve the revision, list the files to fetch with their sizes and what is already here. When the
    selection leaves files out by what small files say, those (a few KB: config.json, the shard index) are
    fetched first."""
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
        small = {f.name: f for f in files}
        if selection.leave_out is not None and all(n in small for n in selection.reads):
            with locked(plan):
                read = {n: json.loads(fetch_file(plan, small[n], token).read_text()) for n in selection.reads}
            plan.skipped = selection.leave_out(read)
            plan.files = [f for f in files if f.name not in plan.skipped]
    # the small files first: a failure shows early
    plan.files.sort(key=lambda f: (f.size, f.name))
    plan.done = _verified(plan)
    plan.free = free_bytes(plan.target)[1]
    return plan


def _verified(plan: DownloadPlan) -> set[str]:
    """Files an earlier run of this commit fetched and checked, still there with their size."""
    try:
        record = json.loads(plan.record.read_text())
    except (OSError, json.JSONDecodeError):
        return set()
    if not isinstance(record, dict) or record.get("commit") != plan.commit:
        return set()
    sizes = {f.name: f.size for f in plan.files}
    here = {n for n in record.get("verified", ()) if n in sizes and (plan.target / n).is_file()}
    return {n for n in here if (plan.target / n).stat().st_size == sizes[n]}


def fetch_recorded(
    plan: DownloadPlan, f: RemoteFile, token: str | None, on_bytes: Callable[[int], None] = lambda n: None
) -> None:
    """Fetch and check one file, then record it as verified (a later run of this commit skips it)."""
    fetch_file(plan, f, token, on_bytes)
    plan.done.add(f.name)
    atomic_write_json(
        plan.record,
        {
            "repo": plan.repo,
            "revision": plan.revision,
            "commit": plan.commit,
            "files": {f.name: {"size": f.size, "sha256": f.sha256, "blob": f.blob} for f in plan.files},
            "skipped": plan.skipped,
            "verified": sorted(plan.done),
        },
    )


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
        # the cache's name for the revision
        if plan.cached and plan.revision != plan.commit:
            ref = plan.repo_dir / "refs" / plan.revision
            ref.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(ref, plan.commit.encode())
    return plan.target
