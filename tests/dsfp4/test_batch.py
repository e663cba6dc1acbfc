"""`dsfp4 run MODEL --batch IN --output OUT` (dsfp4/tools/batch_file.py, dsfp4/cli/batch.py): every line answered in
order as `run --json` answers it, a rerun answers only what is missing, and every bad input is one line naming it."""

from __future__ import annotations

import json

import pytest

from dsfp4.errors import ConfigError
from dsfp4.runtime.options import RunOptions
from dsfp4.tools.batch_file import parse_line
from tests.fixtures.cli import assert_one_line_error, run_cli

LINES = [
    {"prompt": "Explain the tiers of the expert store", "max_tokens": 6},
    {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "seed": 3},
    {"prompt": "raw text goes in as it is", "raw": True, "max_tokens": 4, "stop": ["zz"]},
]


def _write(path, lines):
    path.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n")
    return path


def _results(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_every_line_is_answered_in_order_as_run_json_answers_it(converted, tmp_path):
    batch, out = _write(tmp_path / "in.jsonl", [LINES[0], "", *LINES[1:]]), tmp_path / "out.jsonl"
    r = run_cli("run", converted, "--batch", batch, "--output", out, "--temperature", 0, "--device", "cpu", "-q")
    assert r.exit_code == 0, r.output
    got = _results(out)
    assert [x["line"] for x in got] == [1, 3, 4]  # the blank line 2 is skipped, numbers are the file's
    one = run_cli("run", converted, "--prompt", LINES[0]["prompt"], "--max-tokens", 6, "--temperature", 0, "--json")
    want = json.loads(one.stdout)
    assert got[0]["token_ids"] == want["token_ids"] and got[0]["text"] == want["text"]
    assert len(got[1]["token_ids"]) <= 5 and got[2]["finish_reason"] in ("length", "stop", "eos")
    assert {"prompt_token_ids", "token_ids", "text", "finish_reason", "stats", "input_sha256"} <= set(got[0])


def test_lines_decoded_together_answer_as_lines_decoded_one_by_one(converted, tmp_path):
    greedy = [{**x, "max_tokens": 5 + i, "temperature": 0} for i, x in enumerate(LINES * 2)]
    batch = _write(tmp_path / "in.jsonl", greedy)
    outs = {}
    for n in (1, 4):
        outs[n] = tmp_path / f"out{n}.jsonl"
        r = run_cli("run", converted, "--batch", batch, "--output", outs[n], "--max-batch", n, "--device", "cpu")
        assert r.exit_code == 0, r.output
    one, together = _results(outs[1]), _results(outs[4])
    assert [x["line"] for x in together] == list(range(1, 7))  # in input order, whatever ended first
    assert [x["token_ids"] for x in together] == [x["token_ids"] for x in one]
    assert "up to 4 decoded together" in r.stderr and "batch" in together[0]["stats"]["decode_mode"]
    r = run_cli("run", converted, "--prompt", "hi", "--max-batch", 2)
    assert r.exit_code != 0 and "--max-batch only applies with --serve or --batch" in r.output


def test_a_rerun_answers_only_the_lines_missing_and_drops_a_torn_one(converted, tmp_path):
    batch, out = _write(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl"
    args = ("run", converted, "--batch", batch, "--output", out, "--temperature", 0, "--device", "cpu")
    assert run_cli(*args, "-q").exit_code == 0
    first = out.read_text().splitlines()
    out.write_text(first[0] + "\n" + first[1][:20])  # line 3 never written, line 2 torn by an interruption
    r = run_cli(*args)
    assert r.exit_code == 0, r.output
    assert "1 lines already answered; answering the other 2" in r.stderr
    again = out.read_text().splitlines()
    assert again[0] == first[0] and [json.loads(x)["line"] for x in again] == [1, 2, 3]
    assert [json.loads(x)["token_ids"] for x in again] == [json.loads(x)["token_ids"] for x in first]


def test_an_output_of_another_input_is_refused_before_loading(converted, tmp_path):
    batch, out = _write(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl"
    out.write_text(json.dumps({"line": 1, "input_sha256": "0" * 64}) + "\n")
    r = run_cli("run", converted, "--batch", batch, "--output", out)
    assert_one_line_error(r, f"--output {out}: line 1 answers input line 1 of another input")


@pytest.mark.parametrize(
    "line,message",
    [
        ("not json", "not JSON"),
        ("[1, 2]", "a JSON object is expected"),
        ('{"prompt": "a", "color": 1}', "unknown key color"),
        ('{"prompt": "a", "messages": []}', "give one of `prompt`"),
        ('{"max_tokens": 3}', "give one of `prompt`"),
        ('{"prompt": ""}', "`prompt` must be non-empty text"),
        ('{"messages": [{"role": "user"}]}', "`messages` must be a non-empty list"),
        ('{"messages": [{"role": "robot", "content": "a"}]}', "with roles system, developer, user, assistant"),
        ('{"messages": [{"role": "user", "content": "a"}], "raw": true}', "`raw` is true or false"),
        ('{"prompt": "a", "temperature": -1}', "--temperature"),
        ('{"prompt": "a", "max_tokens": "many"}', "max_tokens"),
    ],
)
def test_a_bad_line_is_named_by_file_and_line(line, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_line(line, "in.jsonl:7", RunOptions())
    assert str(e.value).startswith("in.jsonl:7: ")


def test_a_line_is_cut_at_newlines_only(tmp_path):
    from dsfp4.tools.batch_file import read_batch

    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False) + "\r\n" + json.dumps({"prompt": "c"}))
    items = read_batch(path, RunOptions())
    assert [(i.line, i.prompt) for i in items] == [(1, "a\u2028b"), (2, "c")]


def test_bad_batches_fail_before_the_model_loads(converted, tmp_path):
    batch, out = _write(tmp_path / "in.jsonl", [LINES[0], '{"prompt": 3}']), tmp_path / "out.jsonl"
    assert_one_line_error(run_cli("run", converted, "--batch", batch, "--output", out), f"{batch}:2: `prompt`")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert_one_line_error(run_cli("run", converted, "--batch", empty, "--output", out), "no lines to answer")
    r = run_cli("run", converted, "--batch", batch)
    assert r.exit_code == 2 and "--batch FILE and --output FILE go together" in r.output
    r = run_cli("run", converted, "--batch", batch, "--output", out, "--prompt", "hi")
    assert r.exit_code == 2 and "give one of --prompt TEXT, --chat, --serve or --batch FILE" in r.output
    assert not out.exists()


def test_a_prompt_too_long_for_the_context_is_named_before_any_answer(converted, tmp_path):
    batch = _write(tmp_path / "in.jsonl", [LINES[0], {"prompt": "word " * 400}])
    out = tmp_path / "out.jsonl"
    r = run_cli("run", converted, "--batch", batch, "--output", out, "--max-context", 64, "--device", "cpu")
    assert_one_line_error(r, f"{batch}:2: the prompt is", after_start=True)
    assert not out.exists() or out.read_text() == ""


def test_lines_with_tools_and_response_formats_get_their_calls_and_json(converted, tmp_path):
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]},
        },
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    lines = [
        {"prompt": "Weather?", "tools": [weather], "tool_choice": named, "max_tokens": 200},
        {"prompt": "Yes?", "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        {"prompt": "Weather?", "tools": [weather], "tool_choice": named, "max_tokens": 20},
    ]
    batch, out = _write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    for n in (1, 2):
        out.unlink(missing_ok=True)
        args = ("--max-context", 1024, "--temperature", 0, "--max-batch", n, "--device", "cpu", "-q")
        r = run_cli("run", converted, "--batch", batch, "--output", out, *args)
        assert r.exit_code == 0, r.output
        first, second, cut = _results(out)
        (call,) = first["tool_calls"]
        assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Paris", "Oslo")
        assert json.loads(second["text"]) in ({"ok": True}, {"ok": False}) and "tool_calls" not in second
        assert "ends inside a block of tool calls" in cut["error"]  # max_tokens ran out inside the call
    bad = _write(
        tmp_path / "bad.jsonl",
        [{"prompt": "a", "tools": [weather], "tool_choice": {**named, "function": {"name": "x"}}}],
    )
    r = run_cli("run", converted, "--batch", bad, "--output", tmp_path / "o.jsonl", "--device", "cpu", "-q")
    assert_one_line_error(r, f"{bad}:1: tool_choice: names 'x'")
