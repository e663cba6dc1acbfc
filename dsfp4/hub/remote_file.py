"""One file from the Hugging Face hub, resumable and checked.

The bytes go to a partial file named after the file's blob, so a partial download of one commit is
never continued with another commit's bytes. A rerun, or a retry within the run, asks for the rest with a
Range request. A dropped or stalled connection and the hub's transient answers (408, 429, 5xx) are
retried with backoff. The file moves to its final name only when its size and its hash match the hub's
listing: sha256 for LFS files, the git blob id for the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsfp4.errors import ChecksumError, DsfpError

# seconds before each retry of one file; then the run stops
RETRY_PAUSES = (1.0, 2.0, 4.0, 8.0, 16.0)
# answers worth asking again (as huggingface_hub does)
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
# bytes per write of a response: a cut loses at most this much
NET_CHUNK = 1 << 20
HASH_CHUNK = 8 << 20


class HubError(DsfpError):
    """The hub refused a request or could not be reached."""


class _Retry(Exception):
    def __init__(self, after: float | None = None):
        super().__init__("retry")
        self.after = after


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    # the hub lists it for LFS files (the shards)
    sha256: str | None
    # the blob's name in the standard cache: the sha256, else the git blob id
    blob: str

    def __post_init__(self) -> None:
        if not self.blob:
            raise HubError(f"{self.name}: the hub lists no blob id for it, so it cannot be checked")


def network_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's transport errors (timeouts included): huggingface_hub 2 uses httpx2."""
    for module in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            return (__import__(module).TransportError,)
    return ()


def matches(path: Path, f: RemoteFile) -> bool:
    """Whether `path` holds exactly the listed file: its size, then its sha256 or git blob id."""
    size = path.stat().st_size
    if size != f.size:
        return False
    h = hashlib.sha256() if f.sha256 is not None else hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as fh:
        while block := fh.read(HASH_CHUNK):
            h.update(block)
    return h.hexdigest() == (f.sha256 if f.sha256 is not None else f.blob)


def _truncate(path: Path) -> None:
    with open(path, "wb"):
        pass


def _request(url: str, part: Path, size: int, headers: dict[str, str], on_bytes: Callable[[int], None]) -> None:
    """One GET of what `part` still lacks."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session, hf_raise_for_status

    have = part.stat().st_size
    # not a prefix of this file
    if have > size:
        _truncate(part)
        have = 0
    if have == size:
        return
    headers = headers | ({"Range": f"bytes={have}-"} if have else {})
    # a stalled connection becomes a timeout, and a retry
    timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
    with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=timeout) as r:
        start = r.headers.get("Content-Range", "bytes 0-").split()[-1].split("-")[0]
        if r.status_code == 416 or (r.status_code == 206 and start != str(have)):
            # the server will not continue this partial file: start it again
            _truncate(part)
            raise _Retry(0.0)
        if r.status_code in RETRY_STATUS:
            after = r.headers.get("Retry-After", "")
            raise _Retry(float(after) if after.isdigit() else None)
        hf_raise_for_status(r)
        # 200: the whole file again
        with open(part, "ab" if have and r.status_code == 206 else "wb") as out:
            for chunk in r.iter_bytes(NET_CHUNK):
                out.write(chunk)
                on_bytes(len(chunk))


def fetch(
    url: str,
    f: RemoteFile,
    dest: Path,
    part: Path,
    headers: dict[str, str],
    on_bytes: Callable[[int], None],
    pauses: tuple[float, ...] | None = None,
) -> None:
    """Make `dest` hold the file: keep it if it already matches, else download into `part` (resuming what
    is there), check it, and move it to `dest`."""
    if dest.is_file():
        if matches(dest, f):
            return
        dest.unlink()
    part.parent.mkdir(parents=True, exist_ok=True)
    part.touch()
    for pause in (*(pauses or RETRY_PAUSES), None):
        try:
            _request(url, part, f.size, headers, on_bytes)
            if part.stat().st_size == f.size:
                break
            failure = HubError(f"{f.name}: the hub sent {part.stat().st_size} of {f.size} bytes")
        except (_Retry, *network_errors()) as e:
            failure = e
            if isinstance(e, _Retry) and e.after is not None and pause is not None:
                pause = e.after
        if pause is None:
            if isinstance(failure, _Retry):
                raise HubError(f"{f.name}: the hub kept answering that it is busy; run the same command again")
            raise failure
        time.sleep(pause)
    if not matches(part, f):
        part.unlink()
        kind = "sha256" if f.sha256 is not None else "git blob id"
        raise ChecksumError(
            f"{dest}: its size or {kind} differs from the hub's listing; the download was damaged and removed, "
            f"run the same command again"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    part.replace(dest)
