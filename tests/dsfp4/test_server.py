"""`dsfp4 run --serve`: the real server in a subprocess on 127.0.0.1, driven by the official openai client
(chat and completions, streaming or not) and by raw HTTP for the errors, cancellation and a soak test."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import httpx
import pytest

from tests.fixtures.cli import run_cli
from tests.fixtures.server import BATCH, CONTEXT, KEY, PROMPTS, QUEUE, free_port, messages, post, serve, wait_for

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(converted):
    with serve(converted, "--api-key", KEY, "--max-queue", str(QUEUE), "--max-batch", str(BATCH)) as s:
        yield s


@pytest.mark.slow
def test_openai_client_chat_and_completions_streaming_and_not(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == ["fp8"]
    r = c.chat.completions.create(model="fp8", messages=messages("hello"), max_tokens=8, temperature=0)
    text, usage, stats = r.choices[0].message.content, r.usage, r.model_extra["stats"]
    assert r.choices[0].finish_reason == "length" and usage.completion_tokens == 8
    assert usage.total_tokens == usage.prompt_tokens + 8 and stats["prompt_tokens"] == usage.prompt_tokens
    for field in ("ttft_s", "prefill_tok_s", "decode_tok_s", "gpu_hit_rate", "ram_hit_rate", "ssd_bytes_per_token"):
        assert field in stats
    chunks = list(
        c.chat.completions.create(
            model="fp8",
            messages=messages("hello"),
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
    r = c.chat.completions.create(model="fp8", messages=messages("hello"), max_tokens=8, temperature=0, stop=[stop])
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
        served = c.chat.completions.create(model="fp8", messages=messages(prompt), max_tokens=8, temperature=0)
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
        ({"messages": messages("hi"), "frobnicate": 1}, 400, "unrecognized request argument supplied: frobnicate"),
        ({"messages": messages("hi"), "temperature": "hot"}, 400, "temperature: must be a number in [0, 2]"),
        ({"messages": messages("hi"), "max_tokens": "8"}, 400, "max_tokens: must be an integer"),
        ({"messages": messages("hi"), "stream": "yes"}, 400, "stream: must be true or false"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role: must be one of"),
        ({"messages": [{"role": "user"}]}, 400, "messages[0].content: is missing"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text only"),
        ({"messages": []}, 400, "messages: must be a non-empty list"),
        ({"messages": messages("hi"), "max_tokens": -3}, 400, "max_tokens: must be an integer from 1"),
        ({"messages": messages("hi"), "max_tokens": 10**6}, 400, "leave room for"),
        ({"messages": messages("hi " * 200)}, 400, "this server's context holds 128"),
        ({"messages": messages("hi " * 200)}, 400, "(start it with a larger --max-context, up to the model's 2048)"),
        ({"messages": messages("hi " * 2100)}, 400, "the model's positions end at 2048, whatever --max-context"),
        ({"messages": messages("hi"), "n": 17}, 400, "n: must be an integer from 1 to 16"),
        ({"messages": messages("hi"), "logit_bias": {"5": 1}}, 400, "logit_bias: dsfp4 serves only {}"),
        ({"messages": messages("hi"), "functions": []}, 400, "functions: not served: OpenAI's deprecated form"),
        ({"messages": messages("hi"), "top_logprobs": 2}, 400, 'top_logprobs: applies with "logprobs": true'),
        ({"prompt": "hi", "best_of": 2}, 400, "best_of: dsfp4 serves only 1"),
        ({"prompt": "hi", "suffix": "x"}, 400, "suffix: dsfp4 serves only"),
        ({"messages": messages("hi"), "tool_choice": "required"}, 400, "tool_choice: 'required' needs tools"),
        ({"messages": messages("hi"), "stop": [""]}, 400, "stop: must be a non-empty string"),
        ({"messages": messages("hi"), "model": "gpt-4"}, 404, "this server serves 'fp8'"),
        # an agent's history the prompt would not carry: refused, not dropped
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}]},
            400,
            "message 0: tool_calls[0] must be",
        ),
        ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, 400, "message 0: field 'name': a speaker"),
        ({"prompt": [1, 2, 10**9]}, 400, "outside the vocabulary"),
    ],
)
def test_bad_requests_get_openai_style_errors_and_the_server_goes_on(server, body, status, needle):
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    r = post(server, path, body, raw=body if isinstance(body, bytes) else None)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert post(server, "/v1/chat/completions", {"messages": messages("hi"), "max_tokens": 2}).status_code == 200


def _prefill_comments(lines: list[str]) -> list[tuple[int, int]]:
    return [tuple(map(int, x.removeprefix(": prefill ").split("/"))) for x in lines if x.startswith(": prefill ")]


def test_a_streamed_prefill_sends_its_progress_as_comments_that_the_openai_client_skips(server):
    body = {"messages": messages("Tell me about the tiers of the expert store"), "max_tokens": 4, "temperature": 0}
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
        assert "".join(t for _, t in chat.reply(messages("What does a prefill read from the SSD?")))
    finally:
        chat.close()
    n = chat.last.prompt_tokens - chat.last.cached_tokens
    assert seen[0] == (0, n) and seen[-1] == (n, n)


def test_keys_routes_and_binding(server):
    for key in (None, "wrong"):
        r = post(server, "/v1/chat/completions", {"messages": messages("hi")}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base + "/v1/models").status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    card = httpx.get(server.base + "/v1/models/fp8", headers=auth).json()
    assert card["id"] == "fp8" and card["object"] == "model" and server.client().models.retrieve("fp8").id == "fp8"
    r = httpx.get(server.base + "/v1/models/gpt-4", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
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


def test_a_client_that_disconnects_mid_stream_frees_the_engine_at_once(server):
    cancelled = server.metric('dsfp4_generations_total{reason="cancelled"}')
    body = {"messages": messages("tell me everything"), "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", server.base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        lines = r.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
        next(lines)
    wait_for(lambda: server.metric('dsfp4_generations_total{reason="cancelled"}') > cancelled)
    assert httpx.get(server.base + "/health").json()["busy"] is False


def test_a_client_that_gives_up_on_a_whole_answer_frees_the_engine_too(server):
    """A client that stops waiting cancels its generation. An answer can end before the client gives up (the tiny
    model decodes 100 tokens in about the client's patience): that try shows nothing and is made again."""
    body = {"messages": messages("tell me everything"), "max_tokens": 100, "temperature": 0}

    def ended() -> float:
        return server.metric("dsfp4_generations_total")

    for _ in range(5):
        cancelled, before = server.metric('dsfp4_generations_total{reason="cancelled"}'), ended()
        try:
            httpx.post(
                server.base + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=httpx.Timeout(0.3, connect=5),
            )
            continue  # answered whole within the client's patience
        except httpx.ReadTimeout:
            pass
        wait_for(lambda before=before: ended() > before)
        if server.metric('dsfp4_generations_total{reason="cancelled"}') > cancelled:
            return
    raise AssertionError("every answer ended before its client gave up")


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


@pytest.mark.slow
def test_metrics_time_each_token_of_a_generation(server):
    def counts() -> tuple[float, float]:
        return (
            server.metric("dsfp4_time_to_first_token_seconds_count"),
            server.metric("dsfp4_inter_token_latency_seconds_count"),
        )

    before = counts()
    chunks = list(
        server.client().chat.completions.create(
            model="fp8", messages=messages("hello"), max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"  # 8 tokens, none of them an EOS
    first, between = (after - was for after, was in zip(counts(), before, strict=True))
    assert (first, between) == (1, 7)


def test_dsfp4_chat_streams_from_the_server(server):
    from click.testing import CliRunner

    from dsfp4.cli.main import cli

    want = server.client().chat.completions.create(model="fp8", messages=messages("hello"), max_tokens=6, temperature=0)
    flags = ["chat", "--url", server.base, "--api-key", KEY, "--temperature", "0", "--max-tokens", "6"]
    r = CliRunner().invoke(cli, flags, input="hello\n/stats\n/reset\n/quit\n")
    assert r.exit_code == 0, r.output
    assert want.choices[0].message.content in r.stdout and "decode" in r.stdout and "(conversation cleared)" in r.stdout
    assert "chatting with fp8" in r.stderr
    r = CliRunner().invoke(cli, [*flags[:3], "--api-key", "wrong"], input="/quit\n")
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "401" in r.stderr and "API key" in r.stderr
    r = CliRunner().invoke(cli, ["chat", "--url", f"http://127.0.0.1:{free_port()}"], input="/quit\n")
    assert r.exit_code == 1 and "is a server running there?" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("chat", [True, False])
def test_a_streamed_piece_is_the_chunk_it_stands_for(chat):
    """Answer.event writes a token's event around its text alone: byte for byte what encoding its whole chunk gives."""
    from dsfp4.server.answers import Answer, sse

    answer = Answer(chat, 'model "x"')
    for reasoning, text in [("", 'a "quote"\n\\ é \x00 </s>'), ("thinking", ""), ("both", "kinds"), ("", "")]:
        assert answer.event(reasoning, text) == sse(answer.chunk(reasoning, text))
