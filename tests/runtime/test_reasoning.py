"""R1-style thinking: the streaming splitter against the whole-text split at every way of cutting the text,
and the wiring: the server's reasoning_content (in-process) and the chat loop's /think, on an R1 template."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest

from dsfp4.runtime.generate.reasoning import ReasoningSplitter, opens_thinking, split_reasoning

CASES = [  # (text, prompt opened <think>, reasoning, answer)
    ("step one\n</think>\n\nthe answer", True, "step one\n", "the answer"),
    ("\nstep</think>answer", True, "step", "answer"),
    ("<think>\nx\n</think>\n\nb", False, "x\n", "b"),
    ("  <think>x</think>", False, "x", ""),
    ("no tags here", False, "", "no tags here"),
    ("  leading space kept", False, "", "  leading space kept"),
    ("<thin", False, "", "<thin"),
    ("still thinking </thi", True, "still thinking </thi", ""),
    ("a < b </think> c </think> d", True, "a < b ", "c </think> d"),
    ("", True, "", ""),
    ("", False, "", ""),
]


@pytest.mark.parametrize("text,thinking,reasoning,answer", CASES)
def test_every_cut_of_the_stream_gives_the_whole_split(text, thinking, reasoning, answer):
    assert split_reasoning(text, thinking) == (reasoning, answer)
    cuts = range(len(text) + 1)
    for a, b in itertools.combinations_with_replacement(cuts, 2):  # three pieces, empty ones included
        splitter = ReasoningSplitter(thinking)
        parts = [splitter.feed(p) for p in (text[:a], text[a:b], text[b:])] + [splitter.flush()]
        assert ("".join(r for r, _ in parts), "".join(t for _, t in parts)) == (reasoning, answer), (a, b)


def test_a_prompt_opens_thinking_when_it_ends_in_the_tag():
    assert opens_thinking("<｜Assistant｜><think>\n") and not opens_thinking("<｜Assistant｜>")


@pytest.fixture(scope="module")
def r1_model(converted, tmp_path_factory):
    """The tiny model with an R1-style template: the prompt ends inside a <think> block."""
    model = tmp_path_factory.mktemp("r1") / "r1"
    shutil.copytree(converted, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
        "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'].split('</think>')[-1] }}"
        "<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    return model


def test_an_r1_template_drops_earlier_thinking_and_opens_a_block(r1_model):
    from dsfp4.runtime.generate.tokenizer import ChatTokenizer

    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nx\n</think>\n\nb"},
        {"role": "user", "content": "c"},
    ]
    text = ChatTokenizer(r1_model).render_chat(chat)
    assert text.endswith("<｜Assistant｜>\n\nb<｜end▁of▁sentence｜><｜User｜>c<｜Assistant｜><think>\n")
    assert opens_thinking(text)


def test_the_server_returns_thinking_as_reasoning_content(r1_model):
    from fastapi.testclient import TestClient

    from dsfp4 import Engine
    from dsfp4.server.app import Served, create_app

    with Engine(r1_model, device="cpu", max_context=64) as engine:
        messages = [{"role": "user", "content": "Why is the sky blue?"}]
        want = engine.generate(messages, max_tokens=6, temperature=0).text
        with TestClient(create_app(engine, Served("r1"))) as client:
            body = {"messages": messages, "max_tokens": 6, "temperature": 0}
            message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert (message["reasoning_content"], message["content"]) == split_reasoning(want, True)
            assert message["reasoning_content"]  # the random model never closes the block
            lines = client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
            chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            deltas = [c["choices"][0]["delta"] for c in chunks]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
            assert "".join(d.get("content", "") for d in deltas) == message["content"]


def test_the_chat_loop_shows_or_hides_thinking(r1_model):
    from dsfp4 import Engine
    from dsfp4.cli.repl import LocalChat, chat_repl

    ask = "Why is the sky blue?"
    lines, out = iter([ask, "/think", ask, "/stats", "/quit"]), []
    with Engine(r1_model, device="cpu", max_context=64, max_tokens=4, temperature=0) as engine:
        chat_repl(LocalChat(engine), read=lambda _: next(lines), write=out.append)
    text = "".join(out)
    first, second = text.split("(this model has no thinking switch; its thinking hidden)")  # R1 always thinks
    assert "<think>\n" in first and "(thinking; /think shows it)" in second and "<think>" not in second
    assert "decode" in second  # /stats after the second answer


def test_think_switches_thinking_on_and_off_where_the_format_has_a_switch(v4_converted):
    """DeepSeek-V4's prompt format has a thinking mode: /think turns it on (the prompt ends in <think>, so the answer
    starts inside a thinking block) and off again, not only the display."""
    from dsfp4 import Engine
    from dsfp4.cli.repl import LocalChat, chat_repl

    prompts = []
    ask = "Why is the sky blue?"
    lines, out = iter([ask, "/think", ask, "/think", ask, "/quit"]), []
    with Engine(v4_converted, device="cpu", max_context=256, max_tokens=3, temperature=0) as engine:
        backend = LocalChat(engine)
        encode = engine.encode
        chats = lambda a: isinstance(a[0], list) and isinstance(a[0][0], dict)  # noqa: E731  (not the token ids)
        engine.encode = lambda *a, **k: (chats(a) and prompts.append(k.get("thinking"))) or encode(*a, **k)
        chat_repl(backend, read=lambda _: next(lines), write=out.append)
        tails = [
            engine.tokenizer.decode(encode(m, thinking=t)[-1:], keep_special=True)
            for m, t in (([{"role": "user", "content": ask}], None), ([{"role": "user", "content": ask}], True))
        ]
    text = "".join(out)
    assert prompts == [None, True, False] and "(thinking on: the model thinks before it answers)" in text
    assert "(thinking off)" in text and tails == ["</think>", "<think>"]
    second = text.split("(thinking on")[1].split("(thinking off)")[0]
    assert "<think>" in second  # the answer after the switch starts inside the thinking block


def test_the_server_takes_the_thinking_switch_in_chat_template_kwargs(v4_converted, converted):
    from fastapi.testclient import TestClient

    from dsfp4 import Engine
    from dsfp4.server.app import Served, create_app

    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0}
    with Engine(v4_converted, device="cpu", max_context=256) as engine:
        on = engine.generate(messages, max_tokens=3, temperature=0, thinking=True)
        with TestClient(create_app(engine, Served("v4"))) as client:
            assert client.get("/v1/models").json()["data"][0]["thinking_switch"] is True
            for kwargs in ({"thinking": True}, {"enable_thinking": True}):
                r = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": kwargs}).json()
                assert r["usage"]["prompt_tokens"] == len(on.prompt_ids)
                assert r["choices"][0]["message"]["reasoning_content"] == split_reasoning(on.text, True)[0]
            off = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"thinking": False}})
            assert off.json()["usage"]["prompt_tokens"] == len(on.prompt_ids)  # </think> for <think>
            assert off.json()["choices"][0]["message"].get("reasoning_content") in (None, "")
            for bad in ({"thinking": "yes"}, {"tools": []}, {"thinking": True, "enable_thinking": False}):
                r = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    with Engine(converted, device="cpu", max_context=64) as engine, TestClient(create_app(engine, Served("v3"))) as c:
        assert c.get("/v1/models").json()["data"][0]["thinking_switch"] is False
        r = c.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"thinking": True}})
        assert r.status_code == 400 and "no thinking switch" in r.json()["error"]["message"]
