"""A request's answer format through the Python API (runtime/generate/answer/answer_format.py): tools rendered unless
tool_choice is none, required and named choices forced by a grammar into calls that parse and fit their schema,
response_format beside tools (JSON or calls), after R1's thinking, and the fields checked by name."""

from __future__ import annotations

import json

import pytest
import torch

from dsfp4 import Engine
from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.answer.answer_format import AnswerFormat
from dsfp4.runtime.generate.answer.grammar_compiler import GrammarCompiler
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from tests.fixtures.tools import TOOLS

SAMPLED = {"temperature": 1.0, "top_p": 1.0}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
SCHEMA["additionalProperties"] = False
ROOM = 300


@pytest.fixture(scope="module")
def engine(converted):
    with Engine(converted, device="cpu", max_context=1024) as engine:
        yield engine


def _fits_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "Oslo") and set(args) <= {"city", "days"}, args
    assert 1 <= args.get("days", 1) <= 9


def test_tools_reach_the_prompt_unless_tool_choice_is_none(engine):
    plain = engine.encode("Weather in Paris?")
    with_tools = engine.encode("Weather in Paris?", tools=TOOLS)
    assert len(with_tools) > len(plain) and "get_weather" in engine.tokenizer.decode(with_tools)
    g = engine.generate("Weather in Paris?", tools=TOOLS, tool_choice="none", max_tokens=2, temperature=0)
    assert g.stats.prompt_tokens == len(plain) and g.tool_calls is None


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_choice_gives_calls_that_parse_and_fit(engine, choice):
    for seed in range(3):
        g = engine.generate("Weather?", tools=TOOLS, tool_choice=choice, max_tokens=ROOM, seed=seed, **SAMPLED)
        assert g.finish_reason == "stop" and g.tool_calls, g.text
        for call in g.tool_calls:
            assert call.name in ("get_weather", "get_time")
            if call.name == "get_weather":
                _fits_weather(call.arguments)
            else:
                assert json.loads(call.arguments) == {}
        if isinstance(choice, dict):
            assert [c.name for c in g.tool_calls] == ["get_weather"]
    assert "tool_calls" in g.to_dict()


def test_response_format_beside_auto_tools_gives_json_or_calls(engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    for seed in range(3):
        g = engine.generate("Weather?", tools=TOOLS, response_format=fmt, max_tokens=ROOM, seed=seed, **SAMPLED)
        assert g.finish_reason == "stop", g.text
        if not g.tool_calls:
            assert json.loads(g.text) in ({"ok": True}, {"ok": False})
    g = engine.generate("hi", response_format={"type": "json_object"}, max_tokens=ROOM, seed=1, **SAMPLED)
    assert isinstance(json.loads(g.text), dict) and g.tool_calls is None


def test_grammars_after_r1_thinking_leave_the_reasoning_free(converted):
    """Where the prompt opens <think>, the answer's grammar starts after </think>: thinking, then the JSON."""
    tok = ChatTokenizer(converted)
    fmt = AnswerFormat.of(tok, response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    compiler = GrammarCompiler(converted / "tokenizer.json", tok.tok.get_vocab_size(True), tok.eos_ids)
    for grammar, text, ok in [
        (fmt.grammar(tok, reasoning=True), 'let me see</think>\n\n{"ok":true}', True),
        (fmt.grammar(tok, reasoning=True), '{"ok":true}', False),
        (fmt.grammar(tok, reasoning=False), '{"ok":true}', True),
    ]:
        matcher = compiler.matcher(grammar)
        taken = True
        for token in tok.encode(text, special=False):
            if not matcher.allowed(torch.device("cpu"))[token]:
                taken = False
                break
            matcher.accept(token)
        assert (taken and matcher.accepting) == ok, (text, grammar.source)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice: names"),
        ({"tool_choice": "required"}, "tool_choice: 'required' needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format:"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls: must be true or false"),
        ({"response_format": {"type": "xml"}}, "response_format.type 'xml'"),
    ],
)
def test_answer_fields_are_checked_by_name(engine, fields, needle):
    with pytest.raises(ConfigError, match=needle):
        AnswerFormat.of(engine.tokenizer, **fields)


def test_a_schema_that_does_not_compile_and_a_grammar_beside_response_format_are_refused(engine):
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}
    with pytest.raises(ConfigError, match="response_format.json_schema.schema: the JSON schema does not compile"):
        engine.stream("hi", response_format=bad)
    from dsfp4.runtime.generate.answer.grammar import Grammar

    with pytest.raises(ConfigError, match="grammar: response_format gives the answer's grammar already"):
        engine.stream("hi", response_format={"type": "json_object"}, grammar=Grammar.json_object())
