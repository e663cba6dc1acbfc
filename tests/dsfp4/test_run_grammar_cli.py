"""`dsfp4 run --prompt` with a JSON schema or a Lark grammar, log-probabilities in --json's output, the penalty and
min-p flags; their one-line errors, a grammar that does not compile refused before the model loads."""

from __future__ import annotations

import json

from tests.fixtures.cli import assert_one_line_error, run_cli

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
BASE = ("--max-tokens", "40", "--device", "cpu", "--temperature", "1", "--seed", "3")


def test_run_json_schema_gives_json_that_fits_and_logprobs_per_token(converted, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    r = run_cli("run", converted, "--prompt", "hi", *BASE, "--json-schema", schema, "--json", "--logprobs", "2")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    answer = json.loads(out["text"])
    assert isinstance(answer["ok"], bool) and answer["size"] in ("S", "M", "L")
    assert len(out["logprobs"]) == len(out["token_ids"])
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"]
    assert all(len(e["top"]) <= 2 and e["logprob"] <= 0 for e in out["logprobs"])


def test_run_grammar_and_penalty_flags(converted, tmp_path):
    lark = tmp_path / "answer.lark"
    lark.write_text('start: "yes" | "no"\n')
    knobs = ("--presence-penalty", "1", "--frequency-penalty", "0.5", "--repetition-penalty", "1.2", "--min-p", "0.05")
    r = run_cli("run", converted, "--prompt", "hi", *BASE, *knobs, "--grammar", lark, "-q")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() in ("yes", "no")


def test_bad_grammar_flags_are_one_line_errors_before_the_model_loads(converted, tmp_path, monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr("dsfp4.runtime.engine.load_model", load)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "bogus"}}}))
    r = run_cli("run", converted, "--prompt", "hi", "--device", "cpu", "--json-schema", bad)
    assert_one_line_error(r, f"--json-schema {bad}: the JSON schema does not compile", "bogus")
    lark = tmp_path / "g.lark"
    lark.write_text("start: nowhere\n")
    r = run_cli("run", converted, "--prompt", "hi", "--device", "cpu", "--grammar", lark)
    assert_one_line_error(r, f"--grammar {lark}: the Lark grammar does not compile")
    both = run_cli("run", converted, "--prompt", "hi", "--device", "cpu", "--grammar", lark, "--json-schema", bad)
    assert both.exit_code == 2 and "give one of --json-schema FILE and --grammar FILE" in both.output
    plain = run_cli("run", converted, "--prompt", "hi", "--device", "cpu", "--logprobs", "2")
    assert plain.exit_code == 2 and "--logprobs go into --json's output" in plain.output
    assert run_cli("run", converted, "--chat", "--grammar", lark).exit_code == 2
    r = run_cli("run", converted, "--prompt", "hi", "--device", "cpu", "--min-p", "2")
    assert r.exit_code == 2 and "--min-p" in r.output
