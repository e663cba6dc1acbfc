"""Prompts with tools (runtime/generate/prompt.py, chat_messages.py, tools.py, tokenizer.py, prompt_v4.py): the
synthetic checkpoints' tool tokens and template (V3-0324 / R1's strings), a release-shaped template without a tools
variable (V3.1's: the model card's description after the system prompt), V4's prompts against its release encoder's
output (kept as facts), and every field a format cannot carry refused by name."""

from __future__ import annotations

import json

import pytest

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.answer import tool_markup as mk
from dsfp4.runtime.generate.answer.tool_format import V3, V4, V31
from dsfp4.runtime.generate.answer.tools import ToolChoice, check_tool_choice, check_tools
from dsfp4.runtime.generate.prompt import encode_prompt
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.synthetic.hf_v3 import THINK_TOKENS, TOOL_TOKENS, write_tokenizer

VOCAB = 640
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CALLS = [
    {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
    {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
]
# an agent's turn: two calls, their results sent back in the other order (the prompt puts them in call order)
HISTORY = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "b", "content": "rain"},
    {"role": "tool", "tool_call_id": "a", "name": "get_weather", "content": "sunny"},
]


def _tokenizer(path, family: str, template: str | None = None) -> ChatTokenizer:
    write_tokenizer(path, VOCAB, family)
    (path / "config.json").write_text(json.dumps({"model_type": family}))
    if template is not None:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return ChatTokenizer(path)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v4"])
def test_the_synthetic_tokenizers_tool_markers_are_single_tokens_after_the_old_ones(tmp_path, family):
    tok = _tokenizer(tmp_path, family)
    ids = [tok.encode(t, special=False) for t in TOOL_TOKENS[family]]
    assert all(len(i) == 1 for i in ids) and tok.marker_ids().keys() >= set(TOOL_TOKENS[family])
    think = max(tok.tok.token_to_id(t) for t in THINK_TOKENS)
    assert think < min(i[0] for i in ids) and max(i[0] for i in ids) < VOCAB  # appended, inside the vocabulary
    assert tok.decode([i[0] for i in ids]) == "".join(TOOL_TOKENS[family])  # plain decoding keeps them
    assert tok.tool_format.name == (V3 if family == "deepseek_v3" else V4)


def test_the_synthetic_template_writes_v3_r1s_strings(tmp_path):
    tok = _tokenizer(tmp_path, "deepseek_v3")
    assert tok.tool_format.name == V3 and tok.template_tools
    text = tok.decode(encode_prompt(tok, HISTORY, tools=[WEATHER]), keep_special=True)
    assert text == (
        "<｜begin▁of▁sentence｜>S\n\n" + mk.describe_v3([WEATHER]) + "<｜User｜>Weather?<｜Assistant｜>"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
        '```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>rain<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )
    # the answer after the results, then the next question: the outputs block is closed once
    more = [*HISTORY, {"role": "assistant", "content": "Sunny, then rain."}, {"role": "user", "content": "Thanks"}]
    tail = tok.render_chat(encode_chat_messages(tok, more)).split("rain<｜tool▁output▁end｜>")[1]
    assert tail == "<｜tool▁outputs▁end｜>Sunny, then rain.<｜end▁of▁sentence｜><｜User｜>Thanks<｜Assistant｜>"


def test_the_synthetic_template_renders_as_transformers_does(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok = _tokenizer(tmp_path, "deepseek_v3")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), **cfg)
    chat = [*HISTORY[:3], HISTORY[4], HISTORY[3]]  # in call order: transformers does not sort
    want = ref.apply_chat_template(chat, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert tok.render_chat(encode_chat_messages(tok, chat), tools=[WEATHER]) == want


def encode_chat_messages(tok: ChatTokenizer, chat: list[dict]) -> list[dict]:
    from dsfp4.runtime.generate.chat_messages import chat_messages

    return chat_messages(chat, tok.tool_format is not None, tok.keeps_reasoning)


# a template in V3.1's release shape (calls `NAME<sep>ARGS`, results without an outputs block), no tools variable
V31_TEMPLATE = (
    "{{ bos_token }}{% for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜></think>' }}{% if m['tool_calls'] %}"
    "{{ '<｜tool▁calls▁begin｜>' }}{% for c in m['tool_calls'] %}{{ '<｜tool▁call▁begin｜>' + c['function']['name']"
    " + '<｜tool▁sep｜>' + c['function']['arguments'] + '<｜tool▁call▁end｜>' }}{% endfor %}"
    "{{ '<｜tool▁calls▁end｜>' }}{% endif %}{{ '<｜end▁of▁sentence｜>' }}"
    "{% elif m['role'] == 'tool' %}{{ '<｜tool▁output▁begin｜>' + m['content'] + '<｜tool▁output▁end｜>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt and messages[-1]['role'] == 'user' %}{{ '<｜Assistant｜></think>' }}"
    "{% endif %}"
)


def test_a_template_without_a_tools_variable_gets_the_model_cards_description(tmp_path):
    tok = _tokenizer(tmp_path, "deepseek_v3", V31_TEMPLATE)
    assert tok.tool_format.name == V31 and not tok.template_tools
    text = tok.render_chat(encode_chat_messages(tok, HISTORY), tools=[WEATHER])
    assert text.startswith(
        "<｜begin▁of▁sentence｜>S\n\n## Tools\nYou have access to the following tools:\n\n### get_weather\n"
        'Description: Weather of a city\n\nParameters: {"type": "object", "properties": {"city": {"type": "string"}, '
        '"days": {"type": "integer"}}, "required": ["city"]}\n\nIMPORTANT: ALWAYS adhere to this exact format for '
        "tool use:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments"
        "<｜tool▁call▁end｜>{additional_tool_calls}<｜tool▁calls▁end｜>\n\nWhere:\n"
    )
    assert text.endswith(
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
        "<｜end▁of▁sentence｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁output▁begin｜>rain"
        "<｜tool▁output▁end｜>"
    )
    # no system message: the description is one of its own
    assert tok.render_chat([{"role": "user", "content": "Hi"}], tools=[WEATHER]).startswith(
        "<｜begin▁of▁sentence｜>\n\n## Tools\n"
    )


def test_a_template_that_drops_the_calls_is_refused(tmp_path):
    dropping = V31_TEMPLATE.replace("+ c['function']['arguments'] ", "")
    tok = _tokenizer(tmp_path, "deepseek_v3", dropping)
    with pytest.raises(ConfigError, match="message 2: the chat template leaves its tool call 'a' out"):
        tok.render_chat(encode_chat_messages(tok, HISTORY))


def test_a_format_without_tool_calls_refuses_tools_and_their_history(tmp_path):
    plain = "{{ bos_token }}{% for m in messages %}{{ '<｜User｜>' + m['content'] }}{% endfor %}"
    tok = _tokenizer(tmp_path, "deepseek_v3", plain)
    assert tok.tool_format is None
    with pytest.raises(ConfigError, match="tools: this model's prompt format has no tool calls"):
        encode_prompt(tok, "Hi", tools=[WEATHER])
    with pytest.raises(ConfigError, match="message 2: field 'tool_calls': this model's prompt format has no tool"):
        encode_prompt(tok, HISTORY[:3])
    with pytest.raises(ConfigError, match="message 0: role 'tool'"):
        encode_prompt(tok, [HISTORY[3]])


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user", "content": "Hi", "name": "ann"}], "message 0: field 'name': a speaker's name"),
        ([*HISTORY[:3], {**HISTORY[3], "name": "other"}], "message 3: field 'name' is 'other'"),
        ([*HISTORY[:3], {**HISTORY[3], "tool_call_id": "zz"}], "message 3: tool_call_id 'zz' answers no tool call"),
        ([*HISTORY[:4], HISTORY[3]], "message 4: tool_call_id 'b' is answered twice"),
        ([*HISTORY[:2], HISTORY[3]], "message 2: tool_call_id 'b' answers no tool call"),
        ([*HISTORY[:3], {"role": "user", "content": "x"}, HISTORY[3]], "message 4: tool_call_id 'b' answers no"),
        ([{"role": "user", "content": "Hi", "tool_call_id": "a"}], "message 0: field 'tool_call_id'"),
        ([{"role": "assistant", "content": "x", "reasoning_content": "r"}], "message 0: field 'reasoning_content'"),
        ([{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}], "field 'id'"),
        ([{"role": "assistant", "content": None}], "message 0: content must be text"),
        ([{"role": "user", "content": "Hi", "color": "red"}], "message 0: field 'color': not a field"),
    ],
)
def test_fields_the_format_cannot_carry_are_refused_by_name(tmp_path, messages, message):
    tok = _tokenizer(tmp_path, "deepseek_v3")
    with pytest.raises(ConfigError, match=message):
        encode_prompt(tok, messages)


def test_tools_are_refused_where_the_format_is_skipped(tmp_path):
    tok = _tokenizer(tmp_path, "deepseek_v3")
    with pytest.raises(ConfigError, match="tools go through the prompt format, which raw skips"):
        encode_prompt(tok, "Hi", raw=True, tools=[WEATHER])
    with pytest.raises(ConfigError, match="tools go through the prompt format, which token ids skip"):
        encode_prompt(tok, [1, 2], tools=[WEATHER])
    assert encode_prompt(tok, "Hi", tools=[]) == encode_prompt(tok, "Hi")  # an empty list is no tools


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ("get_weather", "tools: must be a list"),
        ([{"type": "code_interpreter"}], r"tools\[0\]: must be"),
        ([{"type": "function", "function": {"name": "a b"}}], r"tools\[0\].function.name: must be 1 to 64"),
        ([{"type": "function", "function": {"name": "f", "returns": {}}}], "field 'returns' is not one of"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "schema of an object"),
        ([WEATHER, WEATHER], "function 'get_weather' is listed twice"),
    ],
)
def test_bad_tools_lists_are_refused(tools, message):
    with pytest.raises(ConfigError, match=message):
        check_tools(tools)


def test_tool_choice_is_checked_against_the_tools():
    tools = check_tools([WEATHER])
    assert check_tool_choice(None, tools) == ToolChoice("auto") and check_tool_choice(None, None) == ToolChoice("none")
    named = check_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)
    assert named == ToolChoice("function", "get_weather") and named.forced
    assert check_tool_choice("required", tools).forced and not check_tool_choice("auto", tools).forced
    with pytest.raises(ConfigError, match="tool_choice: names 'rm', which is not one of the request's tools"):
        check_tool_choice({"type": "function", "function": {"name": "rm"}}, tools)
    with pytest.raises(ConfigError, match="'required' needs tools"):
        check_tool_choice("required", None)
    with pytest.raises(ConfigError, match="tool_choice: must be one of auto, none, required"):
        check_tool_choice("always", tools)


# encoding_dsv4.py's encode_messages for this conversation (tools on the system message), in chat mode
V4_TOOL_PROMPT = (
    "<｜begin▁of▁sentence｜>S\n\n## Tools\n\nYou have access to a set of tools to help answer the user's question. "
    'You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n<｜DSML｜tool_calls>\n'
    '<｜DSML｜invoke name="$TOOL_NAME">\n<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">'
    '$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke name="$TOOL_NAME2">\n...\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nString parameters should be specified as is and set "
    '`string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and '
    'set `string="false"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete '
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly "
    "after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}\n\nYou MUST strictly follow '
    "the above defined tool name and parameter schemas to invoke tool calls.\n<｜User｜>Weather?<｜Assistant｜>"
    '</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
    'string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '</｜DSML｜invoke>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Rome'
    "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜>"
    "<tool_result>sunny</tool_result>\n\n<tool_result>rain</tool_result><｜Assistant｜></think>"
)


def test_v4_prompts_with_tools_equal_the_releases(tmp_path):
    tok = _tokenizer(tmp_path, "deepseek_v4")
    assert tok.render_chat(encode_chat_messages(tok, HISTORY), tools=[WEATHER]) == V4_TOOL_PROMPT
    # thinking mode with tools: every turn keeps its reasoning and hands over with <think>
    history = [*HISTORY[:2], {**HISTORY[2], "reasoning_content": "Need both."}, *HISTORY[3:]]
    thinking = tok.render_chat(encode_chat_messages(tok, history), thinking=True, tools=[WEATHER])
    assert "<｜User｜>Weather?<｜Assistant｜><think>Need both.</think>\n\n<｜DSML｜tool_calls>" in thinking
    assert thinking.endswith("<tool_result>rain</tool_result><｜Assistant｜><think>")
    # and the ids: the DSML token is one token of the prompt
    ids = encode_prompt(tok, HISTORY, tools=[WEATHER])
    assert ids.count(tok.tok.token_to_id(mk.DSML)) == V4_TOOL_PROMPT.count(mk.DSML)


@pytest.mark.parametrize(
    ("family", "template"), [("deepseek_v3", None), ("deepseek_v3", V31_TEMPLATE), ("deepseek_v4", None)]
)
def test_an_assistants_calls_rendered_into_the_prompt_parse_back(tmp_path, family, template):
    from dsfp4.runtime.generate.answer.tool_calls import parse_tool_calls

    tok = _tokenizer(tmp_path, family, template)
    chat = encode_chat_messages(tok, HISTORY[:3])
    text = tok.render_chat(chat, add_generation_prompt=False)
    # the assistant's turn as the model would have written it: after the hand-over, up to the EOS
    turn = text.rsplit("</think>" if "</think>" in text else "<｜Assistant｜>", 1)[1].removesuffix(tok.eos_token)
    content, calls = parse_tool_calls(turn, tok.tool_format, [WEATHER])
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in CALLS
    ]
