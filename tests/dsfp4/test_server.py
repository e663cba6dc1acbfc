"""`dsfp4 run --serve`: the real server in a subprocess on 127.0.0.1, driven by the official openai client
(chat and completions, streaming or not) and by raw HTTP for the errors, cancellation and a soak test."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.fixtures.cli import run_cli

openai = pytest.importorskip("openai")

KEY = "test-key"
CONTEXT = 128
QUEUE = 4
BATCH = 3  # requests decoding together (continuous batching)
PROMPTS = ["hello", "Why is the sky blue?", "Write a haiku about SSDs", "2+2?"]


@dataclass
class Server:
    base: str
    proc: subprocess.Popen

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=KEY, max_retries=0)

    def children(self) -> list[int]:
        """The HTTP process (the engine's runs in `proc`)."""
        return [int(c) for c in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()]

    def rss(self) -> int:
        """Both processes'."""
        total = 0
        for pid in [self.proc.pid, *self.children()]:
            status = Path(f"/proc/{pid}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) * 1024
        return total

    def metric(self, name: str) -> float:
        text = httpx.get(self.base + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serve(model: Path, *flags: str):
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "dsfp4.cli.main",
        "run",
        str(model),
        "--serve",
        "--device",
        "cpu",
        "--port",
        str(port),
        "--max-context",
        str(CONTEXT),
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = Server(f"http://127.0.0.1:{port}", proc)
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(server.base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"the server did not start: {proc.communicate(timeout=10)[1][-2000:]}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(converted):
    with _serve(converted, "--api-key", KEY, "--max-queue", str(QUEUE), "--max-batch", str(BATCH)) as s:
        yield s


def _post(server: Server, path: str, body: object, key: str | None = KEY, raw: bytes | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.base + path, content=content, headers=headers, timeout=60)


def _chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


@pytest.mark.slow
def test_openai_client_chat_and_completions_streaming_and_not(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == ["fp8"]
    r = c.chat.completions.create(model="fp8", messages=_chat("hello"), max_tokens=8, temperature=0)
    text, usage, stats = r.choices[0].message.content, r.usage, r.model_extra["stats"]
    assert r.choices[0].finish_reason == "length" and usage.completion_tokens == 8
    assert usage.total_tokens == usage.prompt_tokens + 8 and stats["prompt_tokens"] == usage.prompt_tokens
    for field in ("ttft_s", "prefill_tok_s", "decode_tok_s", "gpu_hit_rate", "ram_hit_rate", "ssd_bytes_per_token"):
        assert field in stats
    chunks = list(
        c.chat.completions.create(
            model="fp8",
            messages=_chat("hello"),
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(ch.usage is None for ch in chunks[:-1])  # counted once: clients add usage up over chunks
    assert len({ch.id for ch in chunks}) == 1
    stop = text[2:4]
    r = c.chat.completions.create(model="fp8", messages=_chat("hello"), max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text[: text.find(stop)]
    done = c.completions.create(model="fp8", prompt="hello", max_tokens=6, temperature=0)
    streamed = list(c.completions.create(model="fp8", prompt="hello", max_tokens=6, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == done.choices[0].text
    assert done.choices[0].finish_reason == streamed[-1].choices[0].finish_reason == "length"
    seeded = [
        c.completions.create(model="fp8", prompt="hi", max_tokens=6, temperature=1.0, seed=s).choices[0].text
        for s in (5, 5, 6)
    ]
    assert seeded[0] == seeded[1] != seeded[2]


@pytest.mark.slow
def test_greedy_output_through_the_server_equals_dsfp4_run(server, converted):
    c = server.client()
    for prompt in PROMPTS[:2]:
        r = run_cli(
            "run",
            converted,
            "--prompt",
            prompt,
            "--temperature",
            0,
            "--max-tokens",
            8,
            "--device",
            "cpu",
            "--max-context",
            CONTEXT,
            "--json",
        )
        local = json.loads(r.stdout)
        served = c.chat.completions.create(model="fp8", messages=_chat(prompt), max_tokens=8, temperature=0)
        assert served.choices[0].message.content == local["text"]
        assert served.usage.prompt_tokens == len(local["prompt_token_ids"])
        r = run_cli(
            "run",
            converted,
            "--prompt",
            prompt,
            "--raw",
            "--temperature",
            0,
            "--max-tokens",
            8,
            "--device",
            "cpu",
            "--max-context",
            CONTEXT,
            "--json",
        )
        served = c.completions.create(model="fp8", prompt=prompt, max_tokens=8, temperature=0)
        assert served.choices[0].text == json.loads(r.stdout)["text"]


@pytest.mark.parametrize(
    "body,status,needle",
    [
        (b"{not json", 400, "not valid JSON"),
        ([1, 2], 400, "must be a JSON object"),
        ({"messages": _chat("hi"), "frobnicate": 1}, 400, "unrecognized request argument supplied: frobnicate"),
        ({"messages": _chat("hi"), "temperature": "hot"}, 400, "temperature: must be a number in [0, 2]"),
        ({"messages": _chat("hi"), "max_tokens": "8"}, 400, "max_tokens: must be an integer"),
        ({"messages": _chat("hi"), "stream": "yes"}, 400, "stream: must be true or false"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role: must be one of"),
        ({"messages": [{"role": "user"}]}, 400, "messages[0].content: is missing"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text only"),
        ({"messages": []}, 400, "messages: must be a non-empty list"),
        ({"messages": _chat("hi"), "max_tokens": -3}, 400, "max_tokens: must be an integer from 1"),
        ({"messages": _chat("hi"), "max_tokens": 10**6}, 400, "leave room for"),
        ({"messages": _chat("hi " * 200)}, 400, "this server's context holds 128"),
        ({"messages": _chat("hi " * 200)}, 400, "(start it with a larger --max-context, up to the model's 2048)"),
        ({"messages": _chat("hi " * 2100)}, 400, "the model's positions end at 2048, whatever --max-context"),
        ({"messages": _chat("hi"), "n": 2}, 400, "n: dsfp4 serves only 1"),
        ({"messages": _chat("hi"), "stop": [""]}, 400, "stop: must be a non-empty string"),
        ({"messages": _chat("hi"), "model": "gpt-4"}, 404, "this server serves 'fp8'"),
        ({"prompt": [1, 2, 10**9]}, 400, "outside the vocabulary"),
    ],
)
def test_bad_requests_get_openai_style_errors_and_the_server_goes_on(server, body, status, needle):
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    r = _post(server, path, body, raw=body if isinstance(body, bytes) else None)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert _post(server, "/v1/chat/completions", {"messages": _chat("hi"), "max_tokens": 2}).status_code == 200


def _prefill_comments(lines: list[str]) -> list[tuple[int, int]]:
    return [tuple(map(int, x.removeprefix(": prefill ").split("/"))) for x in lines if x.startswith(": prefill ")]


def test_a_streamed_prefill_sends_its_progress_as_comments_that_the_openai_client_skips(server):
    body = {"messages": _chat("Tell me about the tiers of the expert store"), "max_tokens": 4, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", server.base + "/v1/chat/completions", json={**body, "stream": True}, headers=headers
    ) as r:
        lines = list(r.iter_lines())
    events = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: {")]
    stats, progress = events[-1]["stats"], _prefill_comments(lines)
    # the tokens this prefill fed: those after the prefix the last prompt shares with it
    n = stats["prompt_tokens"] - stats["cached_tokens"]
    assert progress[0] == (0, n) and progress[-1] == (n, n) and progress == sorted(progress)
    # after the role's chunk, before any other
    data_at = [i for i, x in enumerate(lines) if x.startswith("data: ")]
    assert all(data_at[0] < i < data_at[1] for i, x in enumerate(lines) if x.startswith(": prefill "))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    chunks = list(server.client().chat.completions.create(model="fp8", stream=True, **body))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    # the space: that gauge alone, not the others its name begins
    assert server.metric("dsfp4_prefill_tokens_done") == server.metric("dsfp4_prefill_tokens ") == 0


def test_dsfp4_chat_reads_the_prefill_progress_its_server_streams(server):
    from dsfp4.cli.chat_client import RemoteChat

    chat = RemoteChat(server.base, KEY, {"max_tokens": 3, "temperature": 0})
    seen: list[tuple[int, int]] = []
    chat.progress = lambda done, total: seen.append((done, total))
    try:
        assert "".join(t for _, t in chat.reply(_chat("What does a prefill read from the SSD?")))
    finally:
        chat.close()
    n = chat.last.prompt_tokens - chat.last.cached_tokens
    assert seen[0] == (0, n) and seen[-1] == (n, n)


def test_keys_routes_and_binding(server):
    for key in (None, "wrong"):
        r = _post(server, "/v1/chat/completions", {"messages": _chat("hi")}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base + "/v1/models").status_code == 401
    r = httpx.get(server.base + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(server.base + "/v1/chat/completions").status_code == 405
    health = httpx.get(server.base + "/health").json()
    assert health["status"] == "ok" and health["queue"] == 0
    text = httpx.get(server.base + "/metrics").text
    assert "# TYPE dsfp4_requests_total counter" in text and 'dsfp4_expert_hit_rate{tier="gpu"}' in text
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the machine's outward address
        outward = s.getsockname()[0]
    if not outward.startswith("127."):
        with socket.socket() as s:  # the server listens on the loopback address only
            assert s.connect_ex((outward, int(server.base.rsplit(":", 1)[1]))) != 0


def _wait_for(done, hang: float = 120.0) -> None:
    """Poll until done() holds. `hang` only catches a hang: the tests assert what happened (a generation counted as
    cancelled, not finished by length), never how fast."""
    deadline = time.monotonic() + hang
    while not done():
        assert time.monotonic() < deadline, "still waiting after the hang guard"
        time.sleep(0.05)


def test_a_client_that_disconnects_mid_stream_frees_the_engine_at_once(server):
    cancelled = server.metric('dsfp4_generations_total{reason="cancelled"}')
    body = {"messages": _chat("tell me everything"), "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", server.base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        lines = r.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
        next(lines)
    _wait_for(lambda: server.metric('dsfp4_generations_total{reason="cancelled"}') > cancelled)
    assert httpx.get(server.base + "/health").json()["busy"] is False


def test_a_client_that_gives_up_on_a_whole_answer_frees_the_engine_too(server):
    cancelled = server.metric('dsfp4_generations_total{reason="cancelled"}')
    body = {"messages": _chat("tell me everything"), "max_tokens": 100, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.base + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=httpx.Timeout(0.3, connect=5),
        )
    _wait_for(lambda: server.metric('dsfp4_generations_total{reason="cancelled"}') > cancelled)


def test_serve_and_chat_flags_that_would_do_nothing_are_refused(converted, monkeypatch):
    for flags, needle in (
        (["--serve", "--raw"], "--raw only applies with --prompt"),
        (["--chat", "--stats"], "--stats only applies with --prompt"),
        (["--prompt", "hi", "--port", "9"], "--port only applies with --serve"),
        (["--prompt", "hi", "--raw", "--system", "x"], "which --raw skips"),
    ):
        r = run_cli("run", converted, "--device", "cpu", *flags)
        assert r.exit_code == 2 and needle in r.stderr, r.output
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "dsfp4.server.app", raising=False)
    r = run_cli("run", converted, "--device", "cpu", "--serve")
    assert r.exit_code == 1 and "--serve needs fastapi" in r.stderr and r.stderr.count("\n") == 1
    monkeypatch.undo()
    from dsfp4.cli import chat_client

    sent = []
    monkeypatch.setattr(
        chat_client.RemoteChat, "__init__", lambda self, url, key, sampling, model: sent.append(sampling)
    )
    monkeypatch.setattr(chat_client.RemoteChat, "close", lambda self: None)
    monkeypatch.setattr("dsfp4.cli.repl.chat_repl", lambda backend, system: None)
    monkeypatch.setattr(chat_client.RemoteChat, "model", "m", raising=False)
    monkeypatch.setattr(chat_client.RemoteChat, "base", "b", raising=False)
    assert run_cli("chat").exit_code == 0 and run_cli("chat", "--seed", 3, "--stop", "x").exit_code == 0
    assert sent == [{}, {"seed": 3, "stop": ["x"]}]  # what is not given stays the server's default


def test_concurrent_requests_decode_together_and_each_gets_its_own_answer(server):
    c, n = server.client(), 32  # tokens each: long enough to overlap on a loaded machine
    alone = {
        p: c.completions.create(model="fp8", prompt=p, max_tokens=n, temperature=0).choices[0].text for p in PROMPTS
    }
    got: dict[str, str] = {}
    occupancy: list[float] = []
    together = threading.Barrier(len(PROMPTS))

    def ask(p: str) -> None:
        together.wait()
        got[p] = c.completions.create(model="fp8", prompt=p, max_tokens=n, temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        occupancy.append(server.metric("dsfp4_batch_occupancy"))
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert got == alone
    assert max(occupancy) > 1 / BATCH, "the requests never decoded together"


def test_metrics_print_counts_exactly():
    from dsfp4.runtime.generate.stats import GenerationStats
    from dsfp4.server.jobs import Report
    from dsfp4.server.metrics import Metrics

    m = Metrics()
    m.finish("length", GenerationStats(prompt_tokens=3, generated_tokens=2))
    text = m.render(Report(True, 0, 1, 4, {"ssd_bytes": 123456789012.0}, 512, 2048))
    assert "dsfp4_ssd_read_bytes_total 123456789012\n" in text and 'dsfp4_generations_total{reason="length"} 1' in text
    assert "dsfp4_batch_occupancy 0.25\n" in text
    assert "dsfp4_prefill_tokens_done 512\n" in text and "dsfp4_prefill_tokens 2048\n" in text


def _soak_request(server: Server, i: int, expected: dict, rng: random.Random, out: Counter) -> bool:
    """One request; False when the queue was full (503), so the caller retries it."""
    prompt = PROMPTS[i % len(PROMPTS)]
    chat, stream, leave = rng.random() < 0.5, rng.random() < 0.5, i % 10 == 3  # 20 of 200 leave mid-stream
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 6, "temperature": 0, "stream": stream or leave}
    body.update({"messages": _chat(prompt)} if chat else {"prompt": prompt})
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
            c.chat.completions.create(model="fp8", messages=_chat(prompt), max_tokens=6, temperature=0)
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
    _wait_for(lambda: httpx.get(server.base + "/health").json() == idle)
    grown = server.rss() - rss_before
    assert grown < 8 << 20, f"the server's RSS grew by {grown >> 20} MiB over 200 requests"
    assert (
        server.metric('dsfp4_requests_total{endpoint="chat",status="503"}')
        + server.metric('dsfp4_requests_total{endpoint="completions",status="503"}')
        == out["503"]
    )


def test_dsfp4_chat_streams_from_the_server(server):
    from click.testing import CliRunner

    from dsfp4.cli.main import cli

    want = server.client().chat.completions.create(model="fp8", messages=_chat("hello"), max_tokens=6, temperature=0)
    flags = ["chat", "--url", server.base, "--api-key", KEY, "--temperature", "0", "--max-tokens", "6"]
    r = CliRunner().invoke(cli, flags, input="hello\n/stats\n/reset\n/quit\n")
    assert r.exit_code == 0, r.output
    assert want.choices[0].message.content in r.stdout and "decode" in r.stdout and "(conversation cleared)" in r.stdout
    assert "chatting with fp8" in r.stderr
    r = CliRunner().invoke(cli, [*flags[:3], "--api-key", "wrong"], input="/quit\n")
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "401" in r.stderr and "API key" in r.stderr
    r = CliRunner().invoke(cli, ["chat", "--url", f"http://127.0.0.1:{_free_port()}"], input="/quit\n")
    assert r.exit_code == 1 and "is a server running there?" in r.stderr and r.stderr.count("\n") == 1


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_the_http_process_ends_with_the_engines(converted):
    with _serve(converted) as s:  # SIGTERM to the engine's process: both end, cleanly
        (front,) = s.children()
        s.proc.terminate()
        assert s.proc.wait(timeout=30) == 0, s.proc.communicate()[1][-2000:]
        _wait_for(lambda: _gone(front))
    with _serve(converted) as s:  # Ctrl-C, as a shell reports it, once both have ended
        (front,) = s.children()
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=30) == 130 and "interrupted" in s.proc.communicate()[1]
        _wait_for(lambda: _gone(front))
    with _serve(converted) as s:  # the engine's process killed: the HTTP one sees the link close and stops
        (front,) = s.children()
        s.proc.kill()
        s.proc.wait(timeout=30)
        _wait_for(lambda: _gone(front))
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


@pytest.mark.parametrize("chat", [True, False])
def test_a_streamed_piece_is_the_chunk_it_stands_for(chat):
    """Answer.event writes a token's event around its text alone: byte for byte what encoding its whole chunk gives."""
    from dsfp4.server.answers import Answer, sse

    answer = Answer(chat, 'model "x"')
    for reasoning, text in [("", 'a "quote"\n\\ é \x00 </s>'), ("thinking", ""), ("both", "kinds"), ("", "")]:
        assert answer.event(reasoning, text) == sse(answer.chunk(reasoning, text))
