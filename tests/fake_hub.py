"""A local stand-in for the Hugging Face Hub's HTTP API, for the download tests (no real hub is reachable).

It serves folders as model repos at one commit, on 127.0.0.1, through the endpoints huggingface_hub calls:
  GET  /api/models/{repo}/revision/{rev}      revision info, with file sizes and LFS sha256 (?blobs=true)
  HEAD /{repo}/resolve/{rev}/{file}           commit, ETag and size of a file
  GET  /{repo}/resolve/{rev}/{file}           its bytes, with Range requests
Errors carry the X-Error-Code header the client maps to its exceptions. Faults for tests: `drops[file]`
connections cut after `drop_at` bytes, `stalls[file]` responses that go silent there, `busy[file]`
answers of 503, `corrupt` files served with one byte flipped, `gated` repos that need a bearer token.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors",)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self, repos: dict[str, Path], gated: tuple[str, ...] = (), token: str = "hf_test"):
        self.repos, self.gated, self.token = repos, gated, token
        self.drops: dict[str, int] = {}  # file -> connections still to cut
        self.drop_at = 1000
        self.corrupt: set[str] = set()
        self.busy: dict[str, int] = {}  # file -> answers of 503 still to give
        self.stalls: dict[str, int] = {}  # file -> responses still to stall for `stall_s` after `drop_at` bytes
        self.stall_s = 3.0
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.request_times: list[float] = []  # time.monotonic() of each
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def info(self, repo: str) -> dict:
        siblings = []
        for name, path in self.files(repo).items():
            data = path.read_bytes()
            entry = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        return {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _error(self, status: int, code: str) -> None:
            body = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _repo_rev(self, repo: str, rev: str) -> bool:
            """Answer an error and return False unless the repo, the access and the revision are fine."""
            if repo not in hub.repos:
                self._error(401, "RepoNotFound")
            elif repo in hub.gated and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._error(403, "GatedRepo")
            elif rev not in ("main", COMMIT):
                self._error(404, "RevisionNotFound")
            else:
                return True
            return False

        def do_GET(self) -> None:
            self._serve()

        def do_HEAD(self) -> None:
            self._serve()

        def _serve(self) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            hub.request_times.append(time.monotonic())
            if path.startswith("/api/models/") and "/revision/" in path:
                repo, rev = path.removeprefix("/api/models/").split("/revision/", 1)
                if self._repo_rev(repo, rev):
                    body = json.dumps(hub.info(repo)).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if self.command == "GET":
                        self.wfile.write(body)
                return
            if "/resolve/" not in path:
                return self._error(404, "NotFound")
            repo, rest = path.lstrip("/").split("/resolve/", 1)
            rev, _, name = rest.partition("/")
            if not self._repo_rev(repo, rev):
                return
            files = hub.files(repo)
            if name not in files:
                return self._error(404, "EntryNotFound")
            if self.command == "GET" and hub.busy.get(name, 0) > 0:
                hub.busy[name] -= 1
                self.send_response(503)
                self.send_header("Retry-After", "0")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self._send_file(name, files[name].read_bytes())

        def _send_file(self, name: str, data: bytes) -> None:
            etag = hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else git_blob_id(data)
            if name in hub.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            rng = self.headers.get("Range")
            start, _, end = (rng or "bytes=0-").removeprefix("bytes=").partition("-")
            start, stop = int(start), int(end) + 1 if end else len(data)
            body = data[start:stop]
            self.send_response(206 if rng else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{etag}"')
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            if hub.stalls.get(name, 0) > 0:
                hub.stalls[name] -= 1
                self.wfile.write(body[: min(hub.drop_at, len(body) - 1)])
                self.wfile.flush()
                time.sleep(hub.stall_s)  # a connection that neither sends nor closes
                self.close_connection = True
                return
            if hub.drops.get(name, 0) > 0:
                hub.drops[name] -= 1
                self.wfile.write(body[: min(hub.drop_at, len(body) - 1)])
                self.wfile.flush()
                self.close_connection = True  # the client sees fewer bytes than promised
                return
            self.wfile.write(body)

    return Handler
