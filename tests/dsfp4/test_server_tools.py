"""The agent's side of the OpenAI request on the real server (`dsfp4 run --serve`, the tiny random model, two
sequences batched), driven by the official openai client: tools in the prompt, an agent's history reaching it whole,
tool_choice required and named forcing calls that parse and fit their schemas (streamed and not), a short agent loop,
json_schema answers that fit every time (concurrently too), log-probabilities, n choices, completions' echo; and the
bad input: a schema that does not compile, an unknown function, tools on a model without a tool format, a call cut
short (an error, never a stream that looks complete)."""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import pytest

from dsfp4.runtime.generate.prompt import PromptRules, PromptSpec
from tests.fixtures.server import KEY, post, serve
from tests.fixtures.tools import TOOLS

openai = pytest.importorskip("openai")

# room for the tools' description: the tiny tokenizer spells most text a character a token
CONTEXT = 1024
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SAMPLED = {"temperature": 1.0, "top_p": 1.0}
ROOM = 300


@pytest.fixture(scope="module")
def server(converted):
    with serve(converted, "--api-key", KEY, "--max-batch", "2", context=CONTEXT) as s:
        yield s


@pytest.fixture(scope="module")
def rules(converted) -> PromptRules:
    """The server's prompts, rebuilt here: what a request's usage.prompt_tokens must count."""
    return PromptRules(PromptSpec(str(converted), (1,), CONTEXT, 2048, 640, None))


def _fits_weather(arguments: str) -> dict:
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "Oslo") and set(args) <= {"city", "days"} and 1 <= args.get("days", 1) <= 9
    return args


def _fits(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 99, obj


def _calls(chunks) -> tuple[list[dict], str | None]:
    """Streamed tool calls assembled as the openai client's users do: by index, arguments concatenated."""
    calls: dict[int, dict] = {}
    finish = None
    for ch in chunks:
        for c in ch.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] = d.function.name or call["name"]
                    call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_tools_and_an_agents_history_reach_the_prompt_whole(server, rules):
    c = server.client()
    plain = c.chat.completions.create(model="fp8", messages=ASK, max_tokens=1, temperature=0)
    told = c.chat.completions.create(model="fp8", messages=ASK, tools=TOOLS, max_tokens=1, temperature=0)
    assert told.usage.prompt_tokens == len(rules.encode(ASK, tools=TOOLS)) > plain.usage.prompt_tokens
    assert "get_weather" in rules.tokenizer.decode(rules.encode(ASK, tools=TOOLS))
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny, 21 C"})
    r = c.chat.completions.create(model="fp8", messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    prompt = rules.encode(history, tools=TOOLS)
    text = rules.tokenizer.decode(prompt)
    assert r.usage.prompt_tokens == len(prompt) and '{"city": "Oslo"}' in text and "sunny, 21 C" in text
    # tool_choice none: the tools are not described (the history still is)
    r = c.chat.completions.create(model="fp8", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_tool_choice_round_trips_streamed_and_not(server, choice):
    c = server.client()
    for seed in (1, 2):
        body = {"model": "fp8", "messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": ROOM}
        r = c.chat.completions.create(**body, seed=seed, **SAMPLED)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls, message
        for call in message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            if call.function.name == "get_weather":
                _fits_weather(call.function.arguments)
            else:
                assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}
        if choice == NAMED:
            assert [t.function.name for t in message.tool_calls] == ["get_weather"]
        streamed, finish = _calls(c.chat.completions.create(**body, seed=seed, stream=True, **SAMPLED))
        assert finish == "tool_calls"
        assert [(s["name"], s["arguments"]) for s in streamed] == [
            (t.function.name, t.function.arguments) for t in message.tool_calls
        ]
        assert len({s["id"] for s in streamed}) == len(streamed)
    one = c.chat.completions.create(**body, seed=3, parallel_tool_calls=False, **SAMPLED)
    assert len(one.choices[0].message.tool_calls) == 1


def test_a_short_agent_loop_ends_in_an_answer(server):
    c = server.client()
    messages = list(ASK)
    r = c.chat.completions.create(
        model="fp8", messages=messages, tools=TOOLS, tool_choice=NAMED, max_tokens=ROOM, seed=4, **SAMPLED
    )
    (call,) = r.choices[0].message.tool_calls
    args = _fits_weather(call.function.arguments)
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{args['city']}: sunny"})
    final = c.chat.completions.create(model="fp8", messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.tool_calls is None
    assert final.usage.prompt_tokens > r.usage.prompt_tokens


def test_json_schema_answers_fit_every_time_alone_and_batched(server):
    c = server.client()
    ask = {"model": "fp8", "messages": ASK, "response_format": JSON_SCHEMA, "max_tokens": 60, **SAMPLED}
    for seed in range(3):
        r = c.chat.completions.create(**ask, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        _fits(r.choices[0].message.content)
    got: list[str] = []
    together = threading.Barrier(2)

    def one(seed: int) -> None:
        together.wait()
        chunks = c.chat.completions.create(**ask, seed=seed, stream=True)
        got.append("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))

    threads = [threading.Thread(target=one, args=(s,)) for s in (10, 11)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2
    for text in got:
        _fits(text)
    # any object: its strings may run past max_tokens, but it opens as one
    r = c.chat.completions.create(model="fp8", messages=ASK, response_format={"type": "json_object"}, max_tokens=8)
    assert r.choices[0].message.content.startswith("{")


def test_logprobs_n_and_echo(server):
    c = server.client()
    r = c.chat.completions.create(model="fp8", messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.logprob for e in content)  # greedy: the token is the likeliest
    chunks = c.chat.completions.create(
        model="fp8", messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    two = c.chat.completions.create(model="fp8", messages=ASK, max_tokens=6, n=2, seed=5, **SAMPLED)
    assert [ch.index for ch in two.choices] == [0, 1] and two.choices[0].message.content != two.choices[
        1
    ].message.content
    assert two.usage.prompt_tokens == r.usage.prompt_tokens and two.usage.completion_tokens == 12
    chunks = list(
        c.chat.completions.create(model="fp8", messages=ASK, max_tokens=6, n=2, seed=5, stream=True, **SAMPLED)
    )
    for i in (0, 1):
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
        assert text == two.choices[i].message.content
    done = c.completions.create(model="fp8", prompt="hello", max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = done.choices[0].logprobs
    assert done.choices[0].text.startswith("hello") and lp.token_logprobs[0] is None
    assert len(lp.tokens) == done.usage.prompt_tokens + 3 and all(len(t) <= 2 for t in lp.top_logprobs[1:])
    streamed = list(
        c.completions.create(model="fp8", prompt="hello", max_tokens=3, temperature=0, echo=True, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in streamed) == done.choices[0].text
    r = c.chat.completions.create(
        model="fp8",
        messages=ASK,
        max_tokens=6,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        extra_body={"min_p": 0.1, "repetition_penalty": 1.2},
    )
    assert r.choices[0].finish_reason in ("stop", "length")


def test_bad_answer_formats_are_400s_naming_the_field_before_anything_streams(server):
    bogus = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "x"}}}}}
    unknown = {"type": "function", "function": {"name": "nope"}}
    for body, param in [
        ({"response_format": bogus}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": TOOLS, "tool_choice": unknown}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": JSON_SCHEMA}, "response_format"),
    ]:
        for stream in (False, True):
            r = post(server, "/v1/chat/completions", {"messages": ASK, "stream": stream, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert not r.text.startswith("data:")


def test_a_call_cut_short_is_an_error_never_a_complete_looking_answer(server):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 30, "temperature": 0}
    r = post(server, "/v1/chat/completions", body)
    error = r.json()["error"]
    assert r.status_code == 500 and error["code"] == "invalid_tool_call" and "max_tokens" in error["message"]
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", server.base + "/v1/chat/completions", json={**body, "stream": True}, headers=headers
    ) as s:
        lines = [x for x in s.iter_lines() if x.startswith("data: ")]
    assert "invalid_tool_call" in lines[-1] and "[DONE]" not in lines[-1]
    assert not any('"finish_reason": "' in x for x in lines)
    assert post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2}).status_code == 200


def test_tools_on_a_model_without_a_tool_format_are_a_400_naming_tools(converted, tmp_path):
    """The tiny model with its template's tool markup taken out: its format has no tool calls."""
    from fastapi.testclient import TestClient

    from dsfp4.server.app import Served, build_app
    from dsfp4.server.metrics import Metrics

    model = tmp_path / "plain"
    shutil.copytree(converted, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}<｜User｜>{{ m['content'] }}{% endfor %}<｜Assistant｜>"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    rules = PromptRules(PromptSpec(str(model), (1,), CONTEXT, 2048, 640, None))
    assert rules.tokenizer.tool_format is None

    class Idle:  # nothing may reach a scheduler: the request is refused as it is checked
        def sink(self, loop):
            return None

        def submit(self, job):
            raise AssertionError("a refused request was queued")

        def stop(self):
            pass

    with TestClient(build_app(rules, Idle(), Served("plain"), Metrics())) as client:
        r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
        r = client.post("/v1/chat/completions", json={"messages": history})
        assert r.status_code == 400 and "no tool calls" in r.json()["error"]["message"]
