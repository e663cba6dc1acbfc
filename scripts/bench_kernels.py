"""Kernel benchmarks on the GPU machine (docs/BENCHMARKS.md), each against the HBM read ceiling measured in
the same run:

    python scripts/bench_kernels.py [--only decode,zero_copy,gate,...] [--sweep] [--out DIR]

Timing: every case is captured in a CUDA graph over weights distinct from one call to the next (random
experts out of 256 records, or several copies of a dense matrix), so no launch gap and no L2 reuse flatter
it. Bytes are those the kernel must read: distinct experts' records (w13, w2 and their scales), or a
matrix and its scales. Prints a table; writes bench_kernels.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from dsfp4.kernels.fp8.linear import fp8_linear
from dsfp4.kernels.moe.decode import MAX_TOKENS, DecodeConfig, DecodeMoE
from dsfp4.kernels.moe.prefill import align_by_expert, down, gate_up, moe_prefill, prefill_blocks
from dsfp4.kernels.router.gate_scores import GateTiles, gate_scores, gate_scores_ref
from dsfp4.layout import fp4
from dsfp4.layout.fp8 import fp8_block_quantize
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.record_offsets import record_offsets
from dsfp4.tools.ceilings import gpu_ceilings

DEV = torch.device("cuda")
DIM, INTER, EXPERTS, TOP_K = 7168, 2048, 256, 8  # DeepSeek-V3
V4_DIM, V4_TOP_K, V4_LIMIT = 4096, 6, 10.0  # DeepSeek-V4-Flash: width 2048 too, MXFP4, the SwiGLU clamp
CALLS = 24  # distinct calls per graph
FIXED = MAX_TOKENS + 1  # wide_from for a sweep's config: its gate+up tile at every token count


SWEEP = [  # --sweep, beside DecodeConfig(): one tile at every token count (gate+up rows x bytes per step, warps): the
    # default's narrow and wide tiles, neighbours of them, and fp32 products
    DecodeConfig(wide_from=FIXED),
    DecodeConfig(wide_from=FIXED, bn1=16, bk1=1024),
    DecodeConfig(wide_from=FIXED, bn1=16),
    DecodeConfig(wide_from=FIXED, bn1=16, bn2=16),
    DecodeConfig(wide_from=FIXED, bn1=16, bk1=1024, bn2=16),
    DecodeConfig(wide_from=FIXED, bn2=16),
    DecodeConfig(words1=False, words2=False),
]


def graph_time(calls: list, reps: int = 5) -> float:
    """Seconds per call: the calls captured once in a graph, replayed `reps` times (after a warm replay)."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps / len(calls)


def expert_pool(
    fmt: str,
    gen: torch.Generator,
    dim: int = DIM,
    inter: int = INTER,
    experts: int = EXPERTS,
    device: torch.device = DEV,
) -> tuple[RecordLayout, torch.Tensor]:
    """`experts` records (256) on the device: 16 distinct random experts (quantized on the GPU), each repeated; the
    bytes differ only in content, so copies cost the same HBM reads. Other shapes and devices serve
    bench_moe_waves.py's --cpu run (`gen` on `device`)."""
    layout = RecordLayout.for_expert(fmt, dim, inter)
    records = torch.empty(experts, layout.nbytes, dtype=torch.uint8, device=device)
    for e in range(16):
        w13 = torch.randn(2 * inter, dim, device=device, generator=gen) * 0.02
        w2 = torch.randn(dim, inter, device=device, generator=gen) * 0.02
        if fmt == "nvfp4":
            (p13, s13, g13), (p2, s2, g2) = fp4.nvfp4_quantize(w13), fp4.nvfp4_quantize(w2)
            parts = {"w13": p13, "w13_scale": s13, "w2": p2, "w2_scale": s2, "scale_2": torch.stack([g13, g13, g2])}
        else:
            (p13, s13), (p2, s2) = fp4.mxfp4_quantize(w13), fp4.mxfp4_quantize(w2)
            parts = {"w13": p13, "w13_scale": s13, "w2": p2, "w2_scale": s2}
        one = torch.frombuffer(bytearray(layout.pack({k: v.cpu() for k, v in parts.items()})), dtype=torch.uint8)
        records[e::16] = one.to(device)
    return layout, records


def read_bytes(layout: RecordLayout) -> int:
    return sum(p.nbytes for p in layout.parts)


def routings(
    t: int,
    gen: torch.Generator,
    n: int = CALLS,
    k: int = TOP_K,
    experts: int = EXPERTS,
    device: torch.device = DEV,
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """n random routings of t tokens over `experts` (`gen` on the CPU): (ids [T, K], weights [T, K], distinct
    experts)."""
    out = []
    for _ in range(n):
        ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=gen) + 0.1
        out.append((ids.to(device), w.to(device), len(set(ids.flatten().tolist()))))
    return out


def decode_rows(
    hbm: float,
    kernel: DecodeMoE,
    records: torch.Tensor,
    offsets: torch.Tensor,
    t: int,
    k: int,
    gen: torch.Generator,
    **row: object,
) -> dict:
    """One decode case over CALLS random routings of t tokens, captured in a graph."""
    routes = routings(t, gen, k=k)
    x = torch.randn(t, kernel.layout.dim, device=DEV, dtype=torch.bfloat16)
    kernel(x, routes[0][0], routes[0][1], records, offsets)  # compiles before capture
    s = graph_time([lambda r=r: kernel(x, r[0], r[1], records, offsets) for r in routes])
    distinct = sum(r[2] for r in routes) / len(routes)
    gbps = distinct * read_bytes(kernel.layout) / s / 1e9
    return {"T": t, "us": s * 1e6, "distinct_experts": distinct, "GBps": gbps, "of_ceiling": gbps / hbm, **row}


def config_name(c: dict, t: int) -> str:
    """A DecodeConfig's launches at t tokens: rows x bytes per row per chunk, warps, products (words or fp32)."""
    products = {True: "words", False: "fp32"}
    bn1, bk1 = DecodeConfig(**c).gate_up(t)
    gate_up = f"{2 * bn1}x{bk1 // 2}B w{c['num_warps']} {products[c['words1']]}"
    return f"gate_up {gate_up} | down {c['bn2']}x{c['bk2'] // 2}B w{c['num_warps2']} {products[c['words2']]}"


def bench_decode_v4(hbm: float, sweep: bool) -> list[dict]:
    """DeepSeek-V4-Flash's experts (dim 4096, width 2048, top-6 of 256, MXFP4, clamped SwiGLU) on the device;
    --sweep: also the first of SWEEP."""
    layout, records = expert_pool("mxfp4", torch.Generator(device=DEV).manual_seed(5), V4_DIM)
    offsets = record_offsets(torch.randperm(EXPERTS, device=DEV), records)
    gen, rows = torch.Generator().manual_seed(5), []
    for cfg in [DecodeConfig()] + SWEEP[:1] * sweep:
        kernel = DecodeMoE(layout, V4_TOP_K, DEV, cfg, limit=V4_LIMIT)
        row = dict(case="moe_decode_v4", fmt="mxfp4", config=kernel.config.__dict__)
        rows += [decode_rows(hbm, kernel, records, offsets, t, V4_TOP_K, gen, **row) for t in (1, 2, 4, 8)]
    return rows


def bench_decode(hbm: float, sweep: bool) -> list[dict]:
    """V3's experts, NVFP4 and MXFP4: DecodeConfig() at 1-8 and 16 tokens; --sweep: SWEEP at 1-4 and 8 tokens
    (MXFP4: the first of it)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    rows = []
    configs = [DecodeConfig()] + SWEEP * sweep
    for fmt in ("nvfp4", "mxfp4"):
        layout, records = expert_pool(fmt, gen)
        offsets = record_offsets(torch.randperm(EXPERTS, device=DEV), records)
        for cfg in configs if fmt == "nvfp4" else configs[:2]:
            kernel = DecodeMoE(layout, TOP_K, DEV, cfg)
            for t in (*range(1, 9), 16) if cfg == configs[0] else (1, 2, 3, 4, 8):
                row = dict(case="moe_decode", fmt=fmt, config=kernel.config.__dict__)
                rows.append(decode_rows(hbm, kernel, records, offsets, t, TOP_K, cpu_gen, **row))
    return rows


def bench_decode_torch(hbm: float) -> list[dict]:
    """The same computation through torch: bf16 matmuls on dequantized weights (8 distinct sets of 8)."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    sets = [
        [
            (
                torch.randn(2 * INTER, DIM, device=DEV, generator=gen, dtype=torch.bfloat16),
                torch.randn(DIM, INTER, device=DEV, generator=gen, dtype=torch.bfloat16),
            )
            for _ in range(TOP_K)
        ]
        for _ in range(4)
    ]
    rows = []
    for t in (1, 4):
        x = torch.randn(t, DIM, device=DEV, dtype=torch.bfloat16)
        w = torch.rand(TOP_K, device=DEV)

        def call(experts, x=x, w=w):
            y = torch.zeros_like(x)
            for j, (w13, w2) in enumerate(experts):
                h = F.linear(x, w13)
                y += F.linear(F.silu(h[:, :INTER]) * h[:, INTER:], w2) * w[j]
            return y

        s = graph_time([lambda e=e: call(e) for e in sets * 3])
        nbytes = TOP_K * 3 * DIM * INTER * 2
        rows.append(
            {
                "case": "moe_decode_torch_bf16",
                "T": t,
                "us": s * 1e6,
                "GBps": nbytes / s / 1e9,
                "of_ceiling": nbytes / s / 1e9 / hbm,
            }
        )
    return rows


def bench_zero_copy(h2d: float) -> list[dict]:
    """The decode kernel reading its 8 records from pinned host memory (PCIe), T = 1."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    layout, records = expert_pool("nvfp4", gen)
    host = records[:64].cpu().pin_memory()  # 64 distinct-address records, 1.6 GB
    kernel = DecodeMoE(layout, TOP_K, DEV)
    x = torch.randn(1, DIM, device=DEV, dtype=torch.bfloat16)
    slots = torch.full((EXPERTS,), -1, device=DEV)
    offsets = record_offsets(slots, records, torch.arange(EXPERTS, device=DEV) % 64, host)
    routes = routings(1, torch.Generator().manual_seed(3), 8)
    kernel(x, routes[0][0], routes[0][1], records, offsets)
    s = graph_time([lambda r=r: kernel(x, r[0], r[1], records, offsets) for r in routes], reps=2)
    gbps = TOP_K * read_bytes(layout) / s / 1e9
    return [{"case": "moe_decode_zero_copy", "fmt": "nvfp4", "T": 1, "us": s * 1e6, "GBps": gbps, "of_h2d": gbps / h2d}]


def bench_prefill(hbm: float) -> list[dict]:
    """The grouped FP4 GEMMs (gate+up, then down) at T tokens, 256 experts, top-8 uniform routing."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    rows = []
    for fmt in ("nvfp4", "mxfp4"):
        layout, records = expert_pool(fmt, gen)
        offsets = record_offsets(torch.randperm(EXPERTS, device=DEV), records)
        for t in (512, 1024, 2048, 4096) if fmt == "nvfp4" else (4096,):
            routes = routings(t, torch.Generator().manual_seed(t), 2)
            x = torch.randn(t, DIM, device=DEV, dtype=torch.bfloat16)
            n_experts = offsets.numel()
            blocks = prefill_blocks(t * TOP_K, n_experts, layout)
            stages = []
            for ids, w, _ in routes:
                pairs, block_experts, _ = align_by_expert(ids, n_experts, blocks.rows)
                where = (pairs, block_experts, records, offsets, layout, blocks)
                act = gate_up(x, w, *where)
                stages.append((w, where, act))
            up = graph_time([partial(gate_up, x, st[0], *st[1]) for st in stages], reps=3)
            dn = graph_time([partial(down, st[2], t * TOP_K, *st[1]) for st in stages], reps=3)
            whole = graph_time([partial(moe_prefill, x, r[0], r[1], records, offsets, layout) for r in routes], 3)
            flops_up, flops_dn = 2 * t * TOP_K * 2 * INTER * DIM, 2 * t * TOP_K * DIM * INTER
            for case, sec, flops in (
                ("prefill_gate_up", up, flops_up),
                ("prefill_down", dn, flops_dn),
                ("prefill_moe", whole, flops_up + flops_dn),
            ):
                rows.append(
                    {
                        "case": case,
                        "fmt": fmt,
                        "T": t,
                        "us": sec * 1e6,
                        "TFLOPs": flops / sec / 1e12,
                        "block_m": blocks.block_m,
                        "tail_m": blocks.tail_m,
                    }
                )
    return rows


ATTENTION = {"q_a": (1536, 7168), "kv_a": (576, 7168), "q_b": (24576, 1536), "kv_b": (32768, 512), "o": (7168, 16384)}


def bench_fp8(hbm: float) -> list[dict]:
    """FP8 block GEMV over one layer's attention matrices at T = 1 (4 distinct copies each, so L2 does not
    keep them), against bf16 cuBLAS on the same shapes; and the W8A8 GEMM at T = 4096."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    mats = {
        name: [fp8_block_quantize(torch.randn(n, k, device=DEV, generator=gen) * 0.02) for _ in range(4)]
        for name, (n, k) in ATTENTION.items()
    }
    rows, total_s, total_b, bf16_s = [], 0.0, 0, 0.0
    x1 = {k: torch.randn(1, k, device=DEV, dtype=torch.bfloat16) for _, k in ATTENTION.values()}
    for name, (n, k) in ATTENTION.items():
        s = graph_time([lambda m=m, x=x1[k]: fp8_linear(x, *m) for m in mats[name]] * 4)
        dense = [m[0].to(torch.bfloat16) for m in mats[name]]
        sb = graph_time([lambda w=w, x=x1[k]: F.linear(x, w) for w in dense] * 4)
        nbytes = n * k + mats[name][0][1].numel() * 4
        total_s, total_b, bf16_s = total_s + s, total_b + nbytes, bf16_s + sb
        rows.append(
            {
                "case": f"fp8_gemv_{name}",
                "T": 1,
                "us": s * 1e6,
                "GBps": nbytes / s / 1e9,
                "of_ceiling": nbytes / s / 1e9 / hbm,
                "bf16_cublas_us": sb * 1e6,
            }
        )
    rows.append(
        {
            "case": "fp8_gemv_attention",
            "T": 1,
            "us": total_s * 1e6,
            "GBps": total_b / total_s / 1e9,
            "of_ceiling": total_b / total_s / 1e9 / hbm,
            "bf16_cublas_us": bf16_s * 1e6,
        }
    )
    x = torch.randn(4096, 7168, device=DEV, dtype=torch.bfloat16)
    for name in ("q_a", "o"):
        n, k = ATTENTION[name]
        xk = x if k == 7168 else torch.randn(4096, k, device=DEV, dtype=torch.bfloat16)
        s = graph_time([lambda m=m, xk=xk: fp8_linear(xk, *m) for m in mats[name]], reps=3)
        rows.append({"case": f"fp8_gemm_{name}", "T": 4096, "us": s * 1e6, "TFLOPs": 2 * 4096 * n * k / s / 1e12})
    return rows


GATE_TILES = [  # the router's scores: GateTiles() first, then neighbours (rows, columns per step, warps)
    GateTiles(),
    GateTiles(num_warps=4),
    GateTiles(block_d=2048),
    GateTiles(block_e=2),
    GateTiles(block_e=2, block_d=512, num_warps=4),
    GateTiles(block_d=512, num_warps=2),
]
GATE_CASES = {"gate_v3": (DIM, "sigmoid"), "gate_v4": (V4_DIM, "sqrtsoftplus")}  # E = EXPERTS in both
GATE_BYTES = 100e6  # distinct router weights per graph: twice the H100's 50 MB L2, so the copies come from HBM


def bench_gate(hbm: float) -> list[dict]:
    """The router's scores (x [T, D] bf16 @ weight [E, D] fp32 and the score function) at T = 1 and 4: gate_scores
    in GATE_TILES' tiles against the torch formula (cast, cuBLAS fp32 GEMV, score: three launches). Bytes: the fp32
    weight; max_err: the largest difference from the formula."""
    gen = torch.Generator(device=DEV).manual_seed(6)
    rows = []
    for case, (dim, score_func) in GATE_CASES.items():
        nbytes = EXPERTS * dim * 4
        copies = -(-int(GATE_BYTES) // nbytes)
        weights = [torch.randn(EXPERTS, dim, device=DEV, generator=gen) / dim**0.5 for _ in range(copies)]
        for t in (1, 4):
            x = torch.randn(t, dim, device=DEV, generator=gen).to(torch.bfloat16)
            calls = (weights * CALLS)[: max(CALLS, copies)]  # each copy's weight, in turn
            want = gate_scores_ref(x, weights[0], score_func)
            variants = [(f"{case}_torch", None)] + [(case, tiles) for tiles in GATE_TILES]
            for name, tiles in variants:
                if tiles is None:
                    fn, label, err = gate_scores_ref, "cast + cuBLAS fp32 GEMV + score", 0.0
                else:
                    fn = partial(gate_scores, tiles=tiles)
                    label = f"{tiles.block_e} rows x {tiles.block_d} cols w{tiles.num_warps}"
                    err = (fn(x, weights[0], score_func) - want).abs().max().item()  # compiles before capture
                s = graph_time([partial(fn, x, w, score_func) for w in calls])
                rows.append(
                    {
                        "case": name,
                        "T": t,
                        "us": s * 1e6,
                        "GBps": nbytes / s / 1e9,
                        "of_ceiling": nbytes / s / 1e9 / hbm,
                        "tiles": label,
                        "max_err": err,
                    }
                )
    return rows


SECTIONS = ("decode", "decode_v4", "decode_torch", "zero_copy", "prefill", "fp8", "gate")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--sweep", action="store_true", help="also time other decode tile configurations")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    only = a.only.split(",")
    lim = gpu_ceilings()
    hbm, h2d = lim["hbm_read_gbps"], lim["pinned_h2d_gbps"]
    rows: list[dict] = []
    if "decode" in only:
        rows += bench_decode(hbm, a.sweep)
    if "decode_v4" in only:
        rows += bench_decode_v4(hbm, a.sweep)
    if "decode_torch" in only:
        rows += bench_decode_torch(hbm)
    if "zero_copy" in only:
        rows += bench_zero_copy(h2d)
    if "prefill" in only:
        rows += bench_prefill(hbm)
    if "fp8" in only:
        rows += bench_fp8(hbm)
    if "gate" in only:
        rows += bench_gate(hbm)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_kernels.json").write_text(json.dumps({"ceilings": lim, "rows": rows}, indent=1))
    print(f"ceilings: {json.dumps(lim)}")
    for r in rows:
        cfg = config_name(r["config"], r["T"]) if "config" in r else ""
        cfg = f"{r['tiles']}, max err {r['max_err']:.1e}" if "tiles" in r else cfg
        if "TFLOPs" in r:
            rate = f"{r['TFLOPs']:>8.1f} TFLOP/s"
        else:
            rate = f"{r['GBps']:>8.0f} GB/s {100 * r.get('of_ceiling', r.get('of_h2d', 0)):>5.1f}%"
        print(f"{r['case']:<24} {r.get('fmt', ''):<6} T={r['T']:<5} {r['us']:>9.1f} us {rate}  {cfg}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
