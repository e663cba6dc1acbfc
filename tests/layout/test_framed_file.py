"""layout/framed_file.py: header and compressed body round-trip, and every damage is a ValueError saying what."""

from __future__ import annotations

import pytest

from dsfp4.layout import framed_file

MAGIC, VERSION = b"TESTFILE\n", 3


def test_round_trip_and_header_alone(tmp_path):
    data = framed_file.pack(MAGIC, VERSION, {"a": [1, 2]}, b"body" * 100, level=3)
    header, body = framed_file.unpack(MAGIC, VERSION, data, "a test file", max_body=400)
    assert header == {"a": [1, 2], "format_version": VERSION} and body == b"body" * 100
    path = tmp_path / "f"
    path.write_bytes(data)
    assert framed_file.read_header(path, MAGIC, VERSION, "a test file", limit=1 << 16) == header
    assert framed_file.unpack(MAGIC, VERSION, framed_file.pack(MAGIC, VERSION, {}, b"", 1), "x", 0)[1] == b""


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda d: b"OTHER" + d[5:], "not a test file"),
        (lambda d: d[:10], "truncated header"),
        (lambda d: d[:30], "truncated header"),
        (lambda d: d.replace(b'{"a"', b'{"a\xff'), "damaged header"),
        (lambda d: d.replace(b'"format_version": 3', b'"format_version": 9'), "format version 9"),
        (lambda d: d[:-5], "damaged data"),
    ],
)
def test_damage_is_named(damage, message):
    data = framed_file.pack(MAGIC, VERSION, {"a": 1}, b"x" * 1000, level=3)
    with pytest.raises(ValueError, match=message):
        framed_file.unpack(MAGIC, VERSION, damage(data), "a test file", max_body=1000)


def test_a_body_larger_than_allowed_is_refused():
    data = framed_file.pack(MAGIC, VERSION, {}, b"x" * 1000, level=3)
    with pytest.raises(ValueError, match="damaged data"):
        framed_file.unpack(MAGIC, VERSION, data, "a test file", max_body=10)


@pytest.mark.parametrize("cut", [3, 10, 30, None])
def test_read_header_reads_the_header_alone_and_names_damage(tmp_path, cut):
    """It reads the magic, the length and the header's own bytes (not the body), within the limit."""
    data = framed_file.pack(MAGIC, VERSION, {"a": "x" * 100}, b"y" * 100_000, level=3)
    path = tmp_path / "f"
    path.write_bytes(data[:cut] if cut else data)
    if cut is not None:
        with pytest.raises(ValueError, match="not a test file|truncated header"):
            framed_file.read_header(path, MAGIC, VERSION, "a test file", limit=1 << 16)
        return
    assert framed_file.read_header(path, MAGIC, VERSION, "a test file", limit=1 << 16)["a"] == "x" * 100
    with pytest.raises(ValueError, match="more than the 50 read"):
        framed_file.read_header(path, MAGIC, VERSION, "a test file", limit=50)
