"""Reading tool calls back from a model's answer (runtime/generate/answer/tool_calls.py, tool_scan.py), whole and
streamed, on the exact strings each release's model writes (V3-0324 / R1-0528's and V3.1's chat templates and model
card, V4-Flash's encoding_dsv4.py), malformed markup, and the grammars that force calls (tool_grammar.py, compiled
and run with llguidance on the synthetic tokenizers)."""

from __future__ import annotations

import json
import random

import pytest

from dsfp4.runtime.generate.answer.tool_calls import ToolCall, ToolCallStream, parse_tool_calls
from dsfp4.runtime.generate.answer.tool_format import TOOL_FORMATS, V3, V4, V31
from dsfp4.runtime.generate.answer.tool_scan import ToolCallError
from dsfp4.runtime.generate.answer.tools import ToolChoice, tool_choice_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
FREE = {"type": "function", "function": {"name": "free"}}
TOOLS = [WEATHER, FREE]
VOCAB = 640

# what each release's model writes for two calls (the templates' and the card's strings)
R1_OUTPUT = (
    "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>free\n```json\n'
    '{"x": [1, "<a>"]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
V31_OUTPUT = (
    'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
    '<｜tool▁call▁end｜><｜tool▁call▁begin｜>free<｜tool▁sep｜>{"x": [1, "<a>"]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
V4_OUTPUT = (
    'Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
    'string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '</｜DSML｜invoke>\n<｜DSML｜invoke name="free">\n<｜DSML｜parameter name="x" string="false">[1, "<a>"]'
    "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
CALLS = [("get_weather", '{"city": "Paris", "days": 3}'), ("free", '{"x": [1, "<a>"]}')]
OUTPUTS = {V3: R1_OUTPUT, V31: V31_OUTPUT, V4: V4_OUTPUT}


def _expected(prefix: str = "t") -> list[ToolCall]:
    return [ToolCall(f"call_{prefix}_{i}", n, a) for i, (n, a) in enumerate(CALLS)]


@pytest.mark.parametrize("name", [V3, V31, V4])
def test_each_releases_output_parses_to_content_and_calls(name):
    assert parse_tool_calls(OUTPUTS[name], TOOL_FORMATS[name], TOOLS, id_prefix="t") == ("Let me check.", _expected())


@pytest.mark.parametrize("name", [V3, V31, V4])
def test_rendered_calls_are_the_releases_strings_and_parse_back(name):
    fmt = TOOL_FORMATS[name]
    assert "Let me check." + fmt.calls(CALLS) == OUTPUTS[name]
    assert parse_tool_calls(fmt.calls(CALLS[:1]), fmt, id_prefix="t") == ("", _expected()[:1])


def test_the_v3_familys_entries_read_both_call_shapes():
    # a V3.1 checkpoint's output read as V3's and R1's read as V3.1's: one parser for the family
    assert parse_tool_calls(V31_OUTPUT, TOOL_FORMATS[V3], id_prefix="t")[1] == _expected()
    assert parse_tool_calls(R1_OUTPUT, TOOL_FORMATS[V31], id_prefix="t")[1] == _expected()
    # a V3.1 call of a function named "function": its arguments follow the separator at once
    text = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>'
    text += "<｜tool▁calls▁end｜>"
    assert parse_tool_calls(text, TOOL_FORMATS[V3], id_prefix="t")[1] == [ToolCall("call_t_0", "function", '{"a": 1}')]


def _streamed(fmt, text: str, sizes) -> tuple[str, list]:
    stream, content, deltas, at = ToolCallStream(fmt, TOOLS, id_prefix="t"), "", [], 0
    for n in sizes:
        piece = stream.feed(text[at : at + n])
        content, deltas, at = content + piece.content, deltas + list(piece.calls), at + n
        if at >= len(text):
            break
    return content + stream.finish().content, deltas


def _assembled(deltas) -> list[ToolCall]:
    """The calls as OpenAI's client assembles a stream's deltas (id and name from the first, arguments appended)."""
    calls: dict[int, list] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id is not None and d.name is not None  # the first delta of a call names it
            calls[d.index] = [d.id, d.name, ""]
        else:
            assert d.id is None and d.name is None
        calls[d.index][2] += d.arguments
    return [ToolCall(*calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("name", [V3, V31, V4])
def test_streaming_in_any_pieces_equals_the_whole(name):
    fmt, text = TOOL_FORMATS[name], OUTPUTS[name] + " Done."
    whole = parse_tool_calls(text, fmt, TOOLS, id_prefix="t")
    rng = random.Random(0)
    for sizes in ([1] * len(text), [rng.randint(1, 9) for _ in text], [len(text)]):
        content, deltas = _streamed(fmt, text, sizes)
        assert (content, _assembled(deltas)) == whole
    # the arguments arrive in fragments before their call closes, not only at its end
    _, deltas = _streamed(fmt, text, [1] * len(text))
    assert len([d for d in deltas if d.index == 0]) > 2


def test_text_that_may_start_a_block_waits_and_is_content_at_the_end():
    fmt = TOOL_FORMATS[V3]
    stream = ToolCallStream(fmt)
    assert stream.feed("Hi <｜tool▁calls").content == "Hi"  # the space may be the block's: it waits too
    assert stream.feed("!").content == " <｜tool▁calls!"
    assert stream.feed(" <｜tool▁ca").content == "" and stream.finish().content == " <｜tool▁ca"
    assert parse_tool_calls("plain <b>text</b>\n", fmt) == ("plain <b>text</b>\n", [])


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (V3, R1_OUTPUT.replace('"days": 3}', '"days": 3'), "arguments are not JSON"),
        (V31, V31_OUTPUT.replace('{"x": [1, "<a>"]}', "[1]"), "not a JSON object"),
        (V31, V31_OUTPUT.replace("free", "rm_rf"), "'rm_rf', which is not one of the request's tools"),
        (V4, V4_OUTPUT.replace('"free"', '"rm_rf"'), "'rm_rf', which is not one of the request's tools"),
        (V4, V4_OUTPUT.replace(">3<", ">three<"), "parameter 'days' is not JSON"),
        (V4, V4_OUTPUT.replace('name="days"', 'name="city"'), "parameter 'city' is given twice"),
        (V3, R1_OUTPUT.replace("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁begin｜>oops"), "expected <｜tool▁call▁begin"),
        (V3, R1_OUTPUT.replace("```json\n{", "{"), "expected ```json"),
        (V4, V4_OUTPUT.replace("\n</｜DSML｜invoke>\n<", "\nstray</｜DSML｜invoke>\n<"), "expected a parameter"),
        (V3, R1_OUTPUT.removesuffix("<｜tool▁calls▁end｜>"), "ends inside a block of tool calls"),
        (V4, V4_OUTPUT[:-40], "ends inside a block of tool calls"),
    ],
)
def test_malformed_calls_raise_a_clear_error_streamed_or_whole(name, text, message):
    fmt = TOOL_FORMATS[name]
    with pytest.raises(ToolCallError, match=message):
        parse_tool_calls(text, fmt, TOOLS)
    stream = ToolCallStream(fmt, TOOLS)
    with pytest.raises(ToolCallError, match=message):
        for ch in text:
            stream.feed(ch)
        stream.finish()
    with pytest.raises(ToolCallError, match=message):  # a broken stream stays broken
        stream.feed("more")


def test_calls_in_two_blocks_are_numbered_on():
    fmt = TOOL_FORMATS[V31]
    text = fmt.calls(CALLS[:1]) + " and " + fmt.calls(CALLS[1:])
    assert parse_tool_calls(text, fmt, id_prefix="t") == (" and", _expected())


@pytest.fixture(scope="module")
def matchers(tmp_path_factory):
    """For a family's synthetic tokenizer: (a grammar's text -> llguidance matchers, one for each way of reading
    the tokenizer: the engine's (grammar_tokenizer.py: added tokens as text) and llguidance's own (added tokens as
    special); text -> token ids; the marker ids)."""
    pytest.importorskip("llguidance")
    import llguidance
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    from dsfp4.runtime.generate.answer.grammar_tokenizer import llguidance_tokenizer
    from dsfp4.runtime.generate.tokenizer import ChatTokenizer
    from dsfp4.synthetic.hf_v3 import write_tokenizer

    out = {}
    for family in ("deepseek_v3", "deepseek_v4"):
        d = tmp_path_factory.mktemp(family)
        write_tokenizer(d, VOCAB, family)
        (d / "config.json").write_text(json.dumps({"model_type": family}))
        tok = ChatTokenizer(d)
        readings = (
            llguidance_tokenizer(llguidance, d / "tokenizer.json", VOCAB, tuple(tok.eos_ids)),
            llguidance.hf.from_tokenizer(PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))),
        )

        def matchers_of(grammar, readings=readings):
            made = [llguidance.LLMatcher(lt, llguidance.grammar_from("lark", grammar)) for lt in readings]
            assert not any(m.is_error() for m in made), [m.get_error() for m in made]
            return made

        out[family] = (matchers_of, lambda text, tok=tok: tok.encode(text, special=False), tok.marker_ids())
    return out


def _accepts(matchers, ids) -> bool:
    """Whether every reading's matcher takes the tokens to the grammar's end (all agree)."""
    results = {all(m.consume_token(t) for t in ids) and m.is_accepting() for m in matchers}
    assert len(results) == 1
    return results.pop()


@pytest.mark.parametrize("name", [V3, V31, V4])
@pytest.mark.parametrize("reasoning", [False, True])
def test_tool_choice_grammars_accept_the_formats_calls_and_refuse_others(matchers, name, reasoning):
    fmt = TOOL_FORMATS[name]
    matcher, encode, ids = matchers["deepseek_v4" if name == V4 else "deepseek_v3"]
    head = "Thinking it over.</think>" if reasoning else ""
    required = tool_choice_grammar(fmt, TOOLS, ToolChoice("required"), ids, reasoning=reasoning)
    assert _accepts(matcher(required), encode(head + fmt.calls(CALLS)))
    named = tool_choice_grammar(fmt, TOOLS, ToolChoice("function", "get_weather"), ids, reasoning=reasoning)
    assert _accepts(matcher(named), encode(head + fmt.calls(CALLS[:1])))
    assert not _accepts(matcher(named), encode(head + fmt.calls(CALLS)))  # one call, of that function only
    single = tool_choice_grammar(fmt, TOOLS, ToolChoice("required"), ids, parallel=False, reasoning=reasoning)
    assert not _accepts(matcher(single), encode(head + fmt.calls(CALLS)))
    bad_args = [("get_weather", '{"days": 3}')]  # city is required
    assert not _accepts(matcher(named), encode(head + fmt.calls(bad_args)))
    assert tool_choice_grammar(fmt, TOOLS, ToolChoice("auto"), ids) is None
