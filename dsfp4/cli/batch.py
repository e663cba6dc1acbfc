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
from pathlib import Path

import click
from tqdm import tqdm

from dsfp4.errors import ConfigError
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.generation import Generation
from dsfp4.tools.batch_file import BatchItem, append_result


def run_batch(
    engine: Engine, batch: Path, items: list[BatchItem], done: set[int], output: Path, system: str | None, quiet: bool
) -> None:
    """Answer the items whose lines are not `done` (batch_file.answered) into `output`."""
    todo = []
    # every prompt checked before the first answer
    for item in (i for i in items if i.line not in done):
        try:
            ids = engine.encode(item.prompt, system, item.raw)
            engine.check_prompt(ids, room=1)
        except ConfigError as e:
            raise ConfigError(f"{batch}:{item.line}: {e}") from None
        todo.append((item, ids))
    if done and not quiet:
        click.echo(f"{output}: {len(done)} lines already answered; answering the other {len(todo)}", err=True)
    start = time.perf_counter()
    if engine.prompt_cache is not None and len(todo) > 1:
        joint = engine.prefill_together([ids for _, ids in todo])
        if joint and not quiet:
            seconds = time.perf_counter() - start
            click.echo(f"{joint} prompt tokens prefilled layer by layer together in {seconds:.1f} s", err=True)
    tokens = 0
    with open(output, "a", encoding="utf-8") as f, tqdm(total=len(todo), unit="line", disable=quiet) as bar:
        for item, g in answers(engine, todo):
            append_result(f, item, g.to_dict())
            tokens += len(g.token_ids)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s", refresh=False)
            bar.update()
    if not quiet:
        seconds = time.perf_counter() - start
        speed = tokens / max(seconds, 1e-9)
        batch = f", up to {engine.plan.max_batch} decoded together" if engine.plan.max_batch > 1 else ""
        click.echo(f"{len(todo)} lines, {tokens} tokens in {seconds:.1f} s ({speed:.1f} tok/s{batch})", err=True)


def answers(engine: Engine, todo: list[tuple[BatchItem, list[int]]]) -> Iterator[tuple[BatchItem, Generation]]:
    """Each item's generation, in input order: one after another, or decoded together up to the plan's max_batch
    (those that end early wait here for the lines before them)."""
    if engine.plan.max_batch < 2:
        for item, ids in todo:
            yield item, engine.generate(ids, **item.sampling)
        return
    requests = [(ids, engine.options_for(**item.sampling)) for item, ids in todo]
    ended: dict[int, Generation] = {}
    nxt = 0
    for i, g in engine.generate_batch(requests):
        ended[i] = g
        while nxt in ended:
            yield todo[nxt][0], ended.pop(nxt)
            nxt += 1
