"""`dsfp4 chat --url URL`: the chat loop's backend on a server (dsfp4's, or another OpenAI-compatible one),
through streamed /v1/chat/completions. The server keeps no conversation: each turn sends the whole
history, and dsfp4's server reuses the cached prefix by itself. dsfp4's server also streams a long prefill's progress
as SSE comments (`: prefill DONE/TOTAL`), shown as `run --chat` shows its own (progress.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from dsfp4.cli.progress import PrefillProgress
from dsfp4.errors import DsfpError
from dsfp4.runtime.generate.stats import GenerationStats
from dsfp4.server.answers import PREFILL

# a server that does not accept within this is not there; reads wait as long as generation takes
CONNECT_S = 10.0


class RemoteError(DsfpError):
    """The server cannot be reached, or refused or failed a request."""


def _refusal(response: httpx.Response) -> RemoteError:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200] or response.reason_phrase
    return RemoteError(f"{response.request.url}: {response.status_code} {message}")


def _prefilled(line: str) -> tuple[int, int] | None:
    """(tokens done, of how many) from a `: prefill DONE/TOTAL` comment; None from any other line."""
    if not line.startswith(PREFILL):
        return None
    done, _, total = line.removeprefix(PREFILL).partition("/")
    return (int(done), int(total)) if done.isdigit() and total.isdigit() else None


class CallLines:
    """Streamed delta.tool_calls as lines to show, `name(arguments)`, each once it is whole: when the next call starts
    or the choice finishes."""

    def __init__(self) -> None:
        # index -> [name, arguments so far]
        self.open: dict[int, list[str]] = {}

    def feed(self, entries: list[dict], finish: str | None) -> list[str]:
        lines = []
        for e in entries:
            index, f = e.get("index", 0), e.get("function") or {}
            if index not in self.open:
                lines += self._flush()
                self.open[index] = [f.get("name") or "?", ""]
            self.open[index][1] += f.get("arguments") or ""
        return lines + (self._flush() if finish is not None else [])

    def _flush(self) -> list[str]:
        lines = [f"\n[tool call] {name}({arguments})" for name, arguments in self.open.values()]
        self.open.clear()
        return lines


class RemoteChat:
    def __init__(self, url: str, api_key: str | None, sampling: dict[str, Any], model: str | None = None):
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(None, connect=CONNECT_S))
        # sent as chat_template_kwargs, not sampling
        self.thinking: bool | None = sampling.pop("thinking", None)
        self.sampling = sampling
        self.last: GenerationStats | None = None
        # a prefill's progress as the server streams it, from (0, n) on (Decoder.progress's)
        self.progress: Callable[[int, int], None] | None = PrefillProgress(sys.stderr) if sys.stderr.isatty() else None
        card = self._served_card(model)
        self.model = card["id"]
        # dsfp4's servers say whether the model's format has a thinking switch; others are asked as vLLM is
        self.thinking_switch = bool(card.get("thinking_switch", True))

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            response = self.client.request(method, self.base + path, **kw)
        except httpx.HTTPError as e:
            raise RemoteError(f"{self.base}: {e} (is a server running there? `dsfp4 run MODEL --serve`)") from e
        if response.status_code != 200:
            raise _refusal(response)
        return response

    def _served_card(self, model: str | None) -> dict[str, Any]:
        """The served model's entry of /v1/models (`model`'s, or the first)."""
        data = self._request("GET", "/models").json().get("data") or []
        if not data:
            raise RemoteError(f"{self.base}/models lists no model")
        return next((c for c in data if c.get("id") == model), {"id": model} if model else data[0])

    def reply(self, messages: list[dict[str, str]]) -> Iterator[tuple[str, str]]:
        body = {"model": self.model, "messages": messages, "stream": True, **self.sampling}
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"thinking": self.thinking}
        # a server that sends no stats leaves none
        self.last = None
        # the last prefill progress shown
        seen = (0, 0)
        calls = CallLines()
        try:
            with self.client.stream("POST", self.base + "/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise _refusal(response)
                for line in response.iter_lines():
                    if (advance := _prefilled(line)) is not None and self.progress is not None:
                        seen = advance
                        self.progress(*advance)
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return
                    chunk = json.loads(line.removeprefix("data: "))
                    if "error" in chunk:
                        raise RemoteError(f"{self.base}: {chunk['error'].get('message')}")
                    for choice in chunk.get("choices", []):
                        delta = choice.get("delta") or {}
                        yield delta.get("reasoning_content") or "", delta.get("content") or ""
                        for line in calls.feed(delta.get("tool_calls") or (), choice.get("finish_reason")):
                            yield "", line
                    if "stats" in chunk:
                        self.last = GenerationStats.from_dict(chunk["stats"])
        except httpx.HTTPError as e:
            raise RemoteError(f"{self.base}: {e}") from e
        finally:
            # a prefill cut short (an error, Ctrl-C) leaves no line behind
            if self.progress is not None and seen[0] < seen[1]:
                self.progress(seen[1], seen[1])

    def reset(self) -> None:
        """Nothing to do on the server: it holds no conversation."""

    def close(self) -> None:
        self.client.close()
