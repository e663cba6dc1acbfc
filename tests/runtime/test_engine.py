"""The Python API (dsfp4.Engine): the README example, `run --json` against generate and logits, streams and
their cancellation, reset, close, bad arguments, and (on a GPU) memory that does not grow over 20 engines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import dsfp4
from dsfp4 import DsfpError, Engine
from dsfp4.errors import ConfigError
from tests.fixtures.cli import run_cli

PROMPT = "Why is the sky blue?"

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine(converted):
    with Engine(converted, device="cpu", max_context=64) as engine:
        yield engine


def _readme_blocks(lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it from Python") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_the_readme_examples_run_on_the_demo_model_in_a_fresh_interpreter(converted):
    (sh,) = _readme_blocks("sh")
    one_liner = next(line for line in sh.splitlines() if line.startswith("python -c"))
    code = one_liner.removeprefix("python -c ").strip().strip('"').replace("demo/model", str(converted))
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    (block,) = _readme_blocks("python")
    r = _python(block.replace("demo/model", str(converted)))
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stdout and "torch.Size([" in r.stdout
    r = _python("import sys, dsfp4; assert 'torch' not in sys.modules; print(dsfp4.Engine.__name__)")
    assert r.returncode == 0 and r.stdout.strip() == "Engine", r.stderr  # the API loads on first use only


def test_run_json_equals_generate_and_the_argmax_of_logits_step_by_step(converted, engine):
    r = run_cli(
        "run",
        converted,
        "--prompt",
        PROMPT,
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--device",
        "cpu",
        "--max-context",
        "64",
        "--json",
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out) == {"prompt_token_ids", "token_ids", "text", "finish_reason", "stats"}
    g = engine.generate(PROMPT, max_tokens=8, temperature=0)
    assert out["prompt_token_ids"] == g.prompt_ids == engine.encode(PROMPT)
    assert out["token_ids"] == g.token_ids and len(g.token_ids) == 8
    assert out["text"] == g.text and out["finish_reason"] == g.finish_reason == "length"
    assert out["stats"]["generated_tokens"] == 8 and out["stats"]["decode_tok_s"] > 0
    assert 0 < out["stats"]["itl_p50_s"] <= out["stats"]["itl_p99_s"]  # between the tokens, as the caller got them
    assert set(g.stats.to_dict()) == set(out["stats"])
    for i, token in enumerate(g.token_ids):
        assert int(engine.logits(g.prompt_ids + g.token_ids[:i])[-1].argmax()) == token


def test_logits_cover_every_position_in_any_chunking(converted, engine):
    ids = engine.encode(PROMPT)
    whole = engine.logits(ids)
    torch.testing.assert_close(engine.logits(torch.tensor(ids)), whole, rtol=0, atol=0)
    assert whole.shape == (len(ids), engine.model.args.vocab_size) and whole.dtype == torch.float32
    with Engine(converted, device="cpu", max_context=64, prefill_chunk=3) as chunked:
        torch.testing.assert_close(chunked.logits(ids), whole, rtol=1e-4, atol=1e-4)
    g = engine.generate(ids, max_tokens=2, temperature=0)
    assert g.stats.cached_tokens == len(ids) - 1  # logits left the prompt in the cache


def test_stream_deltas_add_up_and_a_cancelled_stream_leaves_the_cache_consistent(converted, engine):
    full = engine.generate(PROMPT, max_tokens=10, temperature=0)
    assert engine.stats is full.stats
    stream = engine.stream(PROMPT, max_tokens=10, temperature=0)
    deltas = list(stream)
    assert "".join(d.text for d in deltas) == full.text == stream.generation.text
    assert [d.token_id for d in deltas if d.token_id is not None] == full.token_ids
    stream = engine.stream(PROMPT, max_tokens=10, temperature=0)
    head = [next(stream).token_id for _ in range(3)]
    assert head == full.token_ids[:3]
    chat = [{"role": "user", "content": "something else"}]
    after = engine.generate(chat, max_tokens=6, temperature=0)  # ends the open stream first
    with pytest.raises(DsfpError, match="this stream was ended by a later call on its engine"):
        next(stream)
    assert stream.generation is None
    with Engine(converted, device="cpu", max_context=64) as fresh:
        assert after.token_ids == fresh.generate(chat, max_tokens=6, temperature=0).token_ids
    engine.reset()
    assert engine.generate(chat, max_tokens=2, temperature=0).stats.cached_tokens == 0


def test_options_chat_messages_and_token_ids(engine):
    system = "Be brief."
    by_text = engine.encode(PROMPT, system=system)
    assert by_text == engine.encode([{"role": "system", "content": system}, {"role": "user", "content": PROMPT}])
    assert engine.encode([{"role": "user", "content": PROMPT}], system=system) == by_text
    assert engine.encode(by_text) == by_text and engine.encode(np.array(by_text)) == by_text
    assert engine.encode(PROMPT, raw=True) == engine.tokenizer.encode(PROMPT)
    g = engine.generate(PROMPT, max_tokens=3, temperature=0, stop=["zzz-never"])
    assert len(g.token_ids) == 3 and engine.options.stop == ()  # per-call options leave the engine's alone


def test_cancel_ends_a_generation_at_the_next_token_with_the_cache_consistent(converted, engine):
    cancel = threading.Event()
    stream = engine.stream(PROMPT, max_tokens=20, temperature=0, cancel=cancel)
    first = next(stream)
    cancel.set()
    rest = list(stream)
    g = stream.generation
    assert g.finish_reason == "cancelled" and g.token_ids == [first.token_id] and not [d for d in rest if d.token_id]
    assert engine.generate(PROMPT, max_tokens=5, cancel=cancel).finish_reason == "cancelled"  # before the prefill
    again = engine.generate(PROMPT, max_tokens=6, temperature=0)
    with Engine(converted, device="cpu", max_context=64) as fresh:
        assert again.token_ids == fresh.generate(PROMPT, max_tokens=6, temperature=0).token_ids


def test_one_call_at_a_time(engine):
    stream = engine.stream(PROMPT, max_tokens=4, temperature=0)
    next(stream)
    errors = []

    def other() -> None:
        with engine._busy:  # hold the engine as a running step does
            done.set()
            release.wait(5)

    done, release = threading.Event(), threading.Event()
    t = threading.Thread(target=other)
    t.start()
    done.wait(5)
    for call in (lambda: next(stream), lambda: engine.generate(PROMPT, max_tokens=2), lambda: engine.logits([1, 2])):
        try:
            call()
        except DsfpError as e:
            errors.append(str(e))
    release.set()
    t.join()
    assert len(errors) == 3 and all("busy in another thread" in e for e in errors)
    assert len(list(stream)) >= 1  # the stream goes on once the engine is free


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda e: e.generate([]), "the prompt must be text"),
        (lambda e: e.generate([{"role": "user"}]), "message 0: content must be text, not None"),
        (lambda e: e.generate([{"role": "user", "content": 3}]), "content must be text, not 3"),
        (lambda e: e.generate([{"role": "usr", "content": "hi"}]), "message 0: role 'usr' is not one of system"),
        (lambda e: e.generate([{"role": ["x"], "content": "hi"}]), "role ['x'] is not one of"),
        (lambda e: e.generate(5), "the prompt must be text"),
        (lambda e: e.generate(None), "the prompt must be text"),
        (lambda e: e.generate(PROMPT, system=5), "system must be text or None"),
        (lambda e: e.generate(PROMPT, raw="yes"), "raw true or false"),
        (lambda e: e.generate(PROMPT, max_tokens="8"), "option max_tokens: expected an integer, found a string '8'"),
        (lambda e: e.generate(PROMPT, temperature="0"), "option temperature: expected a number"),
        (lambda e: e.generate(PROMPT, top_k=1.5), "option top_k: expected an integer, found a number 1.5"),
        (lambda e: e.generate(PROMPT, seed="x"), "option seed: expected an integer"),
        (lambda e: e.generate(PROMPT, stop=5), "option stop: expected a list of strings"),
        (lambda e: e.generate([1, 2, 10**9]), "token id 1000000000 is outside the vocabulary"),
        (lambda e: e.generate([1, 2], system="x"), "system, raw and thinking apply to text prompts"),
        (lambda e: e.generate([1, 2], thinking=True), "not to token ids"),
        (lambda e: e.generate(PROMPT, thinking=True), "no thinking switch"),
        (lambda e: e.generate(PROMPT, thinking="yes"), "thinking must be true, false or None"),
        (lambda e: e.generate(PROMPT, max_tokens=0), "--max-tokens 0: give at least 1"),
        (lambda e: e.generate(PROMPT, temperature=-1), "--temperature must be >= 0"),
        (lambda e: e.generate(PROMPT, stop=[""]), "empty stop string"),
        (lambda e: e.logits(list(range(3, 70))), "the prompt is 67 tokens; the context holds 64"),
        (lambda e: e.logits(PROMPT), "logits takes token ids"),
        (lambda e: e.generate(PROMPT, raw=True, system="x"), "which raw skips"),
    ],
)
def test_bad_arguments_are_one_line_errors(engine, call, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        call(engine)


def test_unknown_options_and_a_closed_engine(converted):
    with pytest.raises(ConfigError, match="unknown option max_tokenz"):
        Engine(converted, device="cpu", max_tokenz=3)
    with pytest.raises(ConfigError, match="option gpu_mem: expected a string, found an integer 5"):
        Engine(converted, device="cpu", gpu_mem=5)
    with pytest.raises(ConfigError, match="Engine takes a model folder and RunOptions"):
        Engine(5)
    with pytest.raises(ConfigError, match="Engine takes a model folder and RunOptions"):
        Engine(converted, {"device": "cpu"})
    engine = Engine(str(converted), device="cpu", max_context=64)
    assert engine.plan.gpu_slots > 0
    engine.close()
    engine.close()  # twice is fine
    assert engine.model is None
    with pytest.raises(DsfpError, match="this engine is closed"):
        engine.generate(PROMPT)
    with pytest.raises(DsfpError, match="this engine is closed"):
        engine.logits([1, 2])


def test_run_json_flag_combinations(converted):
    r = run_cli("run", converted, "--plan", "--json", "--device", "cpu")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["gpu_slots"] > 0 and plan["budgets"]["gpu"] > 0
    r = run_cli("run", converted, "--chat", "--json", "--device", "cpu")
    assert r.exit_code == 2 and "--json applies to --prompt" in r.stderr


def test_public_names_are_few_and_documented():
    assert sorted(dsfp4.__all__) == ["DsfpError", "Engine", "Generation", "RunOptions", "__version__"]
    for name in ("Engine", "Generation", "RunOptions", "DsfpError"):
        assert getattr(dsfp4, name).__doc__
    for method in ("generate", "stream", "logits", "encode", "reset", "close"):
        assert getattr(Engine, method).__doc__
    with pytest.raises(AttributeError):
        dsfp4.Nope  # noqa: B018


@pytest.mark.gpu
def test_twenty_engines_created_and_closed_on_cuda_do_not_grow_memory(converted):
    """Closing frees the device memory (torch's allocated and reserved bytes) and the pinned RAM cache."""
    from dsfp4.runtime.plan.budget import process_rss

    cuda = torch.device("cuda")

    def cycle() -> None:
        with Engine(converted, device="cuda", max_context=64, cpu_mem="8G") as engine:
            engine.generate(PROMPT, max_tokens=4, temperature=0)

    cycle()  # CUDA context, cuBLAS and Triton's compiled kernels stay for the process
    base = (torch.cuda.memory_allocated(cuda), torch.cuda.memory_reserved(cuda), process_rss())
    for _ in range(20):
        cycle()
    now = (torch.cuda.memory_allocated(cuda), torch.cuda.memory_reserved(cuda), process_rss())
    assert now[0] == base[0] and now[1] == base[1]
    assert now[2] - base[2] < 64 << 20, f"RSS grew by {(now[2] - base[2]) >> 20} MiB over 20 engines"
