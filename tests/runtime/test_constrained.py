"""Decoding rules on the tiny random model: neutral options keep today's tokens; log-probabilities match the model's
logits; a JSON schema's answers parse and fit every time, sampling on, decoded alone, in a batch beside
unconstrained rows, and with MTP drafts (drafts the grammar refuses are rejected); a Lark grammar forcing a string
gives it; a grammar that does not compile is a ConfigError; a tool-call grammar's text compiles."""

from __future__ import annotations

import json

import pytest

from dsfp4 import Engine, RunOptions
from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.answer.grammar import Grammar
from dsfp4.runtime.generate.answer.grammar_matcher import GrammarCompiler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
    },
    "required": ["name", "ok", "size"],
    "additionalProperties": False,
}
GRAMMAR = Grammar.json_schema(SCHEMA)
SAMPLED = {"temperature": 1.0, "top_p": 1.0}
# enough for the longest answer the schema allows
ROOM = 80


def _fits(text: str) -> None:
    """The answer parses as JSON and fits SCHEMA."""
    obj = json.loads(text)
    assert set(obj) <= set(SCHEMA["properties"]) and {"name", "ok", "size"} <= set(obj), obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert isinstance(obj["ok"], bool) and obj["size"] in ("S", "M", "L")
    tags = obj.get("tags", [])
    assert len(tags) <= 2 and all(isinstance(t, int) and 0 <= t <= 9 for t in tags)


@pytest.fixture(scope="module")
def engine(converted):
    with Engine(converted, device="cpu", max_context=128) as engine:
        yield engine


def test_neutral_options_give_todays_tokens_on_the_fast_path(engine):
    prompt = engine.tokenizer.encode("hello world")
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}
    for knobs in ({"temperature": 0.0}, {**SAMPLED, "seed": 3}):
        assert engine.generate(prompt, max_tokens=10, **knobs, **neutral).token_ids == (
            engine.generate(prompt, max_tokens=10, **knobs).token_ids
        )
    # log-probabilities are reported from the same logits: the greedy tokens stay
    g = engine.generate(prompt, max_tokens=10, temperature=0.0, logprobs=0)
    assert g.token_ids == engine.generate(prompt, max_tokens=10, temperature=0.0).token_ids
    assert g.logprobs is not None and len(g.logprobs) == 10 and all(e.top == () for e in g.logprobs)


def test_logprobs_are_the_log_softmax_of_the_models_logits(engine):
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    stream = engine.stream(prompt, max_tokens=6, logprobs=4, **SAMPLED, seed=1)
    deltas = list(stream)
    g = stream.generation
    logp = engine.logits(prompt + g.token_ids)[len(prompt) - 1 : -1].log_softmax(-1)  # [6, V]
    for i, (token, entry) in enumerate(zip(g.token_ids, g.logprobs, strict=True)):
        assert entry.token == token and entry.logprob == pytest.approx(float(logp[i, token]), abs=1e-4)
        assert [t for t, _ in entry.top] == logp[i].topk(4).indices.tolist()
    assert [d.logprob for d in deltas if d.token_id is not None] == g.logprobs
    assert "logprobs" in g.to_dict() and "logprobs" not in engine.generate(prompt, max_tokens=2).to_dict()


def test_a_json_schema_answer_parses_and_fits_every_time(engine):
    prompt = engine.tokenizer.encode("hello world")
    for seed in range(4):
        g = engine.generate(prompt, max_tokens=ROOM, grammar=GRAMMAR, seed=seed, **SAMPLED)
        assert g.finish_reason == "stop", g.text
        _fits(g.text)
    g = engine.generate(prompt, max_tokens=ROOM, grammar=Grammar.json_object(), temperature=0.0)
    assert g.text.startswith("{")
    # penalties and the grammar together
    g = engine.generate(prompt, max_tokens=ROOM, grammar=GRAMMAR, seed=9, frequency_penalty=1.5, **SAMPLED)
    _fits(g.text)


def test_a_lark_grammar_forcing_a_string_produces_it(engine):
    prompt = engine.tokenizer.encode("hello")
    for seed in range(2):
        g = engine.generate(
            prompt, max_tokens=20, grammar=Grammar.lark('start: "The answer: " ("yes" | "no")'), seed=seed
        )
        assert g.text in ("The answer: yes", "The answer: no") and g.finish_reason == "stop"


@pytest.mark.parametrize(
    ("grammar", "needle"),
    [
        (Grammar.json_schema({"type": "object", "properties": {"a": {"type": "bogus"}}}), "bogus"),
        (Grammar.lark("start: missing_rule", origin="--grammar g.lark"), "--grammar g.lark: the Lark grammar"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_config_error(engine, grammar, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        engine.stream("hello", grammar=grammar)
    assert "\n" not in str(err.value)


def test_response_formats_and_grammar_texts_are_checked():
    assert Grammar.from_response_format({"type": "text"}) is None
    assert Grammar.from_response_format({"type": "json_object"}) == Grammar.json_object()
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert Grammar.from_response_format(spec) == GRAMMAR
    for bad, needle in [
        ({"type": "xml"}, "response_format.type 'xml'"),
        ({"type": "json_schema", "json_schema": []}, "response_format.json_schema"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            Grammar.from_response_format(bad)
    with pytest.raises(ConfigError, match="--json-schema s.json: not JSON"):
        Grammar.json_schema("{oops", "--json-schema s.json")
    with pytest.raises(ConfigError, match="empty"):
        Grammar.lark("  ")


def test_the_mask_never_allows_ids_past_the_tokenizer(converted):
    """The model's logits are wider than the tokenizer (its padding ids): a grammar's mask refuses them."""
    from dsfp4.layout.manifest import Manifest
    from dsfp4.runtime.generate.tokenizer import ChatTokenizer

    vocab = Manifest.read(converted).args.vocab_size
    tok = ChatTokenizer(converted)
    n = tok.tok.get_vocab_size(with_added_tokens=True)
    assert vocab > n
    compiler = GrammarCompiler(converted / "tokenizer.json", vocab, tok.eos_ids)
    import torch

    allowed = compiler.matcher(Grammar.lark('start: /[a-z ]+/ "."')).allowed(torch.device("cpu"))
    assert allowed[:n].any() and not allowed[n:].any()


def test_a_tool_call_grammar_takes_the_markers_added_tokens_and_json_arguments(engine):
    """Tool-call grammars (tool_choice "required" or named) spell DeepSeek's markers as strings: in the tokenizer they
    are added tokens that are not special, which the model emits whole; the answer takes them and JSON arguments."""
    begin, call, sep, end = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    close = "<｜tool▁calls▁end｜>"
    # compact and closed, as the tool-call grammars write a function's parameters (x-guidance: llguidance's options)
    args = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
    args = json.dumps({**args, "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}})
    text = f'start: "{begin}" "{call}get_weather{sep}" args "{end}" "{close}"\nargs: %json {args}\n'
    for seed in range(2):
        g = engine.generate("hello", max_tokens=ROOM, grammar=Grammar.lark(text), seed=seed, **SAMPLED)
        assert g.finish_reason == "stop" and g.text.startswith(begin + call + "get_weather" + sep), g.text
        assert json.loads(g.text.removeprefix(begin + call + "get_weather" + sep).removesuffix(end + close)) in (
            {"city": "Paris"},
            {"city": "Oslo"},
        )
        # each marker went in as its own token
        assert engine.tokenizer.encode(begin, special=False)[0] in g.token_ids


def test_batched_rows_with_a_grammar_and_rows_without_decode_together(converted):
    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5], [8] * 13, [2, 7, 1, 8, 2, 8]]
    with Engine(converted, device="cpu", max_context=128, max_batch=3) as engine:
        alone = [engine.generate(p, max_tokens=8, temperature=0.0).token_ids for p in prompts[::2]]
        free = engine.options_for(max_tokens=8, temperature=0.0)
        requests = [
            (prompts[0], free),
            (prompts[1], engine.options_for(max_tokens=ROOM, grammar=GRAMMAR, seed=1, **SAMPLED)),
            (prompts[2], free),
            (prompts[3], engine.options_for(max_tokens=ROOM, grammar=GRAMMAR, temperature=0.0, logprobs=2)),
        ]
        got = dict(engine.generate_batch(requests))
    assert [got[0].token_ids, got[2].token_ids] == alone
    for i in (1, 3):
        _fits(got[i].text)
    assert len(got[3].logprobs) == len(got[3].token_ids) and got[1].logprobs is None


def test_mtp_drafts_the_grammar_refuses_are_rejected(converted):
    with Engine(converted, RunOptions(device="cpu", max_context=128, mtp=True)) as engine:
        engine.speculator.adaptive, engine.speculator.probe_plain = False, 0
        prompt = engine.tokenizer.encode("hello world")
        for seed in range(3):
            g = engine.generate(prompt, max_tokens=ROOM, grammar=GRAMMAR, seed=seed, **SAMPLED)
            _fits(g.text)
            assert g.stats.drafted > 0
        # every draft a token no JSON starts with or continues: each is rejected, the answer still fits
        refused = engine.tokenizer.encode("\n", special=False)[0]
        engine.speculator.override = lambda pos, draft: refused
        g = engine.generate(prompt, max_tokens=ROOM, grammar=GRAMMAR, temperature=0.0)
        _fits(g.text)
        assert g.stats.drafted > 0 and g.stats.accepted == 0


def test_a_json_schema_constrains_deepseek_v4_too(v4_converted):
    """V4-Flash's tokenizer (byte-level, its own post-processor) gives llguidance its tokens as V3's does."""
    with Engine(v4_converted, device="cpu", max_context=128) as engine:
        for seed in range(2):
            g = engine.generate("hi", max_tokens=ROOM, grammar=GRAMMAR, seed=seed, **SAMPLED)
            assert g.finish_reason == "stop", g.text
            _fits(g.text)
