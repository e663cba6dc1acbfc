"""`dsfp4 download`: fetch a checkpoint from the Hugging Face hub, the files the converter needs.

Built on huggingface_hub, so HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE and the standard cache apply; a
local folder replaces the cache when given. The revision is resolved to a commit first and every file is
fetched at that commit, which `.dsfp4-download.json` records beside the files with each one's size and
sha256. Interrupted downloads resume: huggingface_hub keeps the partial file and asks for the rest with
a Range request (and retries a dropped connection itself). A finished file counts only after its size,
and for LFS files its sha256, match what the hub lists.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dsfp4.convert.source import AUX_FILES, INDEX_NAME
from dsfp4.errors import ChecksumError, DsfpError, OutputError
from dsfp4.layout.atomic import atomic_write_json
from dsfp4.sizes import format_bytes

NEEDED = ("*.safetensors", INDEX_NAME, *AUX_FILES)  # what `dsfp4 convert` reads
KNOWN_REPOS = (  # checkpoints the converter takes; `NEEDED` selects their files
    "deepseek-ai/DeepSeek-V3",
    "deepseek-ai/DeepSeek-R1",
    "deepseek-ai/DeepSeek-V3-0324",
    "deepseek-ai/DeepSeek-R1-0528",
    "deepseek-ai/DeepSeek-V3.1",
    "nvidia/DeepSeek-R1-FP4",
)
RECORD_NAME = ".dsfp4-download.json"
RETRY_PAUSES = (0.5, 1.0, 2.0, 4.0)  # seconds before each retry of a dropped transfer; then the run stops
NET_CHUNK = 1 << 20  # bytes per write of a response
CHUNK = 8 << 20  # bytes per read when hashing


class HubError(DsfpError):
    """The hub refused a request or could not be reached."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # the hub lists it for LFS files (the shards)
    blob: str  # the name of its blob in the standard cache: the sha256, else the git object id

    def __post_init__(self) -> None:
        if not self.blob:
            raise HubError(f"{self.name}: the hub lists no blob id for it; cannot place it in the cache")


@dataclass
class DownloadPlan:
    repo: str
    revision: str
    commit: str
    target: Path  # the folder the files end up in
    files: list[RemoteFile]
    skipped: list[str] = field(default_factory=list)  # shards holding only the MTP layer (--no-mtp)
    done: set[str] = field(default_factory=set)  # already here and verified
    free: int = 0  # bytes free where the files go
    endpoint: str | None = None  # None: HF_ENDPOINT, else huggingface.co
    local_dir: Path | None = None  # None: the standard cache

    @property
    def need(self) -> int:
        """Bytes still to fetch (what earlier runs left in .part files counts as fetched)."""
        return sum(f.size for f in self.files if f.name not in self.done) - self.partial

    @property
    def partial(self) -> int:
        """Bytes of unfinished files that earlier runs left in .part files."""
        parts = [(f, _part(_place(self, f)[0])) for f in self.files if f.name not in self.done]
        return sum(min(p.stat().st_size, f.size) for f, p in parts if p.exists())

    def table(self) -> str:
        total = sum(f.size for f in self.files)
        lines = [f"{self.repo} at {self.revision} = commit {self.commit}", f"into {self.target}"]
        lines += [f"  {format_bytes(f.size):>11}  {f.name}{'  (done)' * (f.name in self.done)}" for f in self.files]
        lines += [f"  {'skipped':>11}  {name}  (MTP layer only, --no-mtp)" for name in self.skipped]
        if self.repo not in KNOWN_REPOS:
            lines.append(f"note: {self.repo} is not one of the checkpoints dsfp4 knows ({', '.join(KNOWN_REPOS)})")
        lines.append(
            f"{len(self.files)} files, {format_bytes(total)}; to fetch {format_bytes(self.need)}, "
            f"{format_bytes(self.free)} free"
        )
        return "\n".join(lines)


@contextlib.contextmanager
def hub_errors(repo: str, revision: str) -> Iterator[None]:
    """huggingface_hub's and the network's exceptions as one-line HubErrors naming the fix."""
    from huggingface_hub import errors as hf

    try:
        yield
    except hf.GatedRepoError as e:
        raise HubError(
            f"{repo} is gated: accept its terms on the hub, then give --token or set HF_TOKEN ({_status(e)})"
        ) from e
    except hf.RepositoryNotFoundError as e:
        raise HubError(
            f"{repo}: no such repository on the hub, or it is private (check the name, or give --token)"
        ) from e
    except hf.RevisionNotFoundError as e:
        raise HubError(f"{repo}: revision {revision} not found (give a branch, tag or commit of this repo)") from e
    except hf.RemoteEntryNotFoundError as e:
        raise HubError(f"{repo}: a listed file is missing at {revision}: {e.server_message or e}") from e
    except (hf.OfflineModeIsEnabled, hf.LocalEntryNotFoundError) as e:
        raise HubError(f"{repo}: HF_HUB_OFFLINE is set and the files are not in the cache; unset it to download") from e
    except hf.HfHubHTTPError as e:
        raise HubError(f"{repo}: the hub answered {_status(e)}; run the same command again to resume") from e
    except _network_errors() as e:
        raise HubError(
            f"{repo}: network failure ({type(e).__name__}: {e}); run the same command again to resume"
        ) from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OutputError(f"disk full while downloading {repo}; free some space and run it again to resume") from e
        if isinstance(e, (PermissionError, FileNotFoundError, IsADirectoryError)):
            raise
        raise HubError(f"{repo}: download failed ({e}); run the same command again to resume") from e


def _network_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's transport errors (huggingface_hub 2 uses httpx2; earlier clients httpx)."""
    for module in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            return (__import__(module).TransportError,)
    return ()


def _status(e: Exception) -> str:
    response = getattr(e, "response", None)
    return f"HTTP {response.status_code}" if response is not None else type(e).__name__


def _selected(name: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in include) and not any(fnmatch.fnmatch(name, p) for p in exclude)


def _mtp_only_shards(config: dict, index: dict) -> list[str]:
    """Shards whose every tensor belongs to a layer past num_hidden_layers (the MTP layers)."""
    n = int(config["num_hidden_layers"])
    mtp = tuple(f"model.layers.{i}." for i in range(n, n + int(config.get("num_nextn_predict_layers", 0))))
    if not mtp:
        return []
    shards: dict[str, bool] = {}  # shard -> every tensor so far is an MTP tensor
    for tensor, shard in index["weight_map"].items():
        shards[shard] = shards.get(shard, True) and tensor.startswith(mtp)
    return sorted(s for s, only in shards.items() if only)


def _target(repo: str, commit: str, local_dir: Path | None) -> Path:
    if local_dir is not None:
        return Path(local_dir)
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots" / commit


def _place(plan: DownloadPlan, f: RemoteFile) -> tuple[Path, Path]:
    """(where the bytes go, the path the file is read by): the same file in a local folder; a blob and a
    snapshot link in the standard cache (its documented layout: blobs/, snapshots/<commit>/, refs/)."""
    if plan.local_dir is not None:
        return plan.target / f.name, plan.target / f.name
    return plan.target.parents[1] / "blobs" / f.blob, plan.target / f.name


def _part(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def _fetch(plan: DownloadPlan, f: RemoteFile, token: str | None, on_bytes: Callable[[int], None]) -> Path:
    """Download one file at the plan's commit into `<dest>.part`, resuming what an earlier run left
    there with a Range request; retry dropped connections with backoff; then check it and move it in."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    dest, path = _place(plan, f)
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = _part(dest)
        url = hf_hub_url(plan.repo, f.name, revision=plan.commit, endpoint=plan.endpoint)
        for pause in (*RETRY_PAUSES, None):
            have = part.stat().st_size if part.exists() else 0
            if have >= f.size:  # an earlier run got every byte and stopped before the check
                break
            headers = build_hf_headers(token=token) | ({"Range": f"bytes={have}-"} if have else {})
            try:
                with get_session().stream("GET", url, headers=headers, follow_redirects=True) as r:
                    hf_raise_for_status(r)
                    mode = "ab" if have and r.status_code == 206 else "wb"  # 200: the server sent it all
                    with open(part, mode) as out:
                        for chunk in r.iter_bytes(NET_CHUNK):  # small: a cut loses at most one
                            out.write(chunk)
                            on_bytes(len(chunk))
                break
            except _network_errors():
                if pause is None:
                    raise
                time.sleep(pause)
        _check(part, f, path)
        part.replace(dest)
    if path != dest:  # the cache's snapshot entry links to the blob
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        path.symlink_to(os.path.relpath(dest, path.parent))
    return path


def plan_download(
    repo: str,
    revision: str = "main",
    local_dir: Path | None = None,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    no_mtp: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
) -> DownloadPlan:
    """Resolve the revision, list the files to fetch with their sizes and what is already here. With
    --no-mtp it reads config.json and the shard index (a few KB) to leave out MTP-only shards."""
    from huggingface_hub import HfApi

    with hub_errors(repo, revision):
        info = HfApi(endpoint=endpoint, token=token).model_info(repo, revision=revision, files_metadata=True)
        files = [
            RemoteFile(
                s.rfilename, int(s.size or 0), s.lfs.sha256 if s.lfs else None, s.lfs.sha256 if s.lfs else s.blob_id
            )
            for s in info.siblings or ()
            if _selected(s.rfilename, include or NEEDED, exclude)
        ]
        if not files:
            raise HubError(f"{repo}: no files at {revision} match {', '.join(include or NEEDED)}")
        target = _target(repo, str(info.sha), local_dir)
        plan = DownloadPlan(repo, revision, str(info.sha), target, files, endpoint=endpoint, local_dir=local_dir)
        names = {f.name for f in files}
        if no_mtp and {"config.json", INDEX_NAME} <= names:
            small = {f.name: f for f in files}
            config, index = (
                json.loads(_fetch(plan, small[n], token, lambda b: None).read_text())
                for n in ("config.json", INDEX_NAME)
            )
            plan.skipped = _mtp_only_shards(config, index)
            plan.files = [f for f in files if f.name not in plan.skipped]
    plan.files.sort(key=lambda f: (f.size, f.name))  # the small files first: a dry run or a failure shows early
    plan.done = _verified(plan)
    folder = plan.target if plan.target.exists() else next(p for p in plan.target.parents if p.exists())
    plan.free = shutil.disk_usage(folder).free
    return plan


def _verified(plan: DownloadPlan) -> set[str]:
    """Files a previous run of this commit fetched and verified, still there with their size."""
    try:
        record = json.loads((plan.target / RECORD_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return set()
    if record.get("commit") != plan.commit:
        return set()
    sizes = {f.name: f.size for f in plan.files}
    return {
        n for n in record.get("verified", ()) if n in sizes and (plan.target / n).is_file()
        and (plan.target / n).stat().st_size == sizes[n]
    }  # fmt: skip


def _check(part: Path, f: RemoteFile, shown: Path) -> None:
    """A finished download against the hub's size and sha256; a bad one is removed (a rerun fetches it)."""
    size, digest = part.stat().st_size, None
    if size == f.size and f.sha256 is not None:
        h = hashlib.sha256()
        with open(part, "rb") as fh:
            while block := fh.read(CHUNK):
                h.update(block)
        digest = h.hexdigest()
    if size != f.size or digest != f.sha256:
        part.unlink()
        found = f"{size} bytes, the hub lists {f.size}" if size != f.size else f"sha256 {digest[:12]}..."
        raise ChecksumError(
            f"{shown}: {found} (the hub's sha256 is {str(f.sha256)[:12]}...); the file was damaged in transfer "
            f"and removed, run the same command again"
        )


def download(
    plan: DownloadPlan,
    token: str | None = None,
    on_bytes: Callable[[int], None] = lambda n: None,
    on_file: Callable[[str], None] = lambda name: None,
) -> Path:
    """Fetch the plan's files not yet done, verify each, record it; the folder holding them all."""
    if plan.need > plan.free:
        raise OutputError(
            f"{plan.target}: the download needs {format_bytes(plan.need)}, {format_bytes(plan.free)} is free; "
            f"free some space or choose another --local-dir"
        )
    with hub_errors(plan.repo, plan.revision):
        for f in plan.files:
            if f.name in plan.done:
                continue
            on_file(f.name)
            _fetch(plan, f, token, on_bytes)
            plan.done.add(f.name)
            atomic_write_json(
                plan.target / RECORD_NAME,
                {
                    "repo": plan.repo,
                    "revision": plan.revision,
                    "commit": plan.commit,
                    "files": {f.name: {"size": f.size, "sha256": f.sha256} for f in plan.files},
                    "skipped": plan.skipped,
                    "verified": sorted(plan.done),
                },
            )
    if plan.local_dir is None and plan.revision != plan.commit:  # the cache's name for the revision
        refs = plan.target.parents[1] / "refs" / plan.revision
        refs.parent.mkdir(parents=True, exist_ok=True)
        refs.write_text(plan.commit)
    return plan.target
