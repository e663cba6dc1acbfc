"""Probe of MLA's decode attention core (kernels/mla_decode.py) against the torch formula at DeepSeek-V3's shape
(H 128, C 512, R 64, bf16), on the GPU machine:

    python scripts/probe_mla_decode.py [--quick] [--out DIR]        # GPU: compiles included, about a minute
    TRITON_INTERPRET=1 python scripts/probe_mla_decode.py --tiny    # CPU: every variant's arithmetic, small shapes

Cases: spans S of 256, 1024, 4096; (B, T) of (1, 1), (4, 1), (1, 4); the tokens at the span's end (every row
live) and, for T = 1, at its middle (a captured step's span past its position, masked -inf: half the rows live).
Variants: torch (mla_decode_ref, the formula attention.py runs) and mla_decode with the tile variants in VARIANTS.
Each is checked once against the formula in float64 (max |error| / max |ref|), then timed in a CUDA graph over
distinct copies of the caches (L2 keeps none of them). GB/s: the span's cache bytes, B S (C + R) 2, per second
(the kernel reads only the live tiles' rows), and its % of the HBM read ceiling measured in the same run.
Prints a table, then per case the fastest kernel variant against torch; writes probe_mla_decode.json under $OUT
or --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402
from ceilings import gpu_ceilings  # noqa: E402

from dsfp4.kernels.fp4_decode import interpreted, n_sms, triton  # noqa: E402
from dsfp4.kernels.mla_decode import MLADecodeConfig, mla_decode, mla_decode_ref, split_plan  # noqa: E402

V3 = dict(h=128, c=512, r=64)  # heads, kv_lora_rank, qk_rope_head_dim
TINY = dict(h=8, c=32, r=16)
SPANS, TINY_SPANS = (256, 1024, 4096), (37, 100)
BATCHES = ((1, 1), (4, 1), (1, 4))  # (B, T)
VARIANTS = {  # name -> config; rows x positions per tile, warps, pipeline stages, waves of programs per SM
    "default": MLADecodeConfig(),
    "w8": MLADecodeConfig(warps=8),
    "s32": MLADecodeConfig(block_s=32, stages=3),
    "s32 w8": MLADecodeConfig(block_s=32, warps=8, stages=3),
    "s128 w8": MLADecodeConfig(block_s=128, warps=8, stages=1),
    "r32 w8": MLADecodeConfig(rows=32, warps=8),
    "r32 s32 w8": MLADecodeConfig(rows=32, block_s=32, warps=8, stages=3),
    "waves2": MLADecodeConfig(waves=2),
    "waves4": MLADecodeConfig(waves=4),
    "noskip": MLADecodeConfig(skip_masked=False),
}
QUICK = ("default", "w8", "s32", "waves2")
TINY_VARIANTS = {  # tiles of 16 positions so that the small spans split
    "default": MLADecodeConfig(block_s=16),
    "r32 w8": MLADecodeConfig(rows=32, block_s=16, warps=8),
    "splits2": MLADecodeConfig(block_s=16, splits=2),
    "noskip": MLADecodeConfig(block_s=16, skip_masked=False),
}
EXTRA_ROWS = 64  # cache rows past the span in each copy's buffer (the model's views are slices of max_len rows)
GRAPH_BYTES = 256 << 20  # cache copies per case: L2 (50 MB) keeps none of them
CALLS, MAX_COPIES = 24, 256  # calls per graph at least; copies at most
TOL = 1e-2  # bf16 outputs


def inputs(b: int, t: int, s: int, pos: int, shape: dict, dev: torch.device, copies: int):
    """(qn, qp, mask, caches): q [B, T, H, C + R] split as attention.py splits it, a [T, S] mask for tokens at
    pos.., and `copies` (kv, pe) pairs: [:B, :S] slices of distinct [B, S + EXTRA_ROWS, C / R] buffers."""
    h, c, r = shape["h"], shape["c"], shape["r"]
    gen = torch.Generator(device=dev).manual_seed(s + 10 * b + t)
    q = (2 * torch.randn(b, t, h, c + r, device=dev, generator=gen)).bfloat16()
    rows = pos + torch.arange(t, device=dev)  # [T]
    mask = torch.zeros(t, s, device=dev).masked_fill_(torch.arange(s, device=dev)[None, :] > rows[:, None], -torch.inf)
    kv = torch.randn(copies, b, s + EXTRA_ROWS, c, device=dev, generator=gen).bfloat16()
    pe = torch.randn(copies, b, s + EXTRA_ROWS, r, device=dev, generator=gen).bfloat16()
    return q[..., :c], q[..., c:], mask, [(kv[i, :, :s], pe[i, :, :s]) for i in range(copies)]


def launch(cfg: MLADecodeConfig | None, qn, qp, kv, pe, scale: float, mask) -> torch.Tensor:
    if cfg is None:
        return mla_decode_ref(qn, qp, kv, pe, scale, mask)
    return mla_decode(qn, qp, kv, pe, scale, mask, cfg)


def probe_case(b: int, t: int, s: int, pos: int, shape: dict, variants: dict, dev: torch.device, hbm: float):
    """Rows of one case, one per variant (torch first); timed where there is an HBM ceiling (GB/s)."""
    timed = hbm > 0
    c, r = shape["c"], shape["r"]
    span_bytes = b * s * (c + r) * 2
    copies = min(MAX_COPIES, max(2, -(-GRAPH_BYTES // span_bytes))) if timed else 1
    qn, qp, mask, caches = inputs(b, t, s, pos, shape, dev, copies)
    scale = (c + r) ** -0.5
    kv, pe = caches[0]
    want = mla_decode_ref(qn.double(), qp.double(), kv.double(), pe.double(), scale, mask.double())
    rows, sms = [], n_sms(dev)
    for name, cfg in {"torch": None, **variants}.items():
        got = launch(cfg, qn, qp, kv, pe, scale, mask)
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        row = dict(S=s, B=b, T=t, live=pos + t, variant=name, bytes=span_bytes, rel_err=err)
        if cfg is not None:
            row_blocks = b * triton.cdiv(t * shape["h"], cfg.rows)
            row.update(dataclasses.asdict(cfg), splits=split_plan(s, row_blocks, sms, cfg)[0])
        if timed:
            calls = [lambda kv=kv, pe=pe, cfg=cfg: launch(cfg, qn, qp, kv, pe, scale, mask) for kv, pe in caches]
            sec = bk.graph_time(calls * -(-CALLS // len(calls)))
            row.update(us=sec * 1e6, GBps=span_bytes / sec / 1e9, of_ceiling=span_bytes / sec / 1e9 / hbm)
        rows.append(row)
        print(fmt_row(row), flush=True)
    return rows


def fmt_row(r: dict) -> str:
    rate = f"{r['us']:>8.1f} us {r['GBps']:>6.0f} GB/s {100 * r['of_ceiling']:>5.1f}%" if "us" in r else "-"
    split = f"/{r['splits']}" if "splits" in r else ""
    case = f"S={r['S']:<5} B={r['B']} T={r['T']} live={r['live']:<5}"
    return f"{case} {r['variant'] + split:<16} {rate}  err {r['rel_err']:.1e}"


def summary(rows: list[dict]) -> list[str]:
    """Per case: torch's time and the fastest kernel variant's, with the speedup."""
    cases: dict[tuple, list[dict]] = {}
    for r in (r for r in rows if "us" in r):
        cases.setdefault((r["S"], r["B"], r["T"], r["live"]), []).append(r)
    out = []
    for (s, b, t, live), rs in cases.items():
        torch_row = next(r for r in rs if r["variant"] == "torch")
        best = min((r for r in rs if r["variant"] != "torch"), key=lambda r: r["us"])
        fast = f"{best['variant']:<11} {best['us']:7.1f} us ({best['GBps']:5.0f} GB/s)"
        out.append(f"S={s:<5} B={b} T={t} live={live:<5} torch {torch_row['us']:7.1f} us, best {fast}: "
                   f"{torch_row['us'] / best['us']:4.1f}x")  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help=f"variants {QUICK} only")
    ap.add_argument("--tiny", action="store_true", help="CPU check under TRITON_INTERPRET=1: small shapes, no timing")
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    a = ap.parse_args()
    if a.tiny:
        assert interpreted(), "--tiny runs on the CPU interpreter: set TRITON_INTERPRET=1"
        dev, shape, spans, variants = torch.device("cpu"), TINY, TINY_SPANS, TINY_VARIANTS
    else:
        dev, shape, spans = torch.device("cuda"), V3, SPANS
        variants = {k: v for k, v in VARIANTS.items() if not a.quick or k in QUICK}
    lim = {} if a.tiny else gpu_ceilings()
    rows = []
    for s in spans:
        for b, t in BATCHES:
            for pos in dict.fromkeys([s - t] + ([s // 2] if t == 1 else [])):
                rows += probe_case(b, t, s, pos, shape, variants, dev, lim.get("hbm_read_gbps", 0.0))
    print(f"\nceilings: {json.dumps(lim)}")
    print("\n".join(summary(rows)))
    failed = [f"{fmt_row(r)}" for r in rows if not r["rel_err"] < TOL and r["variant"] != "torch"]
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else a.out
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "probe_mla_decode.json").write_text(json.dumps({"ceilings": lim, "rows": rows}, indent=1))
    print(f"wrote {out_dir / 'probe_mla_decode.json'}" + "".join(f"\nFAIL {f}" for f in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
