"""The persistent prompt cache (--prompt-cache DIR): the latent KV cache of a prompt, saved compressed after its
generation and restored by a later run or request whose prompt starts with the same tokens.

An entry is one file, `<key>.dsfp4kv` (layout/framed_file.py): its header names the conversion (Manifest
conversion_sha256), the caches' dtype and row shapes, and the prompt's token ids; its body holds the first N rows of
every positional cache (Model.positional_caches: V3's latent and RoPE caches, the MTP layer's too), each array's
bytes split into planes (byte i of every element together), which zstd packs tighter than the interleaved
elements. Positions depend only on the tokens before them, so an entry serves any prompt that shares a prefix with
it, up to that prefix. Entries are written atomically in a background thread, the folder is held to --prompt-cache-
size by evicting the least recently used (a use touches the file), and a damaged or foreign entry is skipped with a
note. A folder that cannot be written (a read-only mount; found by trying, since root ignores permissions) is used
read-only: its entries serve, none is saved or touched, and one note says so. A write that fails (a full disk) leaves
no temporary file and a note, which settle() hands over once the write has ended. Legend: N cached positions.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsfp4.errors import ConfigError, DsfpError
from dsfp4.layout import framed_file
from dsfp4.layout.atomic import atomic_write_bytes
from dsfp4.runtime.generate.steps import common_prefix

MAGIC = b"DSFP4KV\n"
FORMAT_VERSION = 1
SUFFIX = ".dsfp4kv"
WHAT = "a dsfp4 prompt cache entry"
# KV rows are mostly noise in their low bytes: higher levels cost seconds for a few percent
ZSTD_LEVEL = 3
# the largest header read while looking for a prefix (its token ids: 4 MiB is ~500k tokens)
HEADER_LIMIT = 1 << 22
# a prompt that prefilled fewer new tokens is not saved: its prefill costs less than the file
MIN_NEW_TOKENS = 32
# created and removed at once: whether the folder can be written
PROBE = ".dsfp4kv-probe"
# a write failing with these means the folder cannot be written at all, not this once
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
# and these that the disk (or the user's quota) is full
FULL = (errno.ENOSPC, errno.EDQUOT)


def encode_entry(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """header (JSON-able) and named arrays -> the entry's bytes; each array's shape and dtype go in the header."""
    specs = {name: [list(a.shape), a.dtype.str] for name, a in arrays.items()}
    body = b"".join(_planes(np.ascontiguousarray(a)) for a in arrays.values())
    return framed_file.pack(MAGIC, FORMAT_VERSION, {**header, "arrays": specs}, body, ZSTD_LEVEL)


def decode_entry(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """The entry's bytes -> (header, arrays); ValueError says what is wrong with them."""
    header, at = framed_file.unpack_header(MAGIC, FORMAT_VERSION, data, WHAT)
    specs = header.get("arrays")
    if not isinstance(specs, dict):
        raise ValueError("damaged header (no arrays)")
    try:
        sizes = {name: int(np.prod(shape)) * np.dtype(dtype).itemsize for name, (shape, dtype) in specs.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"damaged header (arrays: {e})") from None
    body = framed_file.unpack_body(data, at, sum(sizes.values()))
    if len(body) != sum(sizes.values()):
        raise ValueError(f"truncated data: {len(body)} bytes of {sum(sizes.values())}")
    arrays, at = {}, 0
    for name, (shape, dtype) in specs.items():
        arrays[name] = _unplanes(body[at : at + sizes[name]], np.dtype(dtype), tuple(shape))
        at += sizes[name]
    return header, arrays


def _planes(a: np.ndarray) -> bytes:
    """An array's bytes, byte i of every element together (its byte planes)."""
    return a.view(np.uint8).reshape(-1, a.dtype.itemsize).T.tobytes()


def _unplanes(data: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8).reshape(dtype.itemsize, -1).T.copy()  # [elements, itemsize]
    return raw.view(dtype).reshape(shape)


@dataclass(frozen=True)
class Hit:
    path: Path
    # positions it serves for the prompt looked up
    common: int
    # the MTP layer's entries it holds (positions 0 .. mtp_upto - 1)
    mtp_upto: int


class PromptCache:
    def __init__(self, folder: Path, max_bytes: int, identity: dict):
        """folder: where entries live (created); max_bytes: the folder's bound; identity: what an entry must match to
        be used (the conversion, the caches' dtype and row shapes)."""
        self.folder, self.max_bytes, self.identity = Path(folder), max_bytes, identity
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"--prompt-cache {self.folder}: the folder cannot be made ({e.strerror or e}); give a folder that "
                "exists or can be made"
            ) from None
        # entries skipped since the last look (damaged, foreign), writes that failed; the writer's thread adds to them
        self.notes: list[str] = []
        self._notes_lock = threading.Lock()
        # the folder cannot be written: entries are read, none is saved or touched
        self.read_only = False
        self._probe()
        self._writer: threading.Thread | None = None
        # the tokens of the entry being written
        self._pending: list[int] = []
        # the last entry written (a find may not have read its header yet)
        self._written: dict[Path, dict] = {}
        # the headers read so far, by file (inode and size: an entry is never changed in place, only replaced), so
        # a request reads only the entries new since the last; None for an entry that cannot be read (noted once)
        self._headers: dict[Path, tuple[tuple[int, int], dict | None]] = {}
        # of the last entry written
        self.compressed_bytes = self.raw_bytes = 0

    def _probe(self) -> None:
        """Whether the folder can be written, by trying (root may write where the permissions say no one can)."""
        probe = self.folder / PROBE
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            # another process's probe may have taken it
            probe.unlink(missing_ok=True)
        except OSError as e:
            self._cannot_write(e)

    def _cannot_write(self, e: OSError) -> None:
        """From now on read-only, said once."""
        if not self.read_only:
            self.read_only = True
            self._note(
                f"prompt cache: {self.folder} cannot be written ({e.strerror or e}); its entries are used read-only "
                "and no new one is saved"
            )

    def find(self, prompt: list[int], longer_than: int) -> Hit | None:
        """The entry sharing the longest prefix with `prompt` (short of its last token, which must be fed), if that
        is longer than `longer_than` positions. Waits for the entry being written only when it could be the answer:
        an unrelated request does not queue behind a write (the folder shows only whole entries: they are renamed
        into place)."""
        if min(common_prefix(self._pending, prompt), len(prompt) - 1) > longer_than:
            self.wait()
        best = None
        paths = sorted(self.folder.glob(f"*{SUFFIX}"))
        present = set(paths)
        # evicted ones forgotten
        self._headers = {p: v for p, v in self._headers.items() if p in present}
        for path in paths:
            header = self._header(path)
            if header is None or any(header.get(k) != v for k, v in self.identity.items()):
                # another conversion, dtype or cache shape: not this run's
                continue
            tokens = header.get("tokens", [])
            common = min(common_prefix(tokens, prompt), len(prompt) - 1)
            if common > longer_than and (best is None or common > best.common):
                best = Hit(path, common, int(header.get("mtp_upto", 0)))
        return best

    def _header(self, path: Path) -> dict | None:
        """The entry's header, read once per version of the file; None (with a note, once) when it cannot be read."""
        try:
            st = path.stat()
        except OSError:
            # evicted meanwhile
            return None
        key = (st.st_ino, st.st_size)
        known = self._headers.get(path)
        if known is not None and known[0] == key:
            return known[1]
        try:
            header = framed_file.read_header(path, MAGIC, FORMAT_VERSION, WHAT, HEADER_LIMIT)
        except (OSError, ValueError) as e:
            self._note(f"prompt cache: {path.name} skipped ({e})")
            header = None
        self._headers[path] = (key, header)
        return header

    def load(self, hit: Hit) -> dict[str, np.ndarray] | None:
        """The entry's arrays, or None with a note when it cannot be read."""
        try:
            _, arrays = decode_entry(hit.path.read_bytes())
        except (OSError, ValueError) as e:
            self._note(f"prompt cache: {hit.path.name} skipped ({e})")
            return None
        if not self.read_only:
            # the fine clock: a file's own times come from a coarser one, which could tie
            now = time.time_ns()
            try:
                # used: the last to be evicted
                os.utime(hit.path, ns=(now, now))
            except OSError as e:
                # the entry serves all the same
                if e.errno in READ_ONLY:
                    self._cannot_write(e)
        return arrays

    def restore(self, hit: Hit, caches: dict[str, torch.Tensor]) -> bool:
        """Copy the hit's first hit.common rows into `caches` (Model.positional_caches) -> whether it could (an entry
        that cannot be read is skipped with a note)."""
        arrays = self.load(hit)
        if arrays is None:
            return False
        if set(arrays) != set(caches):
            self._note(f"prompt cache: {hit.path.name} skipped (its caches are not this model's)")
            return False
        for name, t in caches.items():
            t[: hit.common].copy_(_tensor(arrays[name][: hit.common], t.dtype))
        return True

    def _note(self, text: str) -> None:
        with self._notes_lock:
            self.notes.append(text)

    def take_notes(self) -> str:
        """The notes since the last call, joined (a write still running adds its own to the next call's)."""
        with self._notes_lock:
            notes, self.notes = self.notes, []
        return "; ".join(notes)

    def settle(self) -> str:
        """take_notes() once the entry being written is in place or has failed: a one-shot run's last word."""
        self.wait()
        return self.take_notes()

    def save(self, tokens: list[int], caches: dict[str, torch.Tensor], mtp_upto: int) -> None:
        """Write the entry of `tokens` (the first len(tokens) rows of `caches`, copied to the CPU now) in the
        background; one write at a time. Nothing in a folder that cannot be written."""
        self.wait()
        if self.read_only:
            return
        arrays = {name: _numpy(t[: len(tokens)].cpu()) for name, t in caches.items()}
        header = {**self.identity, "tokens": list(tokens), "mtp_upto": min(mtp_upto, len(tokens))}
        key = hashlib.sha256(repr(sorted(self.identity.items())).encode() + np.asarray(tokens, np.int64).tobytes())
        path = self.folder / f"{key.hexdigest()[:32]}{SUFFIX}"
        self.raw_bytes = sum(a.nbytes for a in arrays.values())
        known = {**{p: h for p, (_, h) in self._headers.items()}, **self._written}
        covered = [p for p, h in known.items() if p != path and self._covers(header, h)]
        self._written = {path: header}
        self._pending = list(tokens)
        self._writer = threading.Thread(target=self._write, args=(path, header, arrays, covered), daemon=True)
        self._writer.start()

    def _covers(self, new: dict, old: dict | None) -> bool:
        """Whether the `new` entry serves every prompt `old` serves, as far or further: old's tokens a prefix of
        new's, of this run's identity, with no more MTP entries."""
        if old is None or any(old.get(k) != v for k, v in self.identity.items()):
            return False
        tokens = old.get("tokens", [])
        return new["tokens"][: len(tokens)] == tokens and old.get("mtp_upto", 0) <= new["mtp_upto"]

    def _write(self, path: Path, header: dict, arrays: dict[str, np.ndarray], covered: list[Path]) -> None:
        """The entry put in place; then the entries it covers (a chat's earlier turns) removed, and the folder held
        to its bound."""
        try:
            data = encode_entry(header, arrays)
            self.compressed_bytes = len(data)
            atomic_write_bytes(path, data)
            for old in covered:
                old.unlink(missing_ok=True)
            self.evict()
        except OSError as e:
            # a full disk loses an entry, not the answer (atomic_write_bytes removes its temporary file)
            if e.errno in READ_ONLY:
                self._cannot_write(e)
            else:
                full = "; free some space there or lower --prompt-cache-size" if e.errno in FULL else ""
                self._note(f"prompt cache: {path.name} not written in {self.folder} ({e.strerror or e}){full}")
        except DsfpError as e:
            self._note(f"prompt cache: {path.name} not written ({e})")

    def evict(self) -> None:
        """Remove the least recently used entries until the folder fits max_bytes."""
        entries = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                # removed by another process meanwhile
                continue
            entries.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size

    def wait(self) -> None:
        """Until the entry being written is in place."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy; bf16 (which numpy lacks) as its 16-bit patterns (the identity names the dtype)."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
