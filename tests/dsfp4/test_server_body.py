"""What a request may take of the server before it is checked (body.py, deadline.py): a body past --max-body is a 413
before it is read (from its Content-Length, or counted as a chunked one streams), a head or a body that comes too
slowly is cut at --read-timeout, and a client that leaves mid-body costs one line in the log. The real server in a
subprocess, at a read timeout of a second so that the slow clients are cut soon."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from dsfp4.server.client_limits import HEAD_BYTES, default_max_body
from tests.fixtures.cli import assert_one_line_error, run_cli
from tests.fixtures.server import CONTEXT, KEY, Server, messages, serve, wait_for

READ_TIMEOUT = 1
# a slow client's pause between two pieces: the server cuts it after a few
TRICKLE_S = 0.4
# pieces a slow client would send at the most: far more than the read timeout lets through
PIECES = 50
HEAD = (
    "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {key}\r\n"
    "Content-Type: application/json\r\n"
)


@pytest.fixture(scope="module")
def server(converted):
    with serve(converted, "--api-key", KEY, "--read-timeout", str(READ_TIMEOUT)) as s:
        yield s


def _connect(server: Server) -> socket.socket:
    host, port = server.base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the response on `sock`, read until the server closes it or the body is whole."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body[: _length(data)])


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode().lower()
    return next((int(line.split(":")[1]) for line in head.splitlines() if line.startswith("content-length:")), 0)


def _trickle(sock: socket.socket, pieces: list[bytes]) -> int:
    """Send the pieces TRICKLE_S apart until the server closes the connection -> how many went."""
    for sent, piece in enumerate(pieces):
        try:
            sock.sendall(piece)
        except OSError:
            return sent
        time.sleep(TRICKLE_S)
        if _closed(sock):
            return sent + 1
    return len(pieces)


def _closed(sock: socket.socket) -> bool:
    """Whether the server has answered or closed (the answer stays to be read)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) is not None
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)


def test_a_body_past_the_default_limit_is_a_413_from_its_content_length_before_any_of_it_is_sent(server):
    limit = default_max_body(CONTEXT)
    with _connect(server) as sock:
        sock.sendall((HEAD.format(key=KEY) + f"Content-Length: {limit + 1}\r\n\r\n").encode())
        status, body = _answer(sock)  # not a byte of the body went
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert str(limit) in body["error"]["message"] and "--max-body" in body["error"]["message"]
    assert "\n" not in body["error"]["message"]
    assert httpx.get(server.base + "/health").status_code == 200


def test_a_chunked_body_is_counted_as_it_comes(server):
    limit = default_max_body(CONTEXT)
    chunk = b" " * 65536

    def body():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(limit // len(chunk) + 2):
            yield chunk

    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.base + "/v1/chat/completions", content=body(), headers=headers, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "more than" in r.json()["error"]["message"]
    # a body within the limit is answered as ever
    small = {"messages": messages("hi"), "max_tokens": 2}
    assert httpx.post(server.base + "/v1/chat/completions", json=small, headers=headers, timeout=60).status_code == 200


def test_a_head_that_comes_a_line_at_a_time_is_cut(server):
    with _connect(server) as sock:
        lines = [HEAD.format(key=KEY).encode()] + [f"X-Slow-{i}: 1\r\n".encode() for i in range(PIECES)]
        sent = _trickle(sock, lines)
        assert sent < PIECES, "the server kept waiting for the head"
        status, body = _answer(sock)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    with _connect(server) as sock:  # a connection that sends nothing is cut too
        assert _trickle(sock, [b""] * PIECES) < PIECES
    assert httpx.get(server.base + "/health").status_code == 200


def test_a_head_past_its_limit_is_refused_as_it_comes(server):
    with _connect(server) as sock:
        sock.sendall(HEAD.format(key=KEY).encode())
        line = b"X-Big: " + b"a" * HEAD_BYTES + b"\r\n"
        with pytest.raises(OSError):  # cut while it still sends: a head of 200 MiB had been taken whole
            for _ in range(200 * (1 << 20) // len(line)):
                sock.sendall(line)
    assert httpx.get(server.base + "/health").status_code == 200


def test_a_body_at_a_byte_at_a_time_is_cut(server):
    with _connect(server) as sock:
        sock.sendall((HEAD.format(key=KEY) + f"Content-Length: {PIECES}\r\n\r\n").encode())
        assert _trickle(sock, [b" "] * PIECES) < PIECES, "the server kept waiting for the body"
        status, body = _answer(sock)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert httpx.get(server.base + "/health").status_code == 200


def test_max_body_sets_the_limit_and_a_client_that_leaves_mid_body_costs_one_line_in_the_log(converted):
    with serve(converted, "--max-body", "1K") as s:
        r = httpx.post(s.base + "/v1/chat/completions", json={"messages": messages("x" * 1024)}, timeout=60)
        assert r.status_code == 413 and "at most 1024 bytes" in r.json()["error"]["message"]
        with _connect(s) as sock:
            sock.sendall((HEAD.format(key=KEY) + "Content-Length: 1000\r\n\r\n" + '{"messages": ').encode())
        wait_for(lambda: s.metric('dsfp4_requests_total{endpoint="chat",status="499"}') == 1)
        s.proc.terminate()
        _, err = s.proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if "left" in line or "Traceback" in line or "ASGI" in line]
    assert len(lines) == 1 and "the client left after 13 bytes of its body" in lines[0], err[-3000:]


def test_the_flags_are_refused_where_they_would_do_nothing_or_make_no_sense(converted):
    r = run_cli("run", converted, "--device", "cpu", "--prompt", "hi", "--max-body", "8M")
    assert r.exit_code == 2 and "--max-body only applies with --serve" in r.stderr, r.output
    for value in ("lots", "0"):
        r = run_cli("run", converted, "--device", "cpu", "--serve", "--max-body", value)
        assert_one_line_error(r, "--max-body", value)
    r = run_cli("run", converted, "--device", "cpu", "--serve", "--read-timeout", "0")
    assert r.exit_code == 2 and "--read-timeout" in r.stderr, r.output
