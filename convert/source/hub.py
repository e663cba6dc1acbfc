"""`dsfp4 convert --from-hub`: source shards fetched from the hub as the conversion needs them.

The small files (config, index, tokenizer) are downloaded first and each shard's safetensors header is
read with two Range requests, so the conversion can be planned before any shard is on disk. A fetcher
thread then downloads the shards in the order the parts need them, at most `ahead` shards before the
part being converted. With --delete-source a shard is deleted once every part that reads it is
finished, so the disk holds the output plus a few shards rather than the whole source (640 GB for V3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from dsfp4.convert.source.checkpoint import source_selection
from dsfp4.hub.download import PARTIAL_DIR, DownloadPlan, download, fetch_recorded, hub_errors, locked, plan_download
from dsfp4.hub.remote_file import HubError, RemoteFile
from dsfp4.layout.atomic import LOCK_NAME
from dsfp4.layout.safetensors_file import TensorInfo, header_length, parse_header

SHARD_SUFFIX = ".safetensors"


def _range(plan: DownloadPlan, f: RemoteFile, token: str | None, start: int, stop: int) -> bytes:
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(plan.repo, f.name, revision=plan.commit, endpoint=plan.endpoint)
    headers = build_hf_headers(token=token) | {"Range": f"bytes={start}-{stop - 1}"}
    r = get_session().get(url, headers=headers, follow_redirects=True, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
    hf_raise_for_status(r)
    data = r.content
    if r.status_code != 206 or len(data) != stop - start:
        raise HubError(f"{plan.repo}: {f.name}: the hub did not answer a range request; --from-hub needs them")
    return data


def remote_header(plan: DownloadPlan, f: RemoteFile, token: str | None) -> dict[str, TensorInfo]:
    """A shard's tensors, from its header alone."""
    where = f"{plan.repo}/{f.name}"
    n = header_length(where, f.size, _range(plan, f, token, 0, 8))
    return parse_header(where, f.size, _range(plan, f, token, 8, 8 + n))


def _order(parts: list[set[str]]) -> list[str]:
    """Shards in the order the parts first read them."""
    return list(dict.fromkeys(s for shards in parts for s in sorted(shards)))


class HubSource:
    def __init__(
        self,
        repo: str,
        folder: Path,
        revision: str = "main",
        token: str | None = None,
        no_mtp: bool = False,
        delete: bool = False,
        ahead: int = 2,
        endpoint: str | None = None,
        verify: bool = False,
    ):
        """verify: every shard an earlier run fetched hashed again (not only those whose size or mtime changed);
        one that fails is fetched again."""
        self.token, self.delete, self.ahead = token, delete, ahead
        selection = source_selection(no_mtp=no_mtp)
        self.plan = plan_download(
            repo, revision, Path(folder), selection, token=token, endpoint=endpoint, verify=verify
        )
        shards = [f for f in self.plan.files if f.name.endswith(SHARD_SUFFIX)]
        small = dataclasses.replace(self.plan, files=[f for f in self.plan.files if f not in shards])
        download(small, token)
        self.files = {f.name: f for f in shards}
        with hub_errors(repo, revision):
            self.remote = {f.name: (f.size, remote_header(self.plan, f, token)) for f in shards}
        # shard -> parts still to read it
        self.uses: dict[str, int] = {}
        # on disk and not released
        self.ready: set[str] = set()
        # shards some started part reads; the window counts the others
        self.asked: set[str] = set()
        # bytes of shards on disk now, and the most there ever were
        self.on_disk = 0
        self.peak = 0
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self._lock = contextlib.ExitStack()
        # held until close(): no other run writes these files
        self._lock.enter_context(locked(self.plan))

    def _present(self, shard: str) -> bool:
        return self.plan.place(self.files[shard])[0].is_file()

    def disk_need(self, parts: list[set[str]]) -> int:
        """Bytes of source the run will add to the disk at its peak. Parts are finalized one behind the
        part being read, and the workers' job window reaches into the next part, so a part's shards live
        alongside the previous and the next part's, the window ahead and any shard a later part still
        reads; without --delete-source every shard stays."""
        size = {n: f.size for n, f in self.files.items()}
        order = _order(parts)
        missing = {s for s in order if not self._present(s)}
        if not self.delete:
            return sum(size[s] for s in missing)
        first = {s: min(k for k, p in enumerate(parts) if s in p) for s in order}
        last = {s: max(k for k, p in enumerate(parts) if s in p) for s in order}
        peak = 0
        for k, shards in enumerate(parts):
            live = shards | (parts[k - 1] if k else set()) | (parts[k + 1] if k + 1 < len(parts) else set())
            # held for a later part
            live |= {s for s in order if first[s] < k < last[s]}
            live |= set([s for s in order if first[s] > k + 1][: self.ahead])
            peak = max(peak, sum(size[s] for s in live & missing))
        return peak

    def start(self, parts: list[set[str]]) -> None:
        """Fetch the shards the parts read, in the parts' order, in the background."""
        for shards in parts:
            for s in shards:
                self.uses[s] = self.uses.get(s, 0) + 1
        self.thread = threading.Thread(target=self._fetch_all, args=(_order(parts),), name="dsfp4-hub", daemon=True)
        self.thread.start()

    def _fetch_all(self, order: list[str]) -> None:
        try:
            for shard in order:
                # at most `ahead` shards fetched beyond those the started parts read
                with self.cond:
                    self.cond.wait_for(
                        lambda s=shard: (
                            len(self.ready - self.asked) < self.ahead or s in self.asked or self.error is not None
                        )
                    )
                    if self.error is not None:
                        return
                # a shard an earlier run fetched and checked is not hashed again
                if shard not in self.plan.done:
                    with hub_errors(self.plan.repo, self.plan.revision):
                        fetch_recorded(self.plan, self.files[shard], self.token)
                with self.cond:
                    self.ready.add(shard)
                    self.on_disk += self.files[shard].size
                    self.peak = max(self.peak, self.on_disk)
                    self.cond.notify_all()
        except BaseException as e:
            # handed to the converter, which raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def need(self, shards: Iterable[str]) -> None:
        """Block until these shards are on disk."""
        shards = set(shards)
        with self.cond:
            self.asked |= shards
            self.cond.notify_all()
            self.cond.wait_for(lambda: shards <= self.ready or self.error is not None)
            if self.error is not None:
                raise self.error

    def done(self, shards: Iterable[str], release: Callable[[str], None]) -> None:
        """A part that read these shards is finished: the ones no other part needs are released (their
        reader closed by `release(shard)`) and, with --delete-source, deleted."""
        for shard in shards:
            with self.cond:
                self.uses[shard] -= 1
                if self.uses[shard]:
                    continue
                self.ready.discard(shard)
            release(shard)
            if self.delete:
                self.plan.place(self.files[shard])[0].unlink(missing_ok=True)
            with self.cond:
                self.on_disk -= self.files[shard].size if self.delete else 0
                self.cond.notify_all()

    def __enter__(self) -> HubSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop fetching (a download in progress ends first) and let go of the folder."""
        with self.cond:
            if self.error is None:
                self.error = HubError("the conversion stopped")
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()
        self._lock.close()

    def remove(self) -> None:
        """After a --delete-source run: remove what it wrote (the small files, the record, partial files),
        and the folder if nothing else is in it."""
        for f in self.plan.files:
            dest, part, path = self.plan.place(f)
            for p in (dest, part, path):
                p.unlink(missing_ok=True)
        for p in (self.plan.record, self.plan.target / LOCK_NAME):
            p.unlink(missing_ok=True)
        for folder in (self.plan.target / PARTIAL_DIR, self.plan.target):
            with contextlib.suppress(OSError):
                # only if empty
                folder.rmdir()
