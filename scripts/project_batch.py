"""Project batched decode on the whole model: B sequences decoding together on each machine class, under a calibrated
routing trace, through the store's pools (dsfp4/projection/whole_model.py MachineRun.decode_batch).

    python scripts/project_batch.py --trace v3_mid.npy --efficiency 0.73 [--family v3] [--machines 16g,24g]
                                    [--batches 1,2,4,8,16] [--json OUT]

Each sequence decodes through a stretch of the trace of its own; a step brings in the union of its B tokens' experts
per layer (in waves when the device slots run short) and costs one token's compute. No prefetch in any row (the
batch's chunked path has none), so the single-stream row here is below the shipped single-stream projection, which
prefetches; compare the rows with each other. --efficiency: the bench model's measured resident decode efficiency.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np

from dsfp4.layout.routing_trace import read_trace
from dsfp4.projection.whole_model import machine_run
from dsfp4.runtime.generate.stats import ratio


@click.command()
@click.option("--trace", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@click.option("--efficiency", type=click.FloatRange(0, 2, min_open=True), required=True)
@click.option("--family", type=click.Choice(["v3", "v4"]), default="v3", show_default=True)
@click.option("--machines", default="16g,24g", show_default=True)
@click.option("--batches", default="1,2,4,8,16", show_default=True)
@click.option("--json", "out", type=click.Path(path_type=Path))
def main(trace: Path, efficiency: float, family: str, machines: str, batches: str, out: Path | None) -> None:
    ids = np.load(trace) if trace.suffix == ".npy" else read_trace(trace).ids
    rows = []
    click.echo(
        f"{'machine':<8} {'batch':>5} {'tok/s':>7} {'x one':>6} {'uses/step':>9} {'SSD GB/t':>8} {'PCIe GB/t':>9}"
    )
    for name in machines.split(","):
        r = machine_run(family, name, ids, efficiency)
        single = r.decode("hot", 0.9, False)
        one = None
        for b in (int(x) for x in batches.split(",")):
            p = r.decode_batch(b)
            tok_s, steps = ratio(p.tokens, p.seconds), p.tokens / b
            one = one or tok_s
            row = {"machine": name, "batch": b, "tok_s": tok_s, "x_one": tok_s / one, **p.to_dict()}
            row["uses_per_layer_step"] = p.uses / (steps * r.run.shape[1])
            row["shipped_single_tok_s"] = single.tok_s
            rows.append(row)
            click.echo(
                f"{name:<8} {b:5d} {tok_s:7.2f} {tok_s / one:6.2f} {row['uses_per_layer_step']:9.1f} "
                f"{p.ssd_bytes / p.tokens / 1e9:8.2f} {p.pcie_bytes / p.tokens / 1e9:9.2f}"
            )
        click.echo(f"{name:<8} single stream as shipped (prefetch from RAM at recall 0.9): {single.tok_s:.2f} tok/s")
    if out is not None:
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
