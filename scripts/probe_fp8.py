"""Probes of the FP8 decode GEMV (kernels/fp8_linear.py's fp8_gemv; kernels/fp8_gemv.py's piece kernel) at
DeepSeek-V3's attention, shared-expert and dense-MLP shapes:

    python scripts/probe_fp8.py [--quick] [--out DIR]        # GPU: ~3 minutes on an H100, compiles included
    TRITON_INTERPRET=1 python scripts/probe_fp8.py --tiny    # CPU: every variant's arithmetic at small shapes
    python scripts/probe_fp8.py --aot                        # no GPU: sm_90 builds, registers, SASS per byte

Variants, each run once against fp8_linear_ref (max |error| / max |ref|; loads: their int32 sums, exactly), then
timed in a CUDA graph over enough copies of the weights that L2 keeps none of them:
  legacy       fp8_gemv_kernel as before the piece kernel (16 rows, 512 columns per step, K split + split sums);
  product      fp8_gemv as shipped: GEMV_MATH with gemv_plan's tiles;
  loads        the piece kernel's reads alone (its words summed as int32), per tiling;
  f32, f16x2   the piece kernel's maths per tiling: rows per program, columns per step, warps (K split by
               gemv_plan's rule where the rows leave SMs idle); f16x2 is its PTX, with x scaled per piece.
Prints per shape and T: us, GB/s, % of the HBM read ceiling measured in the same run, error; then per variant the
sums over one MoE layer (attention + shared expert), one dense layer and bench_model's step (4 MoE + 1 dense), and
per maths the fastest tiling of each shape. Writes probe_fp8.json under $OUT or --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402
from ceilings import gpu_ceilings  # noqa: E402

from dsfp4.kernels import fp8_linear as f8  # noqa: E402
from dsfp4.kernels.fp4_decode import interpreted, n_sms, triton  # noqa: E402
from dsfp4.kernels.fp8_gemv import PIECE, WORD, fp8_gemv_pieces_kernel  # noqa: E402
from dsfp4.layout.fp8 import FP8_BLOCK, fp8_block_quantize  # noqa: E402

SHAPES = {  # (N, K) of DeepSeek-V3's backbone matrices
    "wq_a": (1536, 7168), "wq_b": (24576, 1536), "wkv_a": (576, 7168), "wo": (7168, 16384),
    "sh_w13": (2048, 7168), "sh_w2": (7168, 2048), "d_w13": (18432, 7168), "d_w2": (7168, 18432),
}  # fmt: skip
TINY_SHAPES = {"ragged": (200, 256), "split": (72, 1024), "tall": (520, 512)}
ATTENTION = ("wq_a", "wq_b", "wkv_a", "wo")
LAYERS = {"moe": ATTENTION + ("sh_w13", "sh_w13", "sh_w2"), "dense": ATTENTION + ("d_w13", "d_w13", "d_w2")}
STEP = {"moe": 4, "dense": 1}  # bench_model's 5-layer model: 1 dense + 4 MoE layers
TILINGS = ((16, 1024, 4), (8, 1024, 4), (4, 1024, 4), (16, 512, 4), (32, 1024, 4), (16, 2048, 4), (16, 2048, 8))
QUICK_TILINGS = TILINGS[:3]  # (rows per program, columns per step, warps); T = 4 takes the first four
TINY_TILINGS = ((16, 256, 4), (4, 512, 4))
MAX_ACC_ROWS = 64  # tilings with more rows x tokens than this are skipped (their accumulators spill)
GRAPH_BYTES = 256 << 20  # weight copies per shape: L2 (50 MB) keeps none of them
CALLS = 24  # calls per graph, at least
TOL = 1e-2  # bf16 outputs


if triton is not None:
    import triton.language as tl

    _PIECE, _WORD = tl.constexpr(PIECE), tl.constexpr(WORD)

    @triton.jit
    def _loads_kernel(q_ptr, out_ptr, N, K, stride_qn, k_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The piece kernel's reads alone (the same words, tiles and prefetch), summed into one int32 per program."""
        P: tl.constexpr = BLOCK_K // _PIECE
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        piece = tl.arange(0, P)[:, None, None] * _PIECE
        words = tl.arange(0, P)[:, None, None] * (_PIECE // _WORD) + tl.arange(0, _PIECE // _WORD)[None, None, :]
        w_rows = q_ptr.to(tl.pointer_type(tl.int32)) + (rows % N)[None, :, None] * (stride_qn // _WORD)
        k_start = pid_s * k_split
        k_end = tl.minimum(k_start + k_split, K)
        acc = tl.zeros((P, BLOCK_N, _PIECE // _WORD), dtype=tl.int32)
        w = tl.load(w_rows + k_start // _WORD + words, mask=k_start + piece < k_end, other=0)
        for k0 in range(k_start, k_end, BLOCK_K):
            acc += w
            nxt = k0 + BLOCK_K
            w = tl.load(w_rows + nxt // _WORD + words, mask=nxt + piece < k_end, other=0)
        tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_s, tl.sum(tl.sum(tl.sum(acc, 2), 1), 0))


@dataclass(frozen=True)
class Var:
    """A variant: kind (legacy, product, loads, f32, f16x2) and, for the piece kernel's, its tiling."""

    kind: str
    rows: int = 0
    block_k: int = 0
    warps: int = 4

    def name(self) -> str:
        tile = f" r{self.rows} k{self.block_k} w{self.warps}" if self.rows else ""
        return (f"product {f8.GEMV_MATH}" if self.kind == "product" else self.kind) + tile

    def plan(self, t: int, n: int, k: int, n_sms: int) -> f8.GemvPlan:
        if self.kind in ("legacy", "product"):
            return f8.gemv_plan(t, n, k, n_sms, "legacy" if self.kind == "legacy" else None)
        math = "f32" if self.kind == "loads" else self.kind
        return f8.gemv_plan(t, n, k, n_sms, math, self.rows, self.block_k, self.warps)


def loads_expected(q: torch.Tensor, p: f8.GemvPlan) -> torch.Tensor:
    """What _loads_kernel stores: per program (row block, split), its rows' (r % N) words summed, wrapped to int32."""
    n, k = q.shape
    words = q.view(torch.int32).long()  # [N, K / 4]
    blocks = torch.arange(triton.cdiv(n, p.block_n), device=q.device)
    rows = (blocks[:, None] * p.block_n + torch.arange(p.block_n, device=q.device)) % n  # [blocks, BN]
    per = torch.nn.functional.pad(words[rows].sum(1), (0, p.split * p.k_split // WORD - k // WORD))
    sums = per.view(len(blocks), p.split, -1).sum(-1).flatten()
    return ((sums + 2**31) % 2**32 - 2**31).to(torch.int32)


def launch(v: Var, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, p: f8.GemvPlan, out: torch.Tensor | None):
    """One call of v (x: [T, K])."""
    if v.kind != "loads":
        return f8.gemv_launch(x, q, s, p)
    n, k = q.shape
    grid = (triton.cdiv(n, p.block_n), p.split)
    _loads_kernel[grid](
        q, out, n, k, q.stride(0), p.k_split, BLOCK_N=p.block_n, BLOCK_K=p.block_k, num_warps=p.num_warps
    )
    return out


class Probe:
    def __init__(self, hbm: float, n_sms: int, dev: torch.device):
        self.hbm, self.n_sms, self.dev, self.rows, self.failed = hbm, n_sms, dev, [], []

    def run(self, shape: str, mats: list, x: torch.Tensor, v: Var) -> None:
        """Checks v on the first copy of the weights, then times it over all copies (when there is a ceiling)."""
        (t, k), n = x.shape, mats[0][0].shape[0]
        p = v.plan(t, n, k, self.n_sms)
        q, s = mats[0]
        out = torch.empty(p.split * triton.cdiv(n, p.block_n), dtype=torch.int32, device=self.dev)
        got = launch(v, x, q, s, p, out)
        if v.kind == "loads":
            err = float(not torch.equal(got, loads_expected(q, p)))
        else:
            want = f8.fp8_linear_ref(x.float(), q, s).double()
            err = (got.double() - want).abs().max().item() / want.abs().max().item()
        row = dict(shape=shape, N=n, K=k, T=t, variant=v.name(), kind=v.kind, math=p.math, rows=p.block_n,
                   block_k=p.block_k, warps=p.num_warps, split=p.split, bytes=nbytes(q, s), rel_err=err)  # fmt: skip
        if not err <= (0.0 if v.kind == "loads" else TOL):
            self.failed.append(f"{shape} T={t} {v.name()}: error {err:.2e}")
        if self.hbm:
            calls = [lambda m=m: launch(v, x, *m, p, out) for m in mats] * -(-CALLS // len(mats))
            sec = bk.graph_time(calls)
            gbps = row["bytes"] / sec / 1e9
            row.update(us=sec * 1e6, GBps=gbps, of_ceiling=gbps / self.hbm)
        self.rows.append(row)
        print(fmt_row(row), flush=True)


def nbytes(q: torch.Tensor, s: torch.Tensor) -> int:
    return q.numel() + s.numel() * s.element_size()


def fmt_row(r: dict) -> str:
    rate = f"{r['us']:>8.1f} us {r['GBps']:>6.0f} GB/s {100 * r['of_ceiling']:>5.1f}%" if "us" in r else "-"
    tile = f"{r['rows']:>2}x{r['block_k']:<5} /{r['split']}"
    return f"{r['shape']:<7} T={r['T']:<2} {r['variant']:<26} {tile} {rate}  err {r['rel_err']:.1e}"


def fastest(rows: list[dict]) -> dict[tuple, dict]:
    """(variant, T) -> {shape: row}; `best <kind>` (loads, f32, f16x2) takes each shape's fastest tiling."""
    groups: dict[tuple, dict] = {}
    for r in (r for r in rows if "us" in r):
        for name in {r["variant"], f"best {r['kind']}" if r["kind"] not in ("legacy", "product") else r["variant"]}:
            g = groups.setdefault((name, r["T"]), {})
            if r["shape"] not in g or r["us"] < g[r["shape"]]["us"]:
                g[r["shape"]] = r
    return groups


def layer_sums(rows: list[dict], hbm: float) -> list[dict]:
    """Per variant and T: us and % of the ceiling over a MoE layer, a dense layer and the 5-layer step."""
    out = []
    for (name, t), g in fastest(rows).items():
        row = dict(variant=name, T=t)
        for layer, parts in [*LAYERS.items(), ("step", [p for lay, n in STEP.items() for p in LAYERS[lay] * n])]:
            if all(p in g for p in parts):
                sec = sum(g[p]["us"] for p in parts) / 1e6
                row[layer] = dict(us=sec * 1e6, of_ceiling=sum(g[p]["bytes"] for p in parts) / sec / 1e9 / hbm)
        out.append(row)
    return out


def report(rows: list[dict], sums: list[dict]) -> None:
    """The layer sums, best first, then each maths' fastest tiling per shape (the table gemv_plan could take)."""
    for r in sorted(sums, key=lambda r: (r["T"], -r.get("step", {}).get("of_ceiling", 0))):
        parts = [f"{lay} {r[lay]['us']:7.1f} us {100 * r[lay]['of_ceiling']:5.1f}%" for lay in ("moe", "dense", "step")
                 if lay in r]  # fmt: skip
        print(f"T={r['T']:<2} {r['variant']:<26} " + "  ".join(parts))
    for (name, t), g in sorted(fastest(rows).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if name.startswith("best"):
            tiles = [
                f"{s} {r['rows']}x{r['block_k']}w{r['warps']}/{r['split']} {100 * r['of_ceiling']:.0f}%"
                for s, r in g.items()
            ]
            print(f"T={t:<2} {name:<11} " + ", ".join(tiles))


def variants(t: int, tilings: tuple) -> list[Var]:
    tiles = [tile for tile in tilings[: None if t == 1 else 4] if tile[0] * t <= MAX_ACC_ROWS]
    out = [Var("legacy"), Var("product")] + [Var("loads", *tile) for tile in tiles if t == 1]
    return out + [Var(kind, *tile) for kind in ("f32", "f16x2") for tile in tiles]


def weights(n: int, k: int, dev: torch.device, copies: int) -> list:
    """copies of one random FP8 matrix (distinct memory, the same bytes) with its scales."""
    gen = torch.Generator(device=dev).manual_seed(n + k)
    q, s = fp8_block_quantize(torch.randn(n, k, device=dev, generator=gen) * torch.logspace(-1, 1, k, device=dev))
    return [(q.clone(), s.clone()) for _ in range(copies)]


def probe(a) -> int:
    dev = torch.device("cpu") if a.tiny else torch.device("cuda")
    if a.tiny:
        assert interpreted(), "--tiny runs on the CPU interpreter: set TRITON_INTERPRET=1"
    lim = {} if a.tiny else gpu_ceilings()
    pr = Probe(lim.get("hbm_read_gbps", 0.0), n_sms(dev), dev)
    shapes, tilings = (TINY_SHAPES, TINY_TILINGS) if a.tiny else (SHAPES, QUICK_TILINGS if a.quick else TILINGS)
    for shape, (n, k) in shapes.items():
        mats = weights(n, k, dev, 1 if a.tiny else max(2, -(-GRAPH_BYTES // (n * k))))
        for t in (1, 3) if a.tiny else (1, 4):
            x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(dev, torch.bfloat16)
            for v in variants(t, tilings):
                pr.run(shape, mats, x, v)
        del mats
    sums = layer_sums(pr.rows, pr.hbm) if pr.hbm else []
    print(f"\nceilings: {json.dumps(lim)}")
    report(pr.rows, sums)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else a.out
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "probe_fp8.json").write_text(json.dumps({"ceilings": lim, "rows": pr.rows, "sums": sums}, indent=1))
    print(f"wrote {out_dir / 'probe_fp8.json'}" + "".join(f"\nFAIL {f}" for f in pr.failed))
    return 1 if pr.failed else 0


# ---- --aot: sm_90 builds without a GPU -------------------------------------------------------------------------

AOT_INTS = ("N", "K", "stride_xt", "stride_qn", "stride_ot", "stride_os", "k_split")  # multiples of 16, specialized
AOT_PTRS = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", out_ptr="*bf16")


def aot_build(fn, consts: dict, warps: int, ptrs: dict = AOT_PTRS) -> tuple[int, int, str]:
    """fn built for sm_90 (the other arguments i32) -> (registers, stack bytes, SASS by Triton's nvdisasm)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: "constexpr" if a in consts else ptrs.get(a, "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in ptrs or a in AOT_INTS}
    where = {(fn.arg_names.index(c),): v for c, v in consts.items()}
    k = triton.compile(ASTSource(fn, sig, where, attrs), target=GPUTarget("cuda", 90, 64), options={"num_warps": warps})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage, sass = (subprocess.run([tools / tool, *flags, f.name], capture_output=True, text=True, check=True).stdout
                       for tool, flags in (("cuobjdump", ["--dump-resource-usage"]), ("nvdisasm", ["-c"])))  # fmt: skip
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return regs, stack, sass


def step_instructions(sass: str, t: int) -> int:
    """SASS instructions one K step issues: the longest loop's body, plus (t - 1) times the loops nested in it
    (fp8_gemv_kernel's token loop; the piece kernel unrolls its tokens)."""
    labels, loops, n = {}, [], 0
    for line in sass.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line):
            labels[m.group(1)] = n
        elif m := re.match(r"^\s*/\*[0-9a-f]+\*/\s+([^;]*);", line):
            if (b := re.search(r"BRA\s+`?\(?(\.L_x_\d+)", m.group(1))) and b.group(1) in labels:
                loops.append((labels[b.group(1)], n))
            n += 1
    outer = max(loops, key=lambda span: span[1] - span[0])
    inner = [s for s in loops if s != outer and outer[0] <= s[0] and s[1] <= outer[1]]
    return outer[1] - outer[0] + 1 + (t - 1) * sum(e - b + 1 for b, e in inner)


def aot(tilings: tuple) -> int:
    assert not interpreted(), "--aot builds real kernels: unset TRITON_INTERPRET"
    print(f"Triton {triton.__version__}, sm_90: registers, stack (spill) bytes, SASS per K step and per weight byte")
    builds = []
    for t in (1, 4):
        legacy = dict(BLOCK_T=t, BLOCK_N=f8.GEMV_BLOCK_N, BLOCK_K=f8.GEMV_MAX_BLOCK_K, SCALE_BLOCK=FP8_BLOCK)
        builds.append((f"legacy T={t}", f8.fp8_gemv_kernel, legacy | ({"T": 1} if t == 1 else {}), 4, t))
        for rows, block_k, warps in (tile for tile in tilings if tile[0] * t <= MAX_ACC_ROWS):
            tile = dict(BLOCK_N=rows, BLOCK_K=block_k)
            if t == 1:
                builds.append((f"loads r{rows} k{block_k} w{warps}", _loads_kernel, tile, warps, 1))
            for math in ("f32", "f16x2"):
                consts = tile | dict(T=t, SCALE_BLOCK=FP8_BLOCK, F16X2=math == "f16x2", USE_ASM=True)
                builds.append((f"{math} r{rows} k{block_k} w{warps} T={t}", fp8_gemv_pieces_kernel, consts, warps, t))
    for name, fn, consts, warps, t in builds:
        ptrs = dict(q_ptr="*fp8e4nv", out_ptr="*i32") if fn is _loads_kernel else AOT_PTRS
        regs, stack, sass = aot_build(fn, consts, warps, ptrs)
        per_thread = consts["BLOCK_N"] * consts["BLOCK_K"] / (32 * warps)  # weight bytes per thread and step
        n = step_instructions(sass, t)
        print(
            f"{name:<26} regs {regs:>3} stack {stack:>4} {n:>6} per step / {per_thread:>4.0f} B = {n / per_thread:5.2f}"
        )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help=f"tilings {QUICK_TILINGS} only")
    ap.add_argument("--tiny", action="store_true", help="CPU check under TRITON_INTERPRET=1: small shapes, no timing")
    ap.add_argument("--aot", action="store_true", help="sm_90 builds of every variant: registers, spills, SASS")
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    a = ap.parse_args()
    return aot(QUICK_TILINGS if a.quick else TILINGS) if a.aot else probe(a)


if __name__ == "__main__":
    raise SystemExit(main())
