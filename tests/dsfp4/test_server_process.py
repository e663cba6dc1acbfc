"""`dsfp4 run --serve` as processes: a soak of many clients, some leaving mid-stream, the HTTP process ending with the
engine's, a port in use refused before the model loads."""

from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.fixtures.server import BATCH, KEY, PROMPTS, QUEUE, Server, messages, serve, wait_for

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(converted):
    with serve(converted, "--api-key", KEY, "--max-queue", str(QUEUE), "--max-batch", str(BATCH)) as s:
        yield s


def _soak_request(server: Server, i: int, expected: dict, rng: random.Random, out: Counter) -> bool:
    """One request; False when the queue was full (503), so the caller retries it."""
    prompt = PROMPTS[i % len(PROMPTS)]
    chat, stream, leave = rng.random() < 0.5, rng.random() < 0.5, i % 10 == 3  # 20 of 200 leave mid-stream
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 6, "temperature": 0, "stream": stream or leave}
    body.update({"messages": messages(prompt)} if chat else {"prompt": prompt})
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.base + path, json=body, headers=headers, timeout=120) as r:
        if r.status_code == 503:
            r.read()
            assert r.json()["error"]["code"] == "queue_full"
            out["503"] += 1
            return False
        assert r.status_code == 200
        if leave:
            next(r.iter_lines())
            out["left"] += 1
            return True
        if not body["stream"]:
            r.read()
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
        else:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            deltas = [json.loads(e)["choices"] for e in events[:-1]]
            text = "".join((c[0]["delta"].get("content") or "") if chat else c[0]["text"] for c in deltas if c)
    assert text == expected[chat, prompt], f"request {i} got another answer"
    out["ok"] += 1
    return True


@pytest.mark.slow
def test_soak_200_requests_from_8_clients_20_leaving_mid_stream(server):
    c = server.client()
    expected = {}
    for prompt in PROMPTS:
        expected[True, prompt] = (
            c.chat.completions.create(model="fp8", messages=messages(prompt), max_tokens=6, temperature=0)
            .choices[0]
            .message.content
        )
        expected[False, prompt] = (
            c.completions.create(model="fp8", prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        )
    rss_before = server.rss()
    out: Counter = Counter()
    errors: list[BaseException] = []

    def client(k: int) -> None:
        rng = random.Random(k)
        for i in range(k, 200, 8):
            try:
                while not _soak_request(server, i, expected, rng, out):
                    time.sleep(rng.uniform(0.05, 0.3))  # a client told the queue is full comes back later
            except BaseException as e:  # collected: an assertion in a thread would be lost
                errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert out["ok"] == 180 and out["left"] == 20 and out["503"] > 0, out
    idle = {"status": "ok", "busy": False, "running": 0, "queue": 0}
    wait_for(lambda: httpx.get(server.base + "/health").json() == idle)
    grown = server.rss() - rss_before
    assert grown < 8 << 20, f"the server's RSS grew by {grown >> 20} MiB over 200 requests"
    assert (
        server.metric('dsfp4_requests_total{endpoint="chat",status="503"}')
        + server.metric('dsfp4_requests_total{endpoint="completions",status="503"}')
        == out["503"]
    )


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_the_http_process_ends_with_the_engines(converted):
    with serve(converted) as s:  # SIGTERM to the engine's process: both end, cleanly
        (front,) = s.children()
        s.proc.terminate()
        assert s.proc.wait(timeout=30) == 0, s.proc.communicate()[1][-2000:]
        wait_for(lambda: _gone(front))
    with serve(converted) as s:  # Ctrl-C, as a shell reports it, once both have ended
        (front,) = s.children()
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=30) == 130 and "interrupted" in s.proc.communicate()[1]
        wait_for(lambda: _gone(front))
    with serve(converted) as s:  # the engine's process killed: the HTTP one sees the link close and stops
        (front,) = s.children()
        s.proc.kill()
        s.proc.wait(timeout=30)
        wait_for(lambda: _gone(front))
        with pytest.raises(httpx.HTTPError):
            httpx.get(s.base + "/health", timeout=5)


def test_a_port_in_use_fails_in_one_line_before_the_model_loads(converted):
    from tests.fixtures.cli import assert_one_line_error, run_cli

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run_cli("run", converted, "--serve", "--device", "cpu", "--port", str(port))
    assert_one_line_error(r, f"--port {port}: cannot listen there", "another --port")
    assert "expert slots" not in r.output  # the plan is printed once the model has loaded: it never was
