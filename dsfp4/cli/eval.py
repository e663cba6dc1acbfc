"""`dsfp4 eval MODEL --text FILE`: perplexity over a text, and KL divergence against a saved reference
(dsfp4/tools/evaluate.py holds the contract)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from tqdm import tqdm

from dsfp4.cli.options import (
    CUDA_GRAPH,
    EXISTING_DIR,
    EXISTING_FILE,
    PATH,
    ZERO_COPY,
    budget_options,
    prefill_chunk_option,
    quiet_option,
    routing_options,
    store_options,
)
from dsfp4.errors import ConfigError
from dsfp4.layout.atomic import require_folder
from dsfp4.runtime.options import RunOptions
from dsfp4.tools.eval_defaults import DEFAULT_CONTEXT, DEFAULT_TOP_K


def _text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--text {path}: not UTF-8 text (byte {e.start}); give a UTF-8 text file") from e
    if not text.strip():
        raise ConfigError(f"--text {path}: the file is empty; give a text to score")
    return text


@click.command("eval")
@click.argument("model", type=EXISTING_DIR)
@click.option("--text", "text_file", type=EXISTING_FILE, required=True, help="UTF-8 text to score.")
@click.option(
    "--context",
    type=click.IntRange(min=2),
    default=DEFAULT_CONTEXT,
    show_default=True,
    help="Tokens per window, the BOS included where the tokenizer adds one.",
)
@click.option(
    "--stride",
    type=click.IntRange(min=1),
    help="Text tokens between window starts (default: --context - 1, no overlap after the BOS); a smaller stride "
    "gives each scored token more context.",
)
@click.option("--save-logits", type=PATH, help="Write each scored position's top log-probabilities here (a reference).")
@click.option(
    "--save-top-k",
    type=click.IntRange(min=1),
    default=DEFAULT_TOP_K,
    show_default=True,
    help="Log-probabilities kept per position by --save-logits.",
)
@click.option(
    "--reference",
    type=EXISTING_FILE,
    help="Compare with this --save-logits file of the same text: KL divergence, top-1 agreement, perplexity ratio.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON object.")
@prefill_chunk_option(DEFAULT_CONTEXT)
@budget_options
@store_options
@routing_options
@CUDA_GRAPH
@ZERO_COPY
@quiet_option
def eval_command(
    model: Path,
    text_file: Path,
    context: int,
    stride: int | None,
    save_logits: Path | None,
    save_top_k: int,
    reference: Path | None,
    as_json: bool,
    quiet: bool,
    **knobs,
) -> None:
    """Perplexity of MODEL over a text in windows of --context tokens, through the prefill `dsfp4 run` uses (every
    run flag applies); with --save-logits a reference to compare another conversion or option against.

    \b
    Examples:
      dsfp4 eval model/ --text wiki.txt --save-logits exact.lp
      dsfp4 eval model/ --text wiki.txt --reference exact.lp --preset 16g --json
    """
    from dsfp4.layout.manifest import Manifest
    from dsfp4.runtime.engine import Engine
    from dsfp4.runtime.generate.tokenizer import ChatTokenizer
    from dsfp4.runtime.store.counters import counters_since
    from dsfp4.tools import logprobs_file
    from dsfp4.tools.evaluate import check_reference, evaluate, header, scored_targets, windows

    if save_logits is not None:
        require_folder(save_logits, "--save-logits")
    options = RunOptions(**knobs, max_context=context)
    args = Manifest.open(model).args
    if context > args.max_seq_len:
        raise ConfigError(
            f"--context {context}: {model} holds at most {args.max_seq_len} positions; give a smaller one"
        )
    # the text is checked before the model loads
    tok = ChatTokenizer(model, args.eos_token_ids)
    bos = tok.add_bos and tok.bos_id is not None
    ids = tok.encode(_text(text_file), special=False)
    wins = windows(len(ids), context, stride, bos)
    if not wins:
        raise ConfigError(
            f"--text {text_file}: {len(ids)} tokens, shorter than one window of {context - bos} text tokens; "
            "give a longer text or a smaller --context"
        )
    stride = stride or context - 1
    ours = header(args.vocab_size, context, stride, bos, str(model))
    ref = logprobs_file.read(reference) if reference is not None else None
    if ref is not None:
        check_reference(str(reference), ref[0], ref[1], ours, scored_targets(ids, wins))
    bar = tqdm(total=len(wins), unit="window", desc="eval", disable=quiet, file=sys.stderr)
    with Engine(model, options) as engine, bar:
        for note in engine.notes if not quiet else ():
            bar.write(f"note: {note}", file=sys.stderr)
        store, before = engine.model.experts, engine.model.experts.counters.snapshot()
        result = evaluate(
            engine.logits,
            ids,
            wins,
            tok.bos_id if bos else None,
            context,
            stride,
            save_top_k,
            ref[1] if ref is not None else None,
            lambda done, _: bar.update(done - bar.n),
        )
        moved = counters_since(store.counters.snapshot(), before)
    if save_logits is not None:
        logprobs_file.write(save_logits, ours, result.logprobs)
    uses = moved["expert_uses"]
    r = result.to_dict() | {
        # prefill's: every window from position 0
        "ssd_bytes_per_token": moved["ssd_bytes"] / result.tokens,
        # of the experts chosen, per layer step
        "skipped_share": moved["skipped"] / max(uses + moved["skipped"], 1),
    }
    if as_json:
        click.echo(json.dumps(r))
        return
    click.echo(
        f"perplexity {r['perplexity']:.4f} over {r['tokens']:,} tokens ({r['windows']} windows of {context}, "
        f"stride {stride}; {r['tok_s']:.0f} tok/s)"
    )
    if ref is not None:
        click.echo(
            f"against {reference}: KL mean {r['kl_mean']:.4g}, p99 {r['kl_p99']:.4g}; top-1 agreement "
            f"{100 * r['top1_agreement']:.2f}%; perplexity ratio {r['perplexity_ratio']:.4f} "
            f"(reference {r['reference_perplexity']:.4f})"
        )
    if r["skipped_share"]:
        click.echo(f"the expert threshold left out {r['skipped_share']:.1%} of the chosen experts")
    if save_logits is not None:
        click.echo(f"log-probabilities of {r['tokens']:,} positions (top {save_top_k}): {save_logits}", err=True)
