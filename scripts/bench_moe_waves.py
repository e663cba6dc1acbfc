"""A streamed prefill wave's compacted calls (kernels/moe/waves.py) against the per-piece calls they replace, at
DeepSeek-V3's expert shapes, on the GPU machine:

    python scripts/bench_moe_waves.py [--groups 2048,4096,11776] [--present 17,66,151] [--reps 5] [--out DIR] [--cpu]

A layer-wise prefill's group of G tokens (uniform top-8 routing over 256 experts) meets a wave of S experts (a
random subset, in shuffled slots; ABSENT elsewhere), NVFP4 and MXFP4: (a) the old way, the kernel over 512-token
pieces of the group with all their ids and the wave's offsets, the pieces joined and added to the group's fp32 sum;
(b) the compacted way, the wave's present pairs found and computed in runs (present_pairs, add_wave) into the same
sum. Both run eagerly, as MoE._streamed runs them (the compacted calls read their pair count on the host): the
median of --reps after a call that compiles. TFLOP/s count the present experts' work, pairs present x 3 x dim x width
x 2, for both. Each case also checks the two sums agree (rel_err). --cpu: tiny shapes on the CPU's kernels, a smoke
test whose figures mean nothing. Prints a table; writes bench_moe_waves.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from bench_kernels import DIM, EXPERTS, INTER, TOP_K, expert_pool, routings

from dsfp4.kernels.moe.kernel import MoEKernel
from dsfp4.kernels.moe.waves import StepChoices, add_wave, present_pairs, wave_runs
from dsfp4.layout.record_offsets import ABSENT, record_offsets

FORMATS = ("nvfp4", "mxfp4")
# a pair's work per weight of its expert's three dim x width matrices (gate, up, down): a multiply and an add
FLOPS_PER_WEIGHT = 3 * 2


@dataclass(frozen=True)
class Shapes:
    """The experts' shapes and the cases: model dim, expert width, experts, choices a token, a piece's tokens (a
    chunk), the groups' tokens and the waves' experts."""

    dim: int
    inter: int
    experts: int
    top_k: int
    piece: int
    groups: tuple[int, ...]
    present: tuple[int, ...]


# DeepSeek-V3 at 512-token chunks: groups of 4 and 8 chunks and the 16 GB plan's 23; waves of the 16 GB plan's 17
# slots, a quarter and three fifths of the experts
V3 = Shapes(DIM, INTER, EXPERTS, TOP_K, 512, (2048, 4096, 11776), (17, 66, 151))
# --cpu: pieces past decode's 16 tokens, so that the waves compact
TINY = Shapes(64, 32, 16, 4, 20, (40, 64), (3, 9))


def seconds(f, device: torch.device, reps: int) -> float:
    """Median seconds of f() over `reps` calls, after one (which compiles)."""
    f()
    cuda = device.type == "cuda"
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        f()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def queued(f, device: torch.device, reps: int) -> float:
    """Median seconds f() takes to return, the device idle before each call: the host's share of f."""
    f()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times)


def old_wave(kernel: MoEKernel, x, ids, weights, records, offsets, piece: int, y: torch.Tensor) -> None:
    """MoE._streamed's wave before compaction: the pieces' calls with all their ids, joined, into y (fp32)."""
    parts = [slice(a, a + piece) for a in range(0, x.shape[0], piece)]
    y += torch.cat([kernel(x[s], ids[s], weights[s], records, offsets) for s in parts])


def compact_wave(kernel: MoEKernel, x, ids, weights, records, offsets, piece: int, y: torch.Tensor) -> None:
    """The compacted wave: its present pairs (planned on the host from the step's ids, copied here as once a step),
    then add_wave's runs into y (fp32)."""
    pairs = present_pairs(StepChoices.of(ids.cpu().numpy(), offsets.numel()), (offsets != ABSENT).cpu().numpy())
    assert pairs is not None, "a wave of fewer experts than the layer's leaves pairs out"
    add_wave(kernel, x, ids, weights, records, offsets, pairs, wave_runs(kernel, pairs, piece, x.dtype), y)


def case(shapes: Shapes, fmt: str, pool: tuple, g: int, s: int, device: torch.device, reps: int) -> dict:
    """One (format, group, wave) case: both ways timed and their sums compared."""
    layout, records = pool
    kernel = MoEKernel(layout, shapes.top_k, device)
    gen = torch.Generator().manual_seed(g * 1000 + s)
    ((ids, weights, _),) = routings(g, gen, 1, shapes.top_k, shapes.experts, device)
    slots = torch.randperm(shapes.experts, generator=gen)
    slots[torch.randperm(shapes.experts, generator=gen)[s:]] = ABSENT
    offsets = record_offsets(slots.to(device), records)
    x = torch.randn(g, shapes.dim, generator=gen).to(device, torch.bfloat16)
    args = (kernel, x, ids, weights, records, offsets, shapes.piece)
    sums = {}
    for name, way in (("old", old_wave), ("compact", compact_wave)):
        y = torch.zeros(g, shapes.dim, dtype=torch.float32, device=device)
        way(*args, y)
        sums[name] = y
    rel = ((sums["compact"] - sums["old"]).abs().max() / sums["old"].abs().max()).item()
    y = torch.zeros(g, shapes.dim, dtype=torch.float32, device=device)
    old = seconds(lambda: old_wave(*args, y), device, reps)
    compact = seconds(lambda: compact_wave(*args, y), device, reps)
    host = queued(lambda: compact_wave(*args, y), device, reps)
    wave = present_pairs(StepChoices.of(ids.cpu().numpy(), offsets.numel()), (offsets != ABSENT).cpu().numpy())
    pairs = len(wave.pairs)
    flops = pairs * FLOPS_PER_WEIGHT * shapes.dim * shapes.inter
    runs = wave_runs(kernel, wave, shapes.piece, x.dtype)
    return {
        "fmt": fmt,
        "G": g,
        "S": s,
        "pairs": pairs,
        "runs": len(runs),
        # rows an expert has in a call, on average over the calls' experts
        "call_rows": pairs / sum(end - first for _, _, first, end in runs),
        "old_ms": old * 1e3,
        "compact_ms": compact * 1e3,
        # the host's time to queue the compacted wave (the device idle before it): what it adds where the device is
        # faster
        "compact_host_ms": host * 1e3,
        "old_TFLOPs": flops / old / 1e12,
        "compact_TFLOPs": flops / compact / 1e12,
        "speedup": old / compact,
        "rel_err": rel,
        "w4a8": kernel.mma,
    }


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=ints, help="groups' tokens (default: 2048,4096,11776)")
    ap.add_argument("--present", type=ints, help="waves' experts (default: 17,66,151)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU: a smoke test")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    shapes = TINY if a.cpu else V3
    shapes = Shapes(**{**asdict(shapes), "groups": a.groups or shapes.groups, "present": a.present or shapes.present})
    device = torch.device("cpu" if a.cpu else "cuda")
    rows = []
    for fmt in a.formats.split(","):
        gen = torch.Generator(device=device).manual_seed(4)
        pool = expert_pool(fmt, gen, shapes.dim, shapes.inter, shapes.experts, device)
        for g in shapes.groups:
            for s in shapes.present:
                rows.append(case(shapes, fmt, pool, g, s, device, a.reps))
    name = "cpu" if a.cpu else torch.cuda.get_device_name(device)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_moe_waves.json").write_text(json.dumps({"device": name, "shapes": asdict(shapes), "rows": rows}))
    print(
        f"{name}: dim {shapes.dim}, width {shapes.inter}, {shapes.experts} experts, top-{shapes.top_k}, pieces of "
        f"{shapes.piece}; ms a wave and TFLOP/s of its present experts"
    )
    print(
        f"{'fmt':<6} {'G':>6} {'S':>4} {'pairs':>7} {'runs':>4} {'rows':>5} {'old ms':>9} {'TF/s':>6} "
        f"{'compact ms':>10} {'host ms':>7} {'TF/s':>6} {'speedup':>7} {'rel err':>8}"
    )
    for r in rows:
        print(
            f"{r['fmt']:<6} {r['G']:>6} {r['S']:>4} {r['pairs']:>7} {r['runs']:>4} {r['call_rows']:>5.0f} "
            f"{r['old_ms']:>9.2f} {r['old_TFLOPs']:>6.1f} {r['compact_ms']:>10.2f} {r['compact_host_ms']:>7.2f} "
            f"{r['compact_TFLOPs']:>6.1f} {r['speedup']:>6.2f}x {r['rel_err']:>8.1e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
