"""`dsfp4 export MODEL OUT`: a converted model as another engine's checkpoint (convert/export/)."""

from __future__ import annotations

from pathlib import Path

import click

from dsfp4.cli.options import EXISTING_DIR, PATH


@click.command()
@click.argument("model", type=EXISTING_DIR)
@click.argument("out", type=PATH)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["compressed-tensors"]),
    required=True,
    help="compressed-tensors: the checkpoint vLLM and SGLang load (FP4 experts and FP8 blocks as they are stored).",
)
@click.option("--dry-run", is_flag=True, help="Print the shards and their sizes; write nothing.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def export(model: Path, out: Path, fmt: str, dry_run: bool, quiet: bool) -> None:
    """Write the converted MODEL into OUT as another engine's checkpoint, from the stored bytes (nothing is
    quantized again). Safe to interrupt: a rerun keeps the shards already written.

    \b
    Examples:
      dsfp4 export model/ model-ct/ --format compressed-tensors --dry-run
      dsfp4 export model/ model-ct/ --format compressed-tensors && vllm serve model-ct/
    """
    from dsfp4.convert.export.writer import describe
    from dsfp4.convert.export.writer import export as write_export

    shards = write_export(model, out, fmt, dry_run=dry_run, progress=not quiet)
    if dry_run:
        click.echo(describe(shards))
    elif not quiet:
        click.echo(f"{out}: {len(shards)} shards, {sum(s.nbytes for s in shards) / 2**30:.2f} GiB ({fmt})", err=True)
