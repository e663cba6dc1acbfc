"""Batched decode on one engine: B sequences decoding together (runtime/generate/batch.py) against one at a time, with
what the expert store moved per token and the union of experts a layer step needed.

    python scripts/bench_batch.py MODEL [--batches 1,2,4,8,16] [--share 16g --family v3] [--preset 80g]
                                        [--routing TRACE --routing-recall 0.9] [--prompt-tokens 16] [--max-tokens 48]
                                        [--json OUT]

--share puts MODEL (a bench model of --family) at the whole model's share of that machine's budgets, as `dsfp4 bench
--project` does; without it MODEL runs under --preset. Every answer runs to --max-tokens (EOS is ignored: a random
model's would end answers at random lengths). For each B a short batch runs first, untimed (it captures the CUDA
graphs of that size's spans); then B prompts of --prompt-tokens distinct token ids are prefilled, and the batch's
decode steps are timed until every sequence has its tokens. The row "1 (graph)" is the single-sequence path
(Engine.generate: CUDA graphs).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch

from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.stats import ratio
from dsfp4.runtime.models.load import plan_engine
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.store.counters import counters_since


def _prompts(b: int, n: int, first: int, vocab: int) -> list[list[int]]:
    """b prompts of n token ids, none shared (the routing of a trained model differs by prompt)."""
    return [[(first + 7919 * i + 31 * j) % (vocab - 1) + 1 for j in range(n)] for i in range(b)]


def _measure(engine: Engine, b: int, n: int, max_tokens: int, first: int) -> dict:
    """B sequences prefilled, then decoded together -> aggregate decode tok/s and the store's traffic per token."""
    opts = engine.options_for(max_tokens=max_tokens, temperature=0)
    run, counters = engine.batch(), engine.model.experts.counters
    seqs = [run.add(p, opts) for p in _prompts(b, n, first, engine.model.args.vocab_size)]
    before, t0 = counters.snapshot(), time.perf_counter()
    while run.busy:
        run.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    seconds = time.perf_counter() - t0
    return _row(
        str(b),
        sum(len(s.generation.token_ids) - 1 for s in seqs),
        seconds,
        counters_since(counters.snapshot(), before),
        b,
    )


def _single(engine: Engine, n: int, max_tokens: int, first: int) -> dict:
    """One sequence through Engine.generate (CUDA graphs where they capture)."""
    counters, prompt = engine.model.experts.counters, _prompts(1, n, first, engine.model.args.vocab_size)[0]
    engine.generate(prompt, max_tokens=1, temperature=0)  # the prompt's prefill, kept: the next call feeds one token
    before = counters.snapshot()
    g = engine.generate(prompt, max_tokens=max_tokens, temperature=0)
    return _row(
        "1 (graph)", g.stats.generated_tokens - 1, g.stats.decode_s, counters_since(counters.snapshot(), before), 1
    )


def _row(label: str, tokens: int, seconds: float, store: dict, b: int) -> dict:
    uses = store.get("expert_uses", 0)
    return {
        "batch": label,
        "tokens": tokens,
        "seconds": seconds,
        "aggregate_tok_s": ratio(tokens, seconds),
        "per_sequence_tok_s": ratio(tokens, seconds) / b,
        "union_per_layer_step": ratio(uses, store.get("layer_steps", 0)),
        "ssd_mb_per_token": ratio(store.get("ssd_bytes", 0), tokens) / 1e6,
        "h2d_mb_per_token": ratio(store.get("h2d_bytes", 0), tokens) / 1e6,
        "device_hit": ratio(store.get("gpu_hits", 0), uses),
        "ram_hit": ratio(store.get("ram_hits", 0), uses),
        "store": store,
    }


def _show(r: dict, single: dict) -> None:
    if r is single:
        heads = ("batch", "tok/s", "x single", "per seq", "union", "SSD MB/t", "H2D MB/t", "dev hit", "RAM hit")
        click.echo(" ".join(f"{h:>9}" for h in heads))
    click.echo(
        f"{r['batch']:>9} {r['aggregate_tok_s']:9.1f} {ratio(r['aggregate_tok_s'], single['aggregate_tok_s']):9.2f} "
        f"{r['per_sequence_tok_s']:9.1f} {r['union_per_layer_step']:9.1f} {r['ssd_mb_per_token']:9.2f} "
        f"{r['h2d_mb_per_token']:9.2f} {r['device_hit']:9.1%} {r['ram_hit']:9.1%}"
    )


@click.command()
@click.argument("model", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--batches", default="1,2,4,8,16", show_default=True)
@click.option("--share", type=click.Choice(["16g", "24g"]), help="The whole model's share of this machine's budgets.")
@click.option("--family", type=click.Choice(["v3", "v4"]), default="v3", show_default=True)
@click.option("--preset", default=None, help="Budgets without --share (e.g. 80g).")
@click.option("--routing", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--routing-recall", type=float, default=0.9, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(1), default=16, show_default=True)
@click.option("--max-tokens", type=click.IntRange(2), default=48, show_default=True)
@click.option("--max-context", type=click.IntRange(2), default=512, show_default=True)
@click.option("--json", "out", type=click.Path(path_type=Path))
def main(
    model: Path,
    batches: str,
    share: str | None,
    family: str,
    preset: str | None,
    routing: Path | None,
    routing_recall: float,
    prompt_tokens: int,
    max_tokens: int,
    max_context: int,
    out: Path | None,
) -> None:
    sizes = [int(b) for b in batches.split(",")]
    options = RunOptions(
        preset=preset, max_batch=max(sizes), max_context=max_context, routing=routing, routing_recall=routing_recall
    )
    plan = plan_engine(model, options)
    if share is not None:
        from dsfp4.layout.manifest import Manifest
        from dsfp4.projection.bench_check import whole_model_share

        plan = whole_model_share(plan, Manifest.open(model), family, share)
    rows = []
    with Engine(model, options, plan=plan) as engine:
        engine.tokenizer.eos_ids = frozenset()  # every answer runs to max_tokens (see the module's doc)
        click.echo(f"plan: {plan.gpu_slots} device and {plan.ram_slots} RAM slots of {plan.total_records}", err=True)
        rows.append(_single(engine, prompt_tokens, max_tokens, first=10))
        _show(rows[-1], rows[0])
        graphs = engine.decoder.graphs
        for b in sizes:
            if graphs is not None and graphs.why_eager_batch(b) is None:  # its graphs are captured untimed first
                _measure(engine, b, prompt_tokens, max_tokens // 4 + 2, first=100_000 + b)
            rows.append(_measure(engine, b, prompt_tokens, max_tokens, first=10 + 20_000 * b))
            _show(rows[-1], rows[0])  # as each comes: a run cut short keeps what it measured
        device, mode = str(engine.device), engine.decode_mode
    if out is not None:
        meta = {"model": str(model), "share": share, "preset": preset, "routing": str(routing), "device": device}
        out.write_text(
            json.dumps({**meta, "single_mode": mode, "plan": [plan.gpu_slots, plan.ram_slots], "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
