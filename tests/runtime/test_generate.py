"""Generation on a converted tiny model: tokenizer and chat template, greedy and sampling, stop rules,
streaming, the KV-cache prefix reuse across chat turns, and the context limit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsfp4 import Engine
from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.sampling import choose, sample
from dsfp4.runtime.generate.sampling_params import SamplingParams
from dsfp4.runtime.generate.tokenizer import ChatTokenizer

GREEDY = {"temperature": 0.0}


def _engine(model) -> Engine:
    return Engine(model, device="cpu", max_context=64)


@pytest.fixture(scope="module")
def engine(converted):
    with _engine(converted) as engine:
        yield engine


def test_chat_template_renders_as_transformers_does(converted):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(converted)
    tok = ChatTokenizer(converted)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
    ]
    assert tok.render_chat(chat) == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (
        tok.encode_chat(chat) == ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"]
    )
    assert tok.encode("hello world") == ref("hello world")["input_ids"]  # BOS from the post-processor
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_greedy_generation_follows_the_argmax_of_a_full_forward(engine):
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    g = engine.generate(prompt, max_tokens=8, **GREEDY)
    assert g.finish_reason == "length" and len(g.token_ids) == 8
    logits = engine.logits(prompt + g.token_ids)  # one pass over every position
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == g.token_ids


def test_sampling_is_reproducible_and_filters(engine):
    prompt = engine.tokenizer.encode("hello world")
    a = engine.generate(prompt, max_tokens=10, temperature=1.0, top_p=1.0, seed=7).token_ids
    b = engine.generate(prompt, max_tokens=10, temperature=1.0, top_p=1.0, seed=7).token_ids
    c = engine.generate(prompt, max_tokens=10, temperature=1.0, top_p=1.0, seed=8).token_ids
    assert a == b and a != c
    greedy = engine.generate(prompt, max_tokens=10, **GREEDY).token_ids
    assert engine.generate(prompt, max_tokens=10, temperature=1.0, top_k=1, seed=3).token_ids == greedy
    assert engine.generate(prompt, max_tokens=10, temperature=1.0, top_p=1e-6, seed=3).token_ids == greedy
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    picks = {sample(logits, SamplingParams(1.0, top_k=2), torch.Generator().manual_seed(s)) for s in range(50)}
    assert picks == {1, 2}


def test_choose_draws_the_sampling_distribution_on_the_logits_device():
    """The device-side pick that pipelined decoding uses: greedy is the argmax; sampling (an exponential race)
    draws the filtered distribution, and a seed repeats it."""
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 1.5])
    assert int(choose(logits, SamplingParams(0.0), None)) == 2
    p = SamplingParams(1.0, top_p=1.0)
    gen = torch.Generator().manual_seed(0)
    picks = torch.stack([choose(logits, p, gen) for _ in range(4000)])
    freq = torch.bincount(picks, minlength=5).float() / len(picks)
    assert (freq - logits.softmax(0)).abs().max() < 0.03
    top2 = {int(choose(logits, SamplingParams(1.0, top_k=2), gen)) for _ in range(200)}
    assert top2 == {2, 4}
    again = [int(choose(logits, p, torch.Generator().manual_seed(s))) for s in range(20)]
    assert again == [int(choose(logits, p, torch.Generator().manual_seed(s))) for s in range(20)]


def test_stop_strings_eos_and_streaming(engine):
    prompt = engine.tokenizer.encode("hello world")
    full = engine.generate(prompt, max_tokens=12, **GREEDY)
    stop = full.text[4:6]
    stream = engine.stream(prompt, max_tokens=12, stop=stop, **GREEDY)
    pieces = [d.text for d in stream]
    g = stream.generation
    assert g.finish_reason == "stop" and g.text == full.text[: full.text.find(stop)]
    assert "".join(pieces) == g.text
    eos_ids = engine.tokenizer.eos_ids
    i = next(i for i, t in enumerate(full.token_ids) if i and t not in full.token_ids[:i])
    engine.tokenizer.eos_ids = frozenset({full.token_ids[i]})  # pretend that token is the EOS
    try:
        g = engine.generate(prompt, max_tokens=12, **GREEDY)
    finally:
        engine.tokenizer.eos_ids = eos_ids
    assert g.finish_reason == "stop" and g.token_ids == full.token_ids[:i] and g.stats.generated_tokens == i + 1


def test_chat_turns_reuse_the_cache_and_give_the_same_tokens(converted, engine):
    chat = [{"role": "user", "content": "hello"}]
    first = engine.generate(chat, max_tokens=6, **GREEDY)
    chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    second = engine.generate(chat, max_tokens=6, **GREEDY)
    with _engine(converted) as fresh:
        alone = fresh.generate(chat, max_tokens=6, **GREEDY)
    assert second.stats.cached_tokens > 0 and alone.stats.cached_tokens == 0
    assert second.token_ids == alone.token_ids
    assert second.stats.prompt_tokens == alone.stats.prompt_tokens and second.stats.store["expert_uses"] > 0


def test_context_limit(engine):
    with pytest.raises(ConfigError, match="the prompt is 64 tokens; the context holds 64"):
        engine.generate(list(range(3, 67)), max_tokens=4, **GREEDY)
    g = engine.generate(list(range(3, 63)), max_tokens=10, **GREEDY)  # 60 + 4 fed back fill the context
    assert g.finish_reason == "length" and len(g.token_ids) == 5  # ... and the 5th is not fed back


def test_hold_back_covers_stop_prefixes_before_an_unfinished_character():
    from dsfp4.runtime.generate.steps import held_back as _held_back

    assert _held_back("xa\ufffd", ("a你",)) == 2  # "a" may start the stop string, "\ufffd" may become 你
    assert _held_back("xab", ("bc",)) == 1 and _held_back("xyz", ("bc",)) == 0
    assert _held_back("xy\ufffd\ufffd", ()) == 2


def test_hold_back_reads_only_the_end_and_agrees_with_reading_all():
    import random

    from dsfp4.runtime.generate.reasoning import partial_suffix
    from dsfp4.runtime.generate.steps import held_back

    def whole(text: str, stop: tuple[str, ...]) -> int:  # every suffix of the whole text considered
        partial = len(text) - len(text.rstrip("\ufffd"))
        prefix = max((partial_suffix(text, s) for s in stop), default=0)
        before = max((partial_suffix(text[: len(text) - partial], s, whole=True) for s in stop), default=0)
        return max(prefix, partial + before)

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab\ufffd") for _ in range(rng.randrange(12)))
        stop = tuple("".join(rng.choice("ab") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(3)))
        assert held_back(text, stop) == whole(text, stop), (text, stop)


def test_an_interrupted_prefill_leaves_a_consistent_cache(converted, engine):
    first = [{"role": "user", "content": "hello"}]
    engine.generate(first, max_tokens=4, **GREEDY)
    second = [{"role": "user", "content": "something else entirely"}]
    real, calls = engine.model.forward, []

    def dying(*a, **k):
        calls.append(1)
        raise KeyboardInterrupt

    engine.model.forward = dying
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(second, max_tokens=4, **GREEDY)
    finally:
        engine.model.forward = real
    again = engine.generate(second, max_tokens=6, **GREEDY)
    with _engine(converted) as fresh:
        assert again.token_ids == fresh.generate(second, max_tokens=6, **GREEDY).token_ids


def test_text_that_is_not_utf8_is_tokenized_with_replacement_characters(engine):
    bad = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # what Python makes of Latin-1 argv
    ids = engine.tokenizer.encode(bad)
    assert "\ufffd" in engine.tokenizer.decode(ids)


def test_repl_survives_a_bad_turn(engine):
    from dsfp4.cli.repl import LocalChat, chat_repl
    from dsfp4.runtime.generate.prompt import PromptRules

    lines = iter(["hi", "/stats", "/quit"])
    out = []
    real = engine.rules
    engine.rules = PromptRules(replace(real.spec, max_context=3), real.tokenizer)  # every prompt is now too long
    try:
        chat_repl(LocalChat(engine), read=lambda p: next(lines), write=out.append)
    finally:
        engine.rules = real
    text = "".join(out)
    assert "error: the prompt is" in text and "(nothing generated yet)" in text


def test_text_stream_decodes_only_the_tail_and_agrees_with_whole_decoding(engine):
    import random

    from dsfp4.runtime.generate.tokenizer import TextStream

    tok = engine.tokenizer
    texts = ["naïve café, 中文字符 and emoji 🙂🚀 mixed", "plain ascii words " * 5, "\n\n  spaced\tout  "]
    rng = random.Random(0)
    vocab = engine.model.args.vocab_size
    sequences = [tok.encode(t, special=False) for t in texts] + [[rng.randrange(vocab) for _ in range(200)]]
    for ids in sequences:
        stream = TextStream(tok)
        for i, token in enumerate(ids):
            assert stream.add(token) == tok.decode(ids[: i + 1]), (ids, i)
    calls = []
    real = tok.decode
    tok.decode = lambda ids: calls.append(len(ids)) or real(ids)
    try:
        stream = TextStream(tok)
        for token in sequences[1]:
            stream.add(token)
    finally:
        tok.decode = real
    assert max(calls) < 10  # the windows stay short: nothing is decoded from the start again


@pytest.mark.parametrize(
    ("post_bos", "add_bos", "bos_first"), [(False, True, True), (True, False, False), (False, None, False)]
)
def test_raw_text_takes_the_bos_that_add_bos_token_asks_for(converted, tmp_path, post_bos, add_bos, bos_first):
    """DeepSeek's tokenizer_config.json says add_bos_token true; transformers' Llama tokenizers and vLLM then put the
    BOS first whatever tokenizer.json's post-processor does, and so does a raw prompt here. Unset, the post-processor
    decides."""
    import json

    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    if not post_bos:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = json.loads((converted / "tokenizer_config.json").read_text())
    cfg.pop("add_bos_token")
    if add_bos is not None:
        cfg["add_bos_token"] = add_bos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = ChatTokenizer(tmp_path)
    plain = t.encode("hello world", special=False)
    assert t.encode("hello world") == [0] * bos_first + plain and t.encode_prompt("hello world", raw=True)[0] == (
        0 if bos_first else plain[0]
    )
    assert t.bos_id == 0


def test_percentile_is_the_nearest_rank():
    from dsfp4.runtime.generate.steps import percentile

    values = [0.1, 0.2, 0.3, 0.4]
    assert percentile([], 50) == 0.0
    assert [percentile(values, q) for q in (1, 25, 50, 51, 99, 100)] == [0.1, 0.1, 0.2, 0.3, 0.4, 0.4]
    assert percentile([7.0], 99) == 7.0
