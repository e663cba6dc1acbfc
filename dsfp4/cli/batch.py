"""`dsfp4 run MODEL --batch IN --output OUT`: answer every line of IN into OUT (dsfp4/tools/batch_file.py), one after
another, with a progress bar and the aggregate speed; a rerun answers only the lines OUT lacks.

The lines run one at a time through the engine, which keeps the KV of the prefix a line shares with the one before
it (a shared system prompt is prefilled once; with --prompt-cache, once across runs). With --prompt-cache the prompts
are first prefilled together, layer by layer (Engine.prefill_together: each layer's records read once for all the
lines, not once per line), and each line's generation restores its prompt from there. With --max-batch above 1 (by
default the mode's) the lines decode together, a new one joining as one ends (Engine.generate_batch).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from dsfp4.errors import ConfigError
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.answer.answer_format import AnswerFormat
from dsfp4.runtime.generate.answer.tool_scan import ToolCallError
from dsfp4.runtime.generate.generation import Generation
from dsfp4.tools.batch_file import BatchItem, append_result


def run_batch(
    engine: Engine, batch: Path, items: list[BatchItem], done: set[int], output: Path, system: str | None, quiet: bool
) -> None:
    """Answer the items whose lines are not `done` (batch_file.answered) into `output`."""
    todo = []
    # every prompt and answer format checked before the first answer
    for item in (i for i in items if i.line not in done):
        try:
            todo.append(_line(engine, item, system))
        except ConfigError as e:
            raise ConfigError(f"{batch}:{item.line}: {e}") from None
    if done and not quiet:
        click.echo(f"{output}: {len(done)} lines already answered; answering the other {len(todo)}", err=True)
    start = time.perf_counter()
    if engine.prompt_cache is not None and len(todo) > 1:
        joint = engine.prefill_together([line.ids for line in todo])
        if joint and not quiet:
            seconds = time.perf_counter() - start
            click.echo(f"{joint} prompt tokens prefilled layer by layer together in {seconds:.1f} s", err=True)
    tokens = 0
    with open(output, "a", encoding="utf-8") as f, tqdm(total=len(todo), unit="line", disable=quiet) as bar:
        for line, g in answers(engine, todo):
            append_result(f, line.item, _result(engine, line, g))
            tokens += len(g.token_ids)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s", refresh=False)
            bar.update()
    if not quiet:
        seconds = time.perf_counter() - start
        speed = tokens / max(seconds, 1e-9)
        batch = f", up to {engine.plan.max_batch} decoded together" if engine.plan.max_batch > 1 else ""
        click.echo(f"{len(todo)} lines, {tokens} tokens in {seconds:.1f} s ({speed:.1f} tok/s{batch})", err=True)


@dataclass(frozen=True)
class Line:
    """An item ready to answer: its prompt's ids, its sampling (the answer format's grammar among it), its format."""

    item: BatchItem
    ids: list[int]
    sampling: dict[str, Any]
    fmt: AnswerFormat
    # the prompt leaves the model thinking (R1's <think>)
    thinking: bool


def _line(engine: Engine, item: BatchItem, system: str | None) -> Line:
    fmt = AnswerFormat.of(engine.tokenizer, **item.answer)
    ids = engine.encode(item.prompt, system, item.raw, tools=fmt.prompt_tools)
    engine.check_prompt(ids, room=1)
    thinking, sampling = engine.opens_thinking(ids), dict(item.sampling)
    if (grammar := fmt.grammar(engine.tokenizer, thinking)) is not None:
        engine.grammars.compile(grammar)
        sampling["grammar"] = grammar
    return Line(item, ids, sampling, fmt, thinking)


def _result(engine: Engine, line: Line, g: Generation) -> dict:
    """What the output line holds: the generation, its tool calls read where the line offers tools (or why not)."""
    try:
        line.fmt.finish(g, engine.tokenizer, line.thinking)
    except ToolCallError as e:
        return {**g.to_dict(), "error": str(e)}
    return g.to_dict()


def answers(engine: Engine, todo: list[Line]) -> Iterator[tuple[Line, Generation]]:
    """Each item's generation, in input order: one after another, or decoded together up to the plan's max_batch
    (those that end early wait here for the lines before them)."""
    if engine.plan.max_batch < 2:
        for line in todo:
            yield line, engine.generate(line.ids, **line.sampling)
        return
    requests = [(line.ids, engine.options_for(**line.sampling)) for line in todo]
    ended: dict[int, Generation] = {}
    nxt = 0
    for i, g in engine.generate_batch(requests):
        ended[i] = g
        while nxt in ended:
            yield todo[nxt], ended.pop(nxt)
            nxt += 1
