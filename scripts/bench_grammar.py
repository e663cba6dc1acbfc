"""What constrained decoding costs per token (runtime/generate/answer/grammar.py): compiling, each step's mask
(llguidance filling it on the host, applying it to the logits on the device, taking the token), and decode speed with
and without a grammar.

    python scripts/bench_grammar.py MODEL [--device cuda] [--max-tokens 128] [--steps 200] [--json OUT]

Rows: the tokenizer's build for llguidance and a schema's first compile (a second is cached); per step of a walk
through the schema's answer (a token drawn from random logits under the mask each step), the fill, the apply
(synchronized on CUDA) and the accept, in microseconds; then greedy decoding of one prompt to --max-tokens: plain
(the fast path, choosing on the device), with rules but no grammar (a repetition penalty of 1.01: the host reads each
token), and under the schema (whose answer ends where its JSON does).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch

from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.answer.grammar import Grammar
from dsfp4.runtime.generate.answer.grammar_matcher import GrammarCompiler

# an answer of a known length on any model: 16 strings of at most 12 characters
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 16, "maxItems": 16}
    },
    "required": ["items"],
    "additionalProperties": False,
}
PROMPT = "List sixteen fruits as JSON."


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compile(engine: Engine, grammar: Grammar) -> dict:
    """A fresh compiler: the tokenizer's build with the first compile, then the schema again (cached)."""
    compiler = GrammarCompiler(
        engine.model_dir / "tokenizer.json", engine.model.args.vocab_size, engine.tokenizer.eos_ids
    )
    t0 = time.perf_counter()
    compiler.llguidance()
    t1 = time.perf_counter()
    compiler.compile(grammar)
    t2 = time.perf_counter()
    compiler.compile(grammar)
    t3 = time.perf_counter()
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "cached_compile_s": t3 - t2, "compiler": compiler}


def _walk(compiler: GrammarCompiler, grammar: Grammar, device: torch.device, vocab: int, steps: int) -> dict:
    """Per-step times of a walk through the grammar's answer, from seeded random logits [V] on `device`."""
    gen = torch.Generator(device).manual_seed(0)
    matcher, fill, apply, accept, n = compiler.matcher(grammar), 0.0, 0.0, 0.0, 0
    while n < steps and not matcher.done:
        logits = torch.randn(vocab, device=device, generator=gen)
        _sync(device)
        t0 = time.perf_counter()
        allowed = matcher.allowed(device)
        _sync(device)
        t1 = time.perf_counter()
        masked = logits.masked_fill(~allowed[:vocab], float("-inf"))
        token = int(masked.argmax())
        t2 = time.perf_counter()
        matcher.accept(token)
        t3 = time.perf_counter()
        fill, apply, accept, n = fill + t1 - t0, apply + t2 - t1, accept + t3 - t2, n + 1
    return {"steps": n, "fill_us": 1e6 * fill / n, "apply_us": 1e6 * apply / n, "accept_us": 1e6 * accept / n}


def _decode(engine: Engine, max_tokens: int, **knobs) -> dict:
    ids = engine.encode(PROMPT)
    engine.generate(ids, max_tokens=2, temperature=0, **knobs)  # warm: the prompt's KV is reused below
    g = engine.generate(ids, max_tokens=max_tokens, temperature=0, **knobs)
    tokens = max(g.stats.generated_tokens - 1, 1)
    return {"tokens": g.stats.generated_tokens, "tok_s": tokens / max(g.stats.decode_s, 1e-9), "text": g.text[:60]}


@click.command()
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=128, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True, help="Steps of the mask walk.")
@click.option("--json", "out", type=click.Path(path_type=Path), help="Also write the numbers here.")
def main(model: Path, device: str, max_tokens: int, steps: int, out: Path | None) -> None:
    grammar = Grammar.json_schema(SCHEMA)
    with Engine(model, device=device, max_context=max(512, 2 * max_tokens)) as engine:
        vocab, where = engine.model.args.vocab_size, f"device {engine.device}, {engine.decode_mode}"
        compiled = _compile(engine, grammar)
        walk = _walk(compiled.pop("compiler"), grammar, engine.device, vocab, steps)
        decode = {
            "plain": _decode(engine, max_tokens),
            "rules, no grammar": _decode(engine, max_tokens, repetition_penalty=1.01),
            "json schema": _decode(engine, max_tokens, grammar=grammar),
        }
    ms = {k: v * 1e3 for k, v in compiled.items()}
    click.echo(f"{where}, vocab {vocab}")
    click.echo(f"tokenizer for llguidance {ms['tokenizer_s']:.1f} ms; schema compile {ms['compile_s']:.1f} ms")
    click.echo(f"a cached compile {ms['cached_compile_s'] * 1e3:.1f} us")
    n, fill, apply, accept = walk["steps"], walk["fill_us"], walk["apply_us"], walk["accept_us"]
    click.echo(f"mask per step ({n} steps): fill+copy {fill:.1f} us, apply {apply:.1f} us, accept {accept:.1f} us")
    click.echo(f"{'decode':<20}{'tokens':>8}{'tok/s':>10}")
    for name, row in decode.items():
        click.echo(f"{name:<20}{row['tokens']:>8}{row['tok_s']:>10.1f}")
    if out is not None:
        out.write_text(json.dumps({"compile": compiled, "mask": walk, "decode": decode}, indent=2) + "\n")


if __name__ == "__main__":
    main()
