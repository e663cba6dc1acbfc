"""`dsfp4 chat --url` (dsfp4/cli/chat_client.py) against a stand-in server: the prefill's progress comments reach the
display the local chat shows, other comments and a server that sends none change nothing, and a stream cut short
during its prefill leaves no progress line behind."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from dsfp4.cli import chat_client
from dsfp4.cli.chat_client import RemoteChat, RemoteError
from dsfp4.cli.progress import PrefillProgress

CHUNK = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}


def _chat(monkeypatch, stream: str) -> RemoteChat:
    """A RemoteChat whose server answers /v1/models and streams `stream` for every chat completion."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, text=stream, headers={"content-type": "text/event-stream"})

    real = httpx.Client
    monkeypatch.setattr(chat_client.httpx, "Client", lambda **kw: real(transport=httpx.MockTransport(answer), **kw))
    return RemoteChat("http://server", None, {})


def _events(*lines: str) -> str:
    return "".join(f"{line}\n\n" for line in lines)


def test_the_servers_prefill_comments_reach_the_progress_display(monkeypatch):
    stream = _events(
        ": prefill 0/2048",
        ": keep-alive",
        ": prefill 1024/2048",
        ": prefill 2048/2048",
        "data: " + json.dumps(CHUNK),
        "data: [DONE]",
    )
    chat = _chat(monkeypatch, stream)
    seen = []
    chat.progress = lambda done, total: seen.append((done, total))
    assert list(chat.reply([{"role": "user", "content": "x"}])) == [("", "hi")]
    assert seen == [(0, 2048), (1024, 2048), (2048, 2048)]
    # the display run --chat shows, on a clock 2 s further on at each report
    out, ticks = io.StringIO(), iter(range(0, 100, 2))
    chat.progress = PrefillProgress(out, clock=lambda: next(ticks))
    list(chat.reply([{"role": "user", "content": "x"}]))
    line = "prefill 1,024/2,048 tokens, 2 s left"
    assert out.getvalue() == f"\r{line}\r{' ' * len(line)}\r"


def test_a_stream_without_comments_shows_no_progress(monkeypatch):
    chat = _chat(monkeypatch, _events("data: " + json.dumps(CHUNK), "data: [DONE]"))
    seen = []
    chat.progress = lambda done, total: seen.append((done, total))
    assert list(chat.reply([{"role": "user", "content": "x"}])) == [("", "hi")] and seen == []


def test_a_stream_cut_short_in_its_prefill_clears_the_display(monkeypatch):
    error = {"error": {"message": "generation failed: boom"}}
    chat = _chat(monkeypatch, _events(": prefill 0/2048", ": prefill 512/2048", "data: " + json.dumps(error)))
    seen = []
    chat.progress = lambda done, total: seen.append((done, total))
    with pytest.raises(RemoteError, match="boom"):
        list(chat.reply([{"role": "user", "content": "x"}]))
    assert seen == [(0, 2048), (512, 2048), (2048, 2048)]


def test_streamed_tool_calls_show_as_name_and_arguments_lines(monkeypatch):
    def delta(calls: list[dict], finish: str | None = None) -> str:
        return "data: " + json.dumps(
            {"choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": finish}]}
        )

    head = {"index": 0, "id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    stream = _events(
        "data: " + json.dumps(CHUNK),
        delta([head, {"index": 0, "function": {"arguments": '{"city":'}}]),
        delta([{"index": 0, "function": {"arguments": '"Oslo"}'}}]),
        delta([{**head, "index": 1, "id": "c1", "function": {"name": "get_time", "arguments": "{}"}}]),
        delta([], "tool_calls"),
        "data: [DONE]",
    )
    chat = _chat(monkeypatch, stream)
    text = "".join(t for _, t in chat.reply([{"role": "user", "content": "x"}]))
    assert text == 'hi\n[tool call] get_weather({"city":"Oslo"})\n[tool call] get_time({})'
