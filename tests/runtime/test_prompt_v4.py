"""DeepSeek-V4's prompt format (runtime/generate/prompt_v4.py) against prompts the release's own encoder wrote:
encoding/encoding_dsv4.py `encode_messages` (run on a faithful copy: ztxz16/fastllm
tools/fastllm_pytools/encoding_dsv4.py, which reproduces the release's golden test_output_2.txt), kept here as
facts; and the tiny V4 checkpoints, which ship no Jinja template as the release does not."""

from __future__ import annotations

import pytest

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.prompt_v4 import encode_v4
from dsfp4.runtime.generate.tokenizer import ChatTokenizer

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
]
# encode_messages(CONVERSATION, thinking_mode="thinking") and (..., thinking_mode="chat")
THINKING = (
    "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hi<｜Assistant｜></think>Hello! How can I help?"
    "<｜end▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>"
)
CHAT = THINKING.removesuffix("<think>") + "</think>"
# the release's golden test_output_2.txt (test case 2, thinking mode): reasoning kept after the last user turn only
GOLDEN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there! How can I help you?", "reasoning_content": "A greeting."},
    {"role": "user", "content": "What is the capital of France?"},
    {
        "role": "assistant",
        "content": "The capital of France is Paris.",
        "reasoning_content": "The user asks about the capital of France. It is Paris.",
    },
]
GOLDEN_TEXT = (
    "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I "
    "help you?<｜end▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜><think>The user asks about "
    "the capital of France. It is Paris.</think>The capital of France is Paris.<｜end▁of▁sentence｜>"
)


@pytest.mark.parametrize(
    ("messages", "thinking", "text"),
    [
        (CONVERSATION, True, THINKING),
        (CONVERSATION, False, CHAT),
        ([{"role": "user", "content": "Hi"}], True, "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"),
        ([{"role": "user", "content": "Hi"}], False, "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"),
        (GOLDEN, True, GOLDEN_TEXT),
        # a conversation that ends with the assistant: no hand-over; in thinking mode an empty reasoning block
        (
            CONVERSATION[:3],
            False,
            "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hi<｜Assistant｜></think>Hello! How can I "
            "help?<｜end▁of▁sentence｜>",
        ),
        (
            CONVERSATION[:3],
            True,
            "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hi<｜Assistant｜><think></think>Hello! How "
            "can I help?<｜end▁of▁sentence｜>",
        ),
        # consecutive user messages are one turn; two system messages run together
        (
            [{"role": "user", "content": "A"}, {"role": "user", "content": "B"}],
            False,
            "<｜begin▁of▁sentence｜><｜User｜>A\n\nB<｜Assistant｜></think>",
        ),
        (
            [
                {"role": "system", "content": "S1"},
                {"role": "system", "content": "S2"},
                {"role": "user", "content": "Q"},
            ],
            True,
            "<｜begin▁of▁sentence｜>S1S2<｜User｜>Q<｜Assistant｜><think>",
        ),
    ],
)
def test_prompts_equal_the_releases(messages, thinking, text):
    assert encode_v4(messages, thinking) == text


def test_a_reasoning_before_the_last_user_turn_is_dropped_in_both_modes():
    with_reasoning = [*CONVERSATION[:2], {**CONVERSATION[2], "reasoning_content": "Greet back."}, CONVERSATION[3]]
    assert encode_v4(with_reasoning, True) == THINKING and encode_v4(with_reasoning, False) == CHAT


def test_without_the_generation_prompt_the_hand_over_is_left_out():
    assert encode_v4(CONVERSATION, True, add_generation_prompt=False) == THINKING.removesuffix("<｜Assistant｜><think>")
    with pytest.raises(ConfigError, match="no role 'function'"):
        encode_v4([{"role": "function", "content": "x"}], False)


def test_the_tiny_v4_checkpoint_has_no_template_and_prompts_in_the_releases_format(v4_converted):
    import json

    cfg = json.loads((v4_converted / "tokenizer_config.json").read_text())
    assert "chat_template" not in cfg and cfg["add_bos_token"] is False  # as V4-Flash's release
    tok = ChatTokenizer(v4_converted)
    assert tok.thinking_switch and tok.render_chat(CONVERSATION) == CHAT  # chat mode unless thinking is asked for
    assert tok.render_chat(CONVERSATION, thinking=True) == THINKING
    ids = tok.encode_prompt("Hi", thinking=True)
    assert ids[0] == 0 and tok.decode(ids[-2:], keep_special=True) == "<｜Assistant｜><think>"
    assert tok.encode("Hi")[0] != 0  # raw text: add_bos_token is false, so no BOS


def test_v3s_template_has_no_switch_and_a_template_with_thinking_has_one(converted, tmp_path):
    import json
    import shutil

    tok = ChatTokenizer(converted)
    assert not tok.thinking_switch
    with pytest.raises(ConfigError, match="no thinking switch"):
        tok.render_chat(CONVERSATION, thinking=True)
    model = shutil.copytree(converted, tmp_path / "v31")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    # V3.1's switch, in a template of its shape: the hand-over ends in <think> or </think>
    cfg["chat_template"] = (
        "{% if not thinking is defined %}{% set thinking = false %}{% endif %}{{ bos_token }}"
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<｜Assistant｜>' + ('<think>' if thinking else '</think>') }}{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    v31 = ChatTokenizer(model)
    hi = [{"role": "user", "content": "Hi"}]
    assert v31.thinking_switch
    assert v31.render_chat(hi).endswith("</think>") and v31.render_chat(hi, thinking=True).endswith("<think>")
