"""`dsfp4 export MODEL OUT`: a converted model as another engine's checkpoint (convert/export/)."""

from __future__ import annotations

from pathlib import Path

import click

from dsfp4.cli.options import EXISTING_DIR, PATH
from dsfp4.convert.export.targets import FORMATS
from dsfp4.units import format_bytes


@click.command()
@click.argument("model", type=EXISTING_DIR)
@click.argument("out", type=PATH)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(list(FORMATS)),
    required=True,
    help="compressed-tensors: the checkpoint vLLM and SGLang load (FP4 experts and FP8 blocks as they are stored). "
    "modelopt: NVIDIA's NVFP4 layout (TensorRT-LLM, vLLM, SGLang), weight-only: NVFP4 as stored, FP8 blocks as "
    "BF16, no activation scales; MXFP4 experts refused. "
    "gguf: OUT/model.gguf for llama.cpp (MXFP4 experts as they are stored; FP8 matrices requantized to Q8_0, the "
    "error reported; a model with NVFP4 experts converts again with --format mxfp4).",
)
@click.option(
    "--requantize",
    is_flag=True,
    help="With --format gguf: NVFP4 experts requantized to MXFP4 (the error reported) instead of refused.",
)
@click.option(
    "--accept-cold-loss",
    is_flag=True,
    help="Export a model whose cold records profile-hot --repack --cold-bits narrowed: widened to the model's FP4, "
    "their loss kept, and labelled (dsfp4_cold_records in config.json, dsfp4.cold_records in the GGUF). Refused "
    "without it.",
)
@click.option("--dry-run", is_flag=True, help="Print the shards and their sizes; write nothing.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def export(
    model: Path, out: Path, fmt: str, requantize: bool, accept_cold_loss: bool, dry_run: bool, quiet: bool
) -> None:
    """Write the converted MODEL into OUT as another engine's checkpoint, from the stored bytes (compressed-tensors
    quantizes nothing again; GGUF only the FP8 matrices), each checked against its sha256 as `run` checks it. Safe to
    interrupt: a rerun keeps what was written whole.

    \b
    Examples:
      dsfp4 export model/ model-ct/ --format compressed-tensors --dry-run
      dsfp4 export model/ model-ct/ --format compressed-tensors && vllm serve model-ct/
      dsfp4 export model/ model-mo/ --format modelopt
      dsfp4 export model-mxfp4/ model-gguf/ --format gguf && llama-cli -m model-gguf/model.gguf
    """
    from dsfp4.convert.export.writer import describe, describe_gguf, export_gguf
    from dsfp4.convert.export.writer import export as write_export

    if requantize and fmt != "gguf":
        raise click.UsageError(f"--requantize applies to --format gguf; --format {fmt} writes experts as stored")
    if fmt == "gguf":
        tensors, errors = export_gguf(model, out, dry_run, not quiet, requantize, accept_cold_loss)
        if dry_run:
            click.echo(describe_gguf(tensors))
        elif not quiet:
            click.echo(
                f"{out}/model.gguf: {len(tensors)} tensors, {format_bytes(sum(t.nbytes for t in tensors))}", err=True
            )
            for klass, err in sorted(errors.items()):
                click.echo(f"  requantization error {klass:<28} {err:.4g} (relative RMS)", err=True)
        _cold_note(model, accept_cold_loss)
        return

    shards = write_export(model, out, fmt, dry_run, not quiet, accept_cold_loss)
    if dry_run:
        click.echo(describe(shards))
    elif not quiet:
        click.echo(f"{out}: {len(shards)} shards, {format_bytes(sum(s.nbytes for s in shards))} ({fmt})", err=True)
    _cold_note(model, accept_cold_loss)


def _cold_note(model: Path, accept_cold_loss: bool) -> None:
    """--accept-cold-loss: the loss the export carries, stated (as its metadata labels it)."""
    from dsfp4.convert.export.fidelity import cold_label
    from dsfp4.convert.export.writer import open_model

    if not accept_cold_loss:
        return
    label = cold_label(open_model(model), True, model)
    note = f"{label['note']}; the export's metadata says so" if label else f"{model} has no cold records: exact"
    click.echo(f"note: --accept-cold-loss: {note}", err=True)
