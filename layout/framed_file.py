"""A JSON header and a compressed body in one file, for the files dsfp4 writes beside a model: eval's log-probabilities
(tools/logprobs_file.py) and the prompt cache's entries (runtime/generate/prompt_cache.py).

Layout: the caller's MAGIC, a little-endian u32 n, n bytes of UTF-8 JSON (the header, with `format_version`), then
one zstd frame (the body). pack and unpack are pure and inverse; every problem is a ValueError that says what is
wrong, for the caller to name its file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import zstandard

LENGTH = struct.Struct("<I")


def pack(magic: bytes, version: int, header: dict, body: bytes, level: int) -> bytes:
    """The file's bytes: header (JSON-able; `format_version` added) and body compressed at zstd `level`."""
    head = json.dumps({**header, "format_version": version}).encode()
    return magic + LENGTH.pack(len(head)) + head + zstandard.ZstdCompressor(level=level).compress(body)


def unpack_header(magic: bytes, version: int, data: bytes, what: str) -> tuple[dict, int]:
    """The file's first bytes (at least through its header) -> (header, where the body starts); `what` names the
    kind of file in the error when the magic is not there."""
    if not data.startswith(magic):
        raise ValueError(f"not {what}")
    start = len(magic) + LENGTH.size
    if len(data) < start:
        raise ValueError("truncated header")
    (n,) = LENGTH.unpack(data[len(magic) : start])
    if len(data) < start + n:
        raise ValueError("truncated header")
    try:
        header = json.loads(data[start : start + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"damaged header ({e})") from e
    if not isinstance(header, dict) or header.get("format_version") != version:
        got = header.get("format_version") if isinstance(header, dict) else None
        raise ValueError(f"format version {got}; this dsfp4 reads {version}")
    return header, start + n


def unpack(magic: bytes, version: int, data: bytes, what: str, max_body: int) -> tuple[dict, bytes]:
    """The file's bytes -> (header, body of at most max_body bytes)."""
    header, at = unpack_header(magic, version, data, what)
    return header, unpack_body(data, at, max_body)


def unpack_body(data: bytes, at: int, max_body: int) -> bytes:
    """The body that starts at `at` (unpack_header's), of at most max_body bytes once decompressed."""
    try:
        body = zstandard.ZstdDecompressor().decompress(data[at:], max_output_size=max_body)
    except zstandard.ZstdError as e:
        raise ValueError(f"damaged data ({e})") from e
    # a frame that states its size is decompressed whole: the bound is checked here
    if len(body) > max_body:
        raise ValueError(f"damaged data ({len(body)} bytes where at most {max_body} fit the header)")
    return body


def read_header(path: Path, magic: bytes, version: int, what: str, limit: int) -> dict:
    """Only the header of the file at `path`: its magic and length, then the header's own bytes (at most `limit`)."""
    with open(path, "rb") as f:
        head = f.read(len(magic) + LENGTH.size)
        if not head.startswith(magic) or len(head) < len(magic) + LENGTH.size:
            # raises what is wrong
            return unpack_header(magic, version, head, what)[0]
        (n,) = LENGTH.unpack(head[len(magic) :])
        if n > limit:
            raise ValueError(f"header of {n} bytes, more than the {limit} read")
        return unpack_header(magic, version, head + f.read(n), what)[0]
