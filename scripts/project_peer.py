"""The whole model's decode on each machine class, dsfp4's store beside a peer that streams its experts through the
page cache (llama.cpp and ik_llama.cpp with mmap and `-ot exps=CPU`: dsfp4/projection/page_cache_peer.py), under a
calibrated routing trace and the same machine and RAM.

    python scripts/project_peer.py --trace v3_mid.npy --efficiency 0.73 [--family v3] [--machines 16g,24g]
        [--amplification 1 --amplification 2.81] [--cpu-gbps 96] [--json OUT]

--trace: a calibrated trace (scripts/synthetic_trace.py); --efficiency: the bench model's measured resident decode
efficiency (`dsfp4 bench --project` prints it); --amplification: the peer's SSD bytes a miss over its record's
(default: 1, its best case, and the 2.81 ik_llama.cpp read side by side); --cpu-gbps: the peer's CPU expert kernels'
rate (default: a dual-channel DDR5-6000's peak, 96 GB/s, the best case for a desktop's RAM). The peer's time is given
serial (its faults stalling its compute) and overlapped (its best). dsfp4 decodes as its projection's default store
does (hot policy, prefetch at recall 0.9). Prints a table; --json writes the rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np

from dsfp4.layout.routing_trace import read_trace
from dsfp4.projection.page_cache_peer import IK_AMPLIFICATION, peer_decode
from dsfp4.projection.whole_model import machine_run

FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
# a dual-channel DDR5-6000's peak: 2 channels x 8 bytes x 6,000 MT/s
DESKTOP_RAM_GBPS = 96.0
# dsfp4's store as its projection's default row decodes (whole_model.py VARIANTS)
POLICY, RECALL = "hot", 0.9


@click.command()
@click.option("--trace", type=FILE, required=True)
@click.option("--efficiency", type=click.FloatRange(0, 2, min_open=True), required=True)
@click.option("--family", default="v3", show_default=True)
@click.option("--machines", default="16g,24g", show_default=True)
@click.option("--amplification", type=click.FloatRange(1.0), multiple=True)
@click.option("--cpu-gbps", type=click.FloatRange(0, min_open=True), default=DESKTOP_RAM_GBPS, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
def main(
    trace: Path,
    efficiency: float,
    family: str,
    machines: str,
    amplification: tuple[float, ...],
    cpu_gbps: float,
    json_out: Path | None,
) -> None:
    ids = np.load(trace) if trace.suffix == ".npy" else read_trace(trace).ids
    rows = []
    for name in machines.split(","):
        r = machine_run(family, name, ids, efficiency)
        ours = r.decode(POLICY, RECALL, True)
        for amp in amplification or (1.0, IK_AMPLIFICATION):
            peer = peer_decode(r, amp, cpu_gbps * 1e9)
            rows.append(
                dict(
                    machine=name,
                    amplification=round(amp, 2),
                    dsfp4_tok_s=ours.tok_s,
                    dsfp4_ssd_gb=ours.ssd_bytes / 1e9,
                    peer_tok_s=peer.tok_s,
                    peer_overlapped_tok_s=peer.overlapped_tok_s,
                    peer_ssd_gb=peer.ssd_bytes / 1e9,
                    peer_ssd_s=peer.ssd_s,
                    peer_cpu_s=peer.cpu_s,
                    peer_gpu_s=peer.gpu_s,
                    ratio=ours.tok_s / peer.tok_s,
                    ratio_overlapped=ours.tok_s / peer.overlapped_tok_s,
                )
            )
    head = "machine  amplification  dsfp4 tok/s  SSD GB  peer tok/s: serial / overlapped  SSD GB  SSD s  CPU s  GPU s"
    print(head + "  dsfp4 / peer: serial / overlapped")
    for x in rows:
        print(
            f"{x['machine']:<8} {x['amplification']:>13.2f} {x['dsfp4_tok_s']:>12.2f} {x['dsfp4_ssd_gb']:>7.2f} "
            f"{x['peer_tok_s']:>20.2f} / {x['peer_overlapped_tok_s']:<10.2f} {x['peer_ssd_gb']:>7.2f} "
            f"{x['peer_ssd_s']:>6.3f} {x['peer_cpu_s']:>6.3f} {x['peer_gpu_s']:>6.3f} "
            f"{x['ratio']:>20.2f}x / {x['ratio_overlapped']:.2f}x"
        )
    if json_out:
        json_out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
