"""Project each --mode (runtime/modes.py) on the whole model: decode tok/s on each machine class under a calibrated
routing trace, with the lossy levers carried over from a trained model as dsfp4/projection/levers.py states.

    python scripts/project_levers.py --trace v3_mid.npy --recorded decode_trace.npz --margins margins.json \
        --efficiency 0.73 [--family v3] [--machines 16g,24g] [--cold-bits 3 ...] [--cold-recipe R ...] \
        [--hot-share 0.1] [--cpu-gbps 16] [--experts-per-token 7 ...] [--json OUT] [SETTING...]

--trace: a calibrated trace (scripts/synthetic_trace.py); --recorded: a routing trace the trained model recorded
(`dsfp4 run --record-trace`), for its routing weights; --margins: scripts/router_margins.py's output on the trained
model (at every margin a mode uses); --efficiency: the bench model's measured resident decode efficiency (`dsfp4 bench
--project` prints it); SETTING: a mode or THRESHOLD:MARGIN (default: every mode); --cold-bits: each setting also
with the records outside each layer's hot set in cold codes of these bits (`profile-hot --repack --cold-bits`), the
hot set each layer's hottest --hot-share (default: what the budgets hold at full size, as profile-hot's);
--cold-recipe: the same with a cold recipe (`profile-hot --repack --cold-recipe`, layout/recipe.py), its blocks the
whole model's; --experts-per-token K: each setting also with every token keeping its K heaviest choices (`run
--experts-per-token`; a .npy trace's first K, a recorded .npz's K heaviest by weight: dsfp4/projection/top_k.py).
Prints a table (bits: per routed weight as stored, scales included); --json writes the rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np

from dsfp4.errors import ConfigError
from dsfp4.layout.recipe import ColdRecipe, parse_recipe
from dsfp4.layout.routing_trace import read_trace
from dsfp4.projection.levers import project_levers
from dsfp4.runtime.modes import MODES, parse_levers

FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.command()
@click.option("--trace", type=FILE, required=True)
@click.option("--recorded", type=FILE, required=True)
@click.option("--margins", type=FILE, required=True)
@click.option("--efficiency", type=click.FloatRange(0, 2, min_open=True), required=True)
@click.option("--family", type=click.Choice(["v3", "v4"]), default="v3", show_default=True)
@click.option("--machines", default="16g,24g", show_default=True)
@click.option("--cold-bits", type=click.Choice(["2", "3"]), multiple=True)
@click.option("--cold-recipe", multiple=True, help="As --cold-bits, a cold recipe: gate=2,up=2,down=3[;BLOCKS:SPEC].")
@click.option(
    "--hot-share", type=click.FloatRange(0, 1, max_open=True), help="With --cold-bits or --cold-recipe: kept exact."
)
@click.option(
    "--cpu-gbps",
    type=click.FloatRange(0),
    default=0.0,
    help="The CPU lane on (--cpu-experts auto) at this kernel rate, GB/s of records (dsfp4 doctor's cpu_moe_gbps).",
)
@click.option(
    "--experts-per-token",
    "per_token",
    type=click.IntRange(1),
    multiple=True,
    help="Each setting also with this many experts a token (repeatable; top-k reduction).",
)
@click.option("--json", "out", type=click.Path(path_type=Path))
@click.argument("settings", nargs=-1)
def main(
    trace: Path,
    recorded: Path,
    margins: Path,
    efficiency: float,
    family: str,
    machines: str,
    cold_bits: tuple[str, ...],
    cold_recipe: tuple[str, ...],
    hot_share: float | None,
    cpu_gbps: float,
    per_token: tuple[int, ...],
    out: Path | None,
    settings: tuple[str, ...],
) -> None:
    """SETTINGS: modes or THRESHOLD:MARGIN pairs (default: every mode)."""
    try:
        modes = {s: parse_levers(s) for s in settings} if settings else MODES
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    routed = None if trace.suffix == ".npy" else read_trace(trace)
    ids = np.load(trace) if routed is None else routed.ids
    weights = read_trace(recorded).weights
    close = {float(d): v["close"] for d, v in json.loads(margins.read_text())["margins"].items()}
    missing = sorted({m.cache_aware for m in modes.values() if m.cache_aware and m.cache_aware not in close})
    if missing:
        raise click.UsageError(f"--margins {margins}: no figure at margin {missing}; rerun scripts/router_margins.py")
    if hot_share is not None and not (cold_bits or cold_recipe):
        raise click.UsageError("--hot-share says which experts --cold-bits keeps exact; add --cold-bits 2 or 3")
    try:
        recipes = [parse_recipe(text) for text in cold_recipe]
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="'--cold-recipe'") from None
    bits = (None, *map(int, cold_bits), *recipes)
    try:
        rows = project_levers(
            family,
            ids,
            machines.split(","),
            efficiency,
            modes,
            weights,
            close,
            cold_bits=bits,
            cpu=cpu_gbps * 1e9,
            hot_share=hot_share,
            experts_per_token=(0, *per_token),
            trace_weights=None if routed is None else routed.weights,
        )
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    head = ("setting", "K", "cold", "bits", "machine", "tok/s", "SSD GB", "PCIe GB", "left out", "swapped", "on CPU")
    wide = max([5, *map(len, cold_recipe)])
    line = f"{{:<11}} {{:>2}} {{:<{wide}}} {{:>5}} {{:<8}} {{:>6}} {{:>7}} {{:>8}} {{:>9}} {{:>8}} {{:>7}}"
    click.echo(line.format(*head))
    for r in rows:
        d = r.to_dict()
        cold = str(r.cold_bits) if isinstance(r.cold_bits, ColdRecipe) else f"{r.cold_bits}-bit" if r.cold_bits else "-"
        k = r.experts_per_token or ids.shape[-1]
        click.echo(
            f"{r.mode:<11} {k:>2} {cold:<{wide}} {r.routed_bits:5.2f} {r.machine:<8} {d['tok_s']:6.2f} "
            f"{d['ssd_gb_per_token']:7.2f} "
            f"{d['pcie_gb_per_token']:8.2f} {d['skipped_share']:9.1%} {d['swapped_share']:8.1%} {d['host_share']:7.1%}"
        )
    if out is not None:
        out.write_text(json.dumps([r.to_dict() for r in rows], indent=1))


if __name__ == "__main__":
    main()
