"""`dsfp4 profile-hot`: measure which experts each layer uses, merge profiles, repack hot-first, report."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click
from tqdm import tqdm

from dsfp4.cli.options import (
    EXISTING_DIR,
    EXISTING_FILE,
    PATH,
    RUN_DEFAULTS,
    FiniteRange,
    budget_options,
    context_options,
    given_flags,
    quiet_option,
)
from dsfp4.errors import ConfigError, OutputError
from dsfp4.layout.atomic import require_folder
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.runtime.options import RunOptions
from dsfp4.units import format_bytes

if TYPE_CHECKING:
    from dsfp4.layout.recipe import ColdRecipe
    from dsfp4.layout.repack import Cold
    from dsfp4.runtime.plan.planner import Plan

# calibration tokens: ~500 selections per expert of a 256-expert top-8 layer
PROFILE_TOKENS = 16384
# tokens per calibration sequence, prefilled in one pass by default
PROFILE_SEQUENCE = 2048
MEASURE_FLAGS = ("prompts", "chat_format", "tokens", "trace", "max_context", "prefill_chunk")


def _measure(
    model: Path,
    options: RunOptions,
    prompts: Path | None,
    chat_format: bool,
    tokens: int,
    trace: Path | None,
    quiet: bool,
) -> HotProfile:
    from dsfp4.layout.routing_trace import write_trace
    from dsfp4.runtime.profile.profiler import profile_model

    bar: list[tqdm] = []

    def on_start(plan: Plan, n_layers: int, n_tokens: int) -> None:
        click.echo(plan.table(), err=True)
        desc = f"profile {n_tokens} tokens"
        bar.append(tqdm(total=n_layers, unit="layer", desc=desc, disable=quiet, file=sys.stderr))

    def on_layer(done: int, counters: dict) -> None:
        bar[0].set_postfix_str(f"read {format_bytes(counters['ssd_bytes'])}", refresh=False)
        bar[0].update(done - bar[0].n)

    try:
        run = profile_model(model, options, prompts, chat_format, tokens, trace is not None, None, on_start, on_layer)
    finally:
        for b in bar:
            b.close()
    for note in run.notes:
        click.echo(f"note: {note}", err=True)
    c, layers = run.counters, len(run.profile.counts)
    rate = format_bytes(c["ssd_bytes"] / run.seconds) if run.seconds > 0 else "-"
    click.echo(
        f"profiled {run.profile.tokens} tokens through {layers} MoE layers in {run.seconds:.1f} s: "
        f"{int(c['ssd_reads'])} expert records ({format_bytes(c['ssd_bytes'])}) read from the SSD, {rate}/s overall",
        err=True,
    )
    if trace is not None:
        write_trace(trace, run.trace)
        click.echo(f"routing trace of {len(run.trace.ids)} tokens: {trace}", err=True)
    return run.profile


@click.command("profile-hot")
@click.argument("model", type=EXISTING_DIR)
@click.option(
    "--prompts",
    type=EXISTING_FILE,
    help="Calibration prompts, one per line (default: the built-in mixed set: prose, code, chat, languages).",
)
@click.option(
    "--chat-format",
    is_flag=True,
    help='--prompts holds JSON lines, {"messages": [...]} rendered with the chat template (or {"text": ...}).',
)
@click.option("--tokens", type=click.IntRange(min=1), default=PROFILE_TOKENS, show_default=True, help="Tokens to run.")
@context_options(PROFILE_SEQUENCE, "Tokens per calibration sequence.", PROFILE_SEQUENCE)
@budget_options
@click.option("-o", "--output", type=PATH, help=f"Where to write the profile (default: MODEL/{HOT_NAME}).")
@click.option(
    "--merge", type=EXISTING_FILE, multiple=True, help="Add this profile of the same conversion (repeatable)."
)
@click.option(
    "--no-measure",
    is_flag=True,
    help=f"Run nothing: merge, repack or report existing profiles (default: MODEL/{HOT_NAME}).",
)
@click.option("--trace", type=PATH, help="Also write the routing trace: .npy (ids) or .npz (ids, weights, tokens).")
@click.option(
    "--repack",
    is_flag=True,
    help="Rewrite the layer files hottest expert first (safe to interrupt; needs one layer file of free disk).",
)
@click.option(
    "--cold-bits",
    type=click.Choice(["2", "3"]),
    help="With --repack: store each layer's experts outside its hot set in 2- or 3-bit codes, fewer bytes per SSD "
    "read (lossy, one way: measure it with `dsfp4 eval`).",
)
@click.option(
    "--cold-recipe",
    metavar="RECIPE",
    help="With --repack: as --cold-bits, each matrix at its own bits, 2, 3 or 4 (exact), and per MoE block where "
    "given, e.g. 'gate=2,up=2,down=3;1-2:down=4' (docs/layout-v1.md).",
)
@click.option(
    "--hot-share",
    type=FiniteRange(0, 1, max_open=True),
    help="With --cold-bits or --cold-recipe: the share of each layer's experts, hottest first, kept exact (default: "
    "the share the budgets hold on the GPU and in RAM). Smaller narrows more, and RAM then holds the rest in slots of "
    "their size.",
)
@click.option(
    "--report",
    is_flag=True,
    help="Print each layer's skew and a static hot set's hit rate at the budgets; plot coverage (PNG).",
)
@quiet_option
def profile_hot(
    model: Path,
    prompts: Path | None,
    chat_format: bool,
    tokens: int,
    output: Path | None,
    merge: tuple[Path, ...],
    no_measure: bool,
    trace: Path | None,
    repack: bool,
    cold_bits: str | None,
    cold_recipe: str | None,
    hot_share: float | None,
    report: bool,
    quiet: bool,
    **knobs,
) -> None:
    """Measure which experts each MoE layer of MODEL uses on calibration text, layer by layer (each
    expert record is read from the SSD once), and write MODEL/hot.json for the warm start.

    \b
    Examples:
      dsfp4 profile-hot model/ --repack --report
      dsfp4 profile-hot model/ --prompts code.txt -o code.json --trace code.npz
      dsfp4 profile-hot model/ --no-measure --merge model/hot.json --merge code.json
      dsfp4 profile-hot model/ --no-measure --repack --cold-bits 3 --cpu-mem 80G
    """
    from dsfp4.layout.manifest import Manifest
    from dsfp4.layout.trace_path import check_trace_path

    ctx = click.get_current_context()
    if no_measure and (given := given_flags(ctx, MEASURE_FLAGS)):
        raise click.UsageError(f"--no-measure runs nothing, so {', '.join(given)} would do nothing; drop them")
    recipe = _recipe(cold_bits, cold_recipe, repack, hot_share)
    if trace is not None:
        check_trace_path(trace)
    options = RunOptions(**knobs)
    manifest = Manifest.open(model)
    own = model / HOT_NAME
    output = require_folder(output or own, "--output")
    inputs = list(merge) if merge or not no_measure else [own]
    if no_measure and not own.is_file() and not merge:
        raise ConfigError(f"{own} not found: run `dsfp4 profile-hot {model}` first, or give --merge FILE")
    # refuse before running anything
    profiles = [(p, HotProfile.read(p).check(manifest, p)) for p in inputs]
    result = _measure(model, options, prompts, chat_format, tokens, trace, quiet) if not no_measure else None
    for path, p in profiles:
        result = p if result is None else result.merge(p, path)
    if not (no_measure and inputs == [output]):
        _write(result, output)
        click.echo(f"hot profile of {result.tokens} tokens: {output}", err=True)
    if repack:
        cold = _cold(model, options, recipe, hot_share) if recipe else None
        _repack(model, result, quiet, cold)
    if report:
        _report(model, options, result, output)
    click.echo(str(output))


def _write(profile: HotProfile, output: Path) -> None:
    """Write the profile; if `output` still cannot be written (checked before measuring, yet a disk may fill or a
    mount turn read-only), keep the measured profile in a temporary file and say where."""
    try:
        profile.write(output)
    except OSError as e:
        fd, kept = tempfile.mkstemp(prefix="dsfp4-hot-", suffix=".json")
        os.close(fd)
        profile.write(Path(kept))
        raise OutputError(
            f"--output {output}: cannot write it ({e.strerror or e}); the profile is kept in {kept}: copy it there, "
            f"or use it with --merge {kept} --no-measure"
        ) from e


def _recipe(bits: str | None, text: str | None, repack: bool, hot_share: float | None) -> ColdRecipe | None:
    """--cold-bits or --cold-recipe as a recipe (None: neither), the flags' combinations checked."""
    from dsfp4.layout.recipe import ColdRecipe, parse_recipe

    given = "--cold-bits" if bits else "--cold-recipe" if text is not None else None
    if bits and text is not None:
        raise click.UsageError("--cold-bits N is the recipe all=N: give --cold-bits or --cold-recipe, not both")
    if given and not repack:
        raise click.UsageError(f"{given} narrows records while repacking; add --repack")
    if hot_share is not None and not given:
        raise click.UsageError(
            "--hot-share says which experts --cold-bits keeps exact; add --cold-bits 2 or 3 (or --cold-recipe)"
        )
    if text is None:
        return ColdRecipe.uniform(int(bits)) if bits else None
    try:
        return parse_recipe(text)
    except ConfigError as e:
        raise click.BadParameter(str(e).removeprefix(f"--cold-recipe {text!r}: "), param_hint="'--cold-recipe'") from e


def _cold(model: Path, options: RunOptions, recipe: ColdRecipe, hot_share: float | None) -> Cold:
    """The cold repack's plan: `hot_share` given, or the share of records the budgets hold on the device and in
    RAM."""
    from dsfp4.layout.repack import Cold

    if hot_share is None:
        plan = _plan(model, options)
        hot_share = plan.held_share
        if hot_share >= 1:
            raise ConfigError(
                f"--cold-bits/--cold-recipe: the budgets hold all {plan.total_records} expert records on the GPU and "
                f"in RAM, so narrowing would cost quality and save no SSD read; give --hot-share to narrow anyway"
            )
    return Cold(recipe, hot_share)


def _repack(model: Path, profile: HotProfile, quiet: bool, cold: Cold | None) -> None:
    from dsfp4.layout.repack import repack

    with tqdm(unit="layer", desc="repack", disable=quiet, file=sys.stderr) as bar:

        def on_layer(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        r = repack(model, profile, on_layer, cold)
    rate = format_bytes(r.nbytes / r.seconds) if r.seconds > 0 else "-"
    narrowed = (
        f", {r.narrowed} records narrowed by the cold recipe {cold.recipe} (hot share {cold.hot_share:.2f})"
        if cold
        else ""
    )
    click.echo(
        f"repacked {r.rewritten} layer files hottest expert first ({r.unchanged} were already){narrowed}, "
        f"{format_bytes(r.nbytes)} written in {r.seconds:.1f} s ({rate}/s)",
        err=True,
    )


def _plan(model: Path, options: RunOptions) -> Plan:
    """The placement `dsfp4 run` would use with these budgets."""
    from dsfp4.runtime.models.load import plan_engine

    run = dataclasses.replace(options, max_context=RUN_DEFAULTS.max_context, prefill_chunk=RUN_DEFAULTS.prefill_chunk)
    return plan_engine(model, run)


def _report(model: Path, options: RunOptions, profile: HotProfile, output: Path) -> None:
    from dsfp4.runtime.profile.hot_report import report_table, write_plot

    plan = _plan(model, options)
    click.echo(report_table(profile, plan.gpu_slots, plan.ram_slots, plan.device))
    png = output.with_suffix(".png")
    note = write_plot(profile, png)
    click.echo(f"note: {note}" if note else f"coverage curves: {png}", err=True)
