"""The commands over model folders: `dsfp4 convert` (a Hugging Face checkpoint into layout v1), `inspect` (what a
converted model holds) and `verify` (every file and record against the manifest)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from tqdm import tqdm

from dsfp4.cli.options import EXISTING_DIR, PATH, given_flags, hub_options, only_with, quiet_option
from dsfp4.runtime.plan.budget import PRESETS
from dsfp4.units import format_bytes


def backbone_chooser(preset: str | None):
    """--backbone auto's chooser (projection/backbone_choice.py), sized for `preset` or this machine's GPU; it says what
    it chose on stderr. None with neither: the converter takes fp8."""
    import torch

    from dsfp4.kernels.kernel_paths import kernel_paths
    from dsfp4.projection.backbone_choice import card_budget, choose_backbone
    from dsfp4.projection.machines import USER_PROCESS
    from dsfp4.runtime.plan.budget import Budgets

    # a preset's card runs the kernels; this machine's card runs what its paths say
    kernels = fp8_kernels = True
    if preset is not None:
        budgets = Budgets(PRESETS[preset].gpu, PRESETS[preset].cpu, f"preset {preset}")
    elif torch.cuda.is_available():
        paths = kernel_paths(torch.device("cuda"))
        budgets, kernels, fp8_kernels = card_budget(torch.device("cuda")), paths.kernels, paths.fp8_kernels
    else:
        return None

    def choose(args, expert_format: str) -> str:
        spec, why = choose_backbone(args, budgets, expert_format, USER_PROCESS, kernels, fp8_kernels)
        click.echo(f"--backbone auto: {spec} ({why})", err=True)
        return spec

    return choose


@click.command()
@click.argument("src")
@click.argument("out", type=PATH)
@click.option(
    "--fp4",
    is_flag=True,
    required=True,
    help="Required: quantize the routed experts to FP4 (layout v1 stores them only in FP4).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["auto", "nvfp4", "mxfp4"]),
    default="auto",
    show_default=True,
    help="FP4 format of the routed experts. auto: the source's own when its experts are FP4 already (NVIDIA's "
    "NVFP4 exports, DeepSeek-V4's MXFP4: repacked byte for byte), else nvfp4. Another format requantizes "
    "them, and the conversion reports the error that costs.",
)
@click.option(
    "--backbone",
    default="auto",
    show_default=True,
    help="fp8: keep FP8 bit-exact (BF16 sources are quantized to FP8 blocks); fp4: attention, dense and "
    "shared-expert matrices to NVFP4; fp4:KIND,... only those kinds (wq_a, wq_b, wkv_a, wkv_b, wo, dense, shared) "
    "in NVFP4. auto: fp8 where the whole backbone fits this machine's GPU (or --preset's), else fp4:wo,wq_b,shared "
    "(on 16 GB the fastest at a quality cost no larger than the FP4 experts' own; README); fp8 with no GPU here.",
)
@click.option(
    "--head",
    type=click.Choice(["bf16", "fp8"]),
    default="bf16",
    show_default=True,
    help="The output head: bf16 as the release stores it, or fp8 128x128 blocks (half the bytes; a small, "
    "measured quality cost: README).",
)
@click.option(
    "--preset",
    type=click.Choice(list(PRESETS)),
    help="With --backbone auto: size it for this machine class instead of this machine's GPU.",
)
@click.option("--no-mtp", is_flag=True, help="Leave out the MTP layer (needed when SRC was downloaded without it).")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Tensors converted in parallel; the output is identical for any value.",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="Where to quantize: auto (CUDA when present), cpu, cuda, cuda:N.",
)
@click.option("--dry-run", is_flag=True, help="Print the plan (sizes in and out, per part) and exit.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it holds a converted model or other files.")
@click.option(
    "--from-hub",
    is_flag=True,
    help="SRC is a hub repo id: fetch its shards as the conversion needs them (into --source-dir).",
)
@hub_options("With --from-hub: ")
@click.option("--source-dir", type=PATH, help="With --from-hub: where the source goes (default: OUT.source).")
@click.option(
    "--delete-source",
    is_flag=True,
    help="With --from-hub: delete each shard once converted, so the disk holds the output and a few shards.",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Hash every source file against the record `dsfp4 download` kept (.dsfp4-download.json) before converting, "
    "not only those whose size or mtime changed since; a file that fails is an error (with --from-hub: fetched "
    "again).",
)
@quiet_option
def convert(
    src: str,
    out: Path,
    fp4: bool,
    fmt: str,
    backbone: str,
    head: str,
    preset: str | None,
    no_mtp: bool,
    workers: int,
    device: str,
    dry_run: bool,
    force: bool,
    from_hub: bool,
    revision: str,
    token: str | None,
    source_dir: Path | None,
    delete_source: bool,
    verify: bool,
    quiet: bool,
) -> None:
    """Convert a Hugging Face DeepSeek checkpoint SRC (FP8, BF16 or NVIDIA NVFP4) into dsfp4 layout v1 at OUT.

    \b
    Examples:
      dsfp4 convert --fp4 hf/DeepSeek-V3 model/ --dry-run
      dsfp4 convert --fp4 hf/DeepSeek-V3 model/ --workers 8 --device cuda
      dsfp4 convert --fp4 hf/DeepSeek-V3 model-16g/ --preset 16g
      dsfp4 convert --fp4 deepseek-ai/DeepSeek-V3 model/ --from-hub --delete-source

    An interrupted conversion resumes when run again with the same arguments. A SRC that `dsfp4 download` fetched is
    checked against its record first: a file whose size or mtime changed is hashed, and one that fails is refused.
    """
    from dsfp4.convert.pipeline import convert as run_convert
    from dsfp4.convert.plan import ConvertOptions, plan_table

    if preset is not None and backbone != "auto":
        raise click.UsageError(f"--preset sizes --backbone auto; drop it or --backbone {backbone}")
    options = ConvertOptions(
        format=fmt,
        backbone=backbone,
        head=head,
        no_mtp=no_mtp,
        workers=workers,
        device=device,
        force=force,
        dry_run=dry_run,
    )
    choose = backbone_chooser(preset) if backbone == "auto" else None
    given = given_flags(click.get_current_context(), ("revision", "token", "source_dir", "delete_source"))
    if given and not from_hub:
        raise click.UsageError(only_with(given, "--from-hub"))
    hub, src_path = None, Path(src)
    if from_hub:
        from dsfp4.convert.source.hub import HubSource

        resolved = out.resolve()
        src_path = source_dir or resolved.with_name(resolved.name + ".source")
        with HubSource(src, src_path, revision, token, no_mtp, delete_source, verify=verify) as hub:
            result = run_convert(src_path, out, options, progress=not quiet, hub=hub, choose_backbone=choose)
    elif not src_path.exists() and src.count("/") == 1 and not src.startswith((".", "/", "~")):
        raise click.UsageError(f"{src} is not a folder here; to convert a hub repo, add --from-hub")
    else:
        result = run_convert(src_path, out, options, progress=not quiet, choose_backbone=choose, verify=verify)
    if dry_run:
        click.echo(plan_table(result.plan, str(src), str(out)))
        click.echo("\n".join(("", *result.notes)))
        return
    if hub is not None and delete_source:
        hub.remove()
    r = result
    rate = format_bytes(r.converted_bytes / r.seconds) if r.seconds > 0 else "-"
    resumed = f" ({r.resumed_parts} parts were already done)" if r.resumed_parts else ""
    click.echo(
        f"converted {format_bytes(r.converted_bytes)} of source in {r.seconds:.1f} s ({rate}/s){resumed}", err=True
    )
    for klass, err in r.quant_error.items():
        click.echo(f"  quantization error {klass:<36} {err:.4g} (relative RMS)", err=True)
    click.echo(str(out))


@click.command()
@click.argument("model", type=EXISTING_DIR)
@click.option("--tensors", is_flag=True, help="List every backbone tensor.")
def inspect(model: Path, tensors: bool) -> None:
    """Show what a converted MODEL holds: files, formats, sizes, expert records."""
    from dsfp4.layout.inspect import describe

    click.echo(describe(model, tensors))


@click.command()
@click.argument("model", type=EXISTING_DIR)
@quiet_option
def verify(model: Path, quiet: bool) -> None:
    """Re-hash every file and expert record of MODEL; exit 1 naming the first damaged one."""
    from dsfp4.layout.verify import verify as run_verify

    # started once the quick checks pass: a failure there is one line, with no bar before it
    bars: list[tqdm] = []

    def start(total: int) -> None:
        bars.append(tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet, file=sys.stderr))

    try:
        report = run_verify(model, lambda n: bars[0].update(n), on_start=start)
    finally:
        for bar in bars:
            bar.close()
    click.echo(
        f"{model}: OK ({report.n_files} files, {report.n_records} expert records, "
        f"{format_bytes(report.nbytes)} checked)"
    )
