"""Probes of the decode MoE kernel (kernels/moe_decode.py) at DeepSeek-V3's expert shape, on the GPU machine:

    python scripts/probe_decode.py [--quick] [--out DIR]              # H100: ~4 minutes, compiles included
    TRITON_INTERPRET=1 python scripts/probe_decode.py --tiny          # CPU: indexing and arithmetic checks

GB/s on the distinct experts' bytes of the part read, and the fraction of the HBM ceiling measured here, of:
  base     DecodeMoE whole, its gate+up launch alone, its down launch alone;
  loads    gate+up's bytes summed (codes as i32 words): tilings (rows per program, gate then up rows; bytes per
           row per chunk), 4 or 8 warps (H1);
  gate_up  silu(gate) * up * weight (fp32 rows) in maths f32 (today's), f16 (Triton fp16: code * 2^14 * x summed
           in fp16 per 8-byte piece), hfma2 (that as fp16x2 PTX, H2), words (PTX on the loaded 32-bit code words,
           x permuted to pair with them: no byte unpacking), *pre (x pre-scaled by 2^s per token: no 2^14
           multiply); x read as today (x2: stride 2), as even/odd halves (split, H3), or permuted (perm);
  down     W2 rows times each pair's activation row; full: prep + fastest gate+up + fastest down + slot sum.
Variants compute every pair's expert (no leader/run: at T = 4 the few pairs sharing an expert read it again)
while bytes count distinct experts. --tiny: dim 448 (tail chunks), width 64, 16 experts, top-4, T = 1, 2,
nothing timed, the PTX maths as their Triton formulations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402
from ceilings import gpu_ceilings  # noqa: E402

from dsfp4.kernels.fp4_decode import block_scale, e2m1_halves, hw_e4m3, interpreted, triton  # noqa: E402
from dsfp4.kernels.moe_decode import DecodeMoE, _down_kernel, _gate_up_kernel, _group_sums  # noqa: E402
from dsfp4.kernels.moe_ref import record_at, record_offsets  # noqa: E402
from dsfp4.kernels.swiglu import swiglu_tl  # noqa: E402
from dsfp4.layout.formats import get_format, next_pow2  # noqa: E402

TILINGS = ((32, 128), (16, 256), (8, 512), (4, 1024), (8, 1024))  # (rows per program, bytes per row per chunk)
GU_MATHS = (("f32", "x2"), ("f32", "split"), ("f16", "split"), ("hfma2", "x2"), ("hfma2", "split"),
            ("hfma2pre", "split"), ("words", "perm"), ("wordspre", "perm"))  # fmt: skip
XS = {"x2": 2, "split": 1, "perm": 4}  # how _rows reads x
DOWN_NOW = (16, 128)  # DecodeConfig's down tiling
TOL = 1e-2


def fp16x2_asm(words: bool, scale: bool) -> str:
    """PTX: codes placed in fp16 halves (sign to bit 15, magnitude to bits 9-11: code * 2^-14), times 2^14 unless x
    is pre-scaled, into an fp16x2 accumulator with their x pairs; its halves summed in fp32 go to every output.
    Bytes (pack=8: u8 codes $8-$9, fp16 xe $10-$13, xo $14-$17, element 2i low): byte pair (2i, 2i+1) spread by
    prmt as in fp4_decode.e2m1_halves, low nibbles meet xe pair i, high ones xo pair i. Words (pack=2: i32 words
    $2-$3, i64 x quads $4-$5 and $6-$7 = fp16 x0 x4 x1 x5 | x2 x6 x3 x7): word << 4k has the codes of elements
    3 - k and 7 - k at the top of its halves, to meet (x[3-k], x[7-k])."""
    lines = ["{", ".reg .b32 t, a, b, w, acc, c, p<4>;", ".reg .b16 l, h;", ".reg .f32 fl, fh;"]
    lines += ["mov.b32 c, 0x74007400;", "mov.b32 acc, 0;"]  # c: 2^14 in both halves
    for i in range(2 if words else 4):
        if words:
            lines += [f"mov.b64 {{p0, p1}}, ${4 + i};", f"mov.b64 {{p2, p3}}, ${6 + i};"]
        else:
            lines.append(f"prmt.b32 t, ${8 + i // 2}, 0, {'0x4342' if i % 2 else '0x4140'};")  # [b, 0, b', 0]
        for k in range(4 if words else 2):
            if words:
                lines += [f"shl.b32 t, ${2 + i}, {4 * k};", "and.b32 a, t, 0x70007000;", "shr.b32 a, a, 3;"]
                lines += ["and.b32 w, t, 0x80008000;", "or.b32 w, w, a;"]
            else:
                lines += [f"shl.b32 a, t, {12 - 4 * k};", "and.b32 a, a, 0x80008000;", f"shl.b32 b, t, {9 - 4 * k};"]
                lines += ["and.b32 b, b, 0x0E000E00;", "or.b32 w, a, b;"]
            x = f"p{3 - k}" if words else f"${10 + 4 * k + i}"
            lines += ["mul.rn.f16x2 w, w, c;"] * scale + [f"fma.rn.f16x2 acc, w, {x}, acc;"]
    lines += ["mov.b32 {l, h}, acc;", "cvt.f32.f16 fl, l;", "cvt.f32.f16 fh, h;", "add.f32 $0, fl, fh;"]
    return "\n".join(lines + [f"mov.b32 ${i}, $0;" for i in range(1, 2 if words else 8)] + ["}"])


if triton is not None:
    import triton.language as tl

    from dsfp4.kernels.fp4_decode import fp16_low, words_sums

    _HFMA2, _HFMA2_PRE = tl.constexpr(fp16x2_asm(False, True)), tl.constexpr(fp16x2_asm(False, False))
    _WORDS = tl.constexpr(fp16x2_asm(True, True))  # unscaled x (the pre-scaled one: fp4_decode.words_sums)
    _PACK8 = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 10))

    @triton.jit
    def _first(a, b):
        return a

    @triton.jit
    def _chunk(wrow, srow, kb, KB: tl.constexpr, BKB: tl.constexpr, GB: tl.constexpr, E: tl.constexpr):
        """Codes [R, BKB / E] (E bytes each) and scale bytes [R, BKB / GB] at byte kb of rows of KB bytes."""
        cols = kb // E + tl.arange(0, BKB // E)[None, :]
        sc = kb // GB + tl.arange(0, BKB // GB)[None, :]
        return tl.load(wrow + cols, mask=cols < KB // E, other=0), tl.load(srow + sc, mask=sc < KB // GB, other=0)

    @triton.jit
    def _sums16(packed, xe, xo, GB: tl.constexpr, ASM: tl.constexpr, PRE: tl.constexpr, USE_ASM: tl.constexpr):
        """fp16 products code * 2^14 * x (code * x * 2^s with PRE) summed in fp16 per 8-byte piece, pieces
        summed per scale block in fp32: [R, BKB / GB] (packed: u8 [R, BKB], xe, xo: fp16 [1, BKB])."""
        R: tl.constexpr = packed.shape[0]
        NP: tl.constexpr = packed.shape[1] // 8
        if ASM:
            asm: tl.constexpr = _HFMA2_PRE if PRE else _HFMA2
            y = tl.inline_asm_elementwise(asm, _PACK8, [packed, xe, xo], dtype=tl.float32, is_pure=True, pack=8)
            piece = tl.reduce(tl.reshape(y, (R, NP, 8)), 2, _first)  # the 8 outputs of a piece are equal
        else:
            lo, hi = e2m1_halves(packed, USE_ASM)  # fp32, code * 2^-14
            lo, hi = (lo * (1.0 if PRE else 16384.0)).to(tl.float16), (hi * (1.0 if PRE else 16384.0)).to(tl.float16)
            piece = tl.sum(tl.reshape(lo * xe + hi * xo, (R, NP, 8)), 2).to(tl.float32)
        return tl.sum(tl.reshape(piece, (R, NP * 8 // GB, GB // 8)), 2)

    @triton.jit
    def _sums_words(words, xa, xb, GB: tl.constexpr, ASM: tl.constexpr, PRE: tl.constexpr):
        """_sums16 from code words (i32 [R, BW]) and permuted x quads (i64 [1, BW]). PRE: the product's
        fp4_decode.words_sums; else codes times 2^14 meet unscaled x (PTX, or the same in Triton)."""
        R: tl.constexpr = words.shape[0]
        NP: tl.constexpr = words.shape[1] // 2
        if PRE:
            piece = words_sums(words, xa, xb, ASM)
        elif ASM:
            y = tl.inline_asm_elementwise(_WORDS, "=r,=r,r,r,l,l,l,l", [words, xa, xb], dtype=tl.float32,
                                          is_pure=True, pack=2)  # fmt: skip
            piece = tl.reduce(tl.reshape(y, (R, NP, 2)), 2, _first)
        else:
            w = words.to(tl.uint32, bitcast=True)
            xa, xb = xa.to(tl.uint64, bitcast=True), xb.to(tl.uint64, bitcast=True)
            acc = tl.zeros(words.shape, tl.float16)
            for k in tl.static_range(4):
                t = w << (4 * k)
                o = (t & 0x80008000) | ((t & 0x70007000) >> 3)
                x = (xb if k < 2 else xa) >> (32 * ((k + 1) % 2))  # pair 3 - k
                scaled = (fp16_low(o) * 16384.0).to(tl.float16) * fp16_low(x)
                acc += scaled + (fp16_low(o >> 16) * 16384.0).to(tl.float16) * fp16_low(x >> 16)
            piece = tl.sum(tl.reshape(acc, (R, NP, 2)), 2).to(tl.float32)
        return tl.sum(tl.reshape(piece, (R, NP * 8 // GB, GB // 8)), 2)

    @triton.jit
    def _gu_rows(ids_ptr, off_ptr, rec_ptr, BN: tl.constexpr, INTER: tl.constexpr):
        """A gate+up program's pair p, block b, expert record and rows (BN gate rows, then their up rows)."""
        p = tl.program_id(0) // (INTER // BN)
        b = tl.program_id(0) % (INTER // BN)
        wbase = rec_ptr + tl.multiple_of(tl.load(off_ptr + tl.load(ids_ptr + p)), 16)
        r = tl.arange(0, 2 * BN)
        return p, b, wbase, tl.where(r < BN, b * BN + r % BN, b * BN + r % BN + INTER)[:, None]

    @triton.jit
    def _rows(
        wrow, srow, xe_ptr, xo_ptr, XS: tl.constexpr, KB: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr,
        BKB: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr, PRE: tl.constexpr, HW_E4M3: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):  # fmt: skip
        """sum_k W[r, k] x[k] over FP4 rows of KB bytes (wrow, srow: u8 [R, 1]) before the global scale: [R].
        Byte j meets xe[j * XS] and xo[j * XS] (XS = 4: words, x quads at xe). Next chunk loaded first."""
        R: tl.constexpr = wrow.shape[0]
        E: tl.constexpr = 4 if XS == 4 else 1
        wrow = wrow.to(tl.pointer_type(tl.int32)) if XS == 4 else wrow
        acc = tl.zeros((R, 2 * BKB // GROUP), dtype=tl.float32)
        packed, sb = _chunk(wrow, srow, 0, KB, BKB, GROUP // 2, E)
        for kb in range(0, KB, BKB):
            nxt, nsb = _chunk(wrow, srow, kb + BKB, KB, BKB, GROUP // 2, E)
            j = kb + tl.arange(0, BKB)
            if XS == 4:
                i = (kb // 4 + tl.arange(0, BKB // 4))[:, None] * 2 + tl.arange(0, 2)[None, :]
                xa, xb = tl.split(tl.load(xe_ptr + i, mask=i < KB // 2, other=0))
                s = _sums_words(packed, xa[None, :], xb[None, :], GROUP // 2, ASM, PRE)
            else:
                xe = tl.load(xe_ptr + j * XS, mask=j < KB, other=0)
                xo = tl.load(xo_ptr + j * XS, mask=j < KB, other=0)
                if F16:
                    s = _sums16(packed, xe.to(tl.float16)[None, :], xo.to(tl.float16)[None, :], GROUP // 2, ASM,
                                PRE, USE_ASM)  # fmt: skip
                else:
                    s = _group_sums(packed, xe.to(tl.float32), xo.to(tl.float32), GROUP, USE_ASM)
            acc += s * block_scale(sb, E8M0, HW_E4M3)
            packed, sb = nxt, nsb
        return tl.sum(acc, 1)

    @triton.jit
    def _gu_kernel(
        x_ptr, ids_ptr, rw_ptr, inv_ptr, rec_ptr, off_ptr, act_ptr, stride_xt, K: tl.constexpr, BN: tl.constexpr,
        BKB: tl.constexpr, XS: tl.constexpr, XO: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr,
        PRE: tl.constexpr, UNB: tl.constexpr, PERM: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
        W13: tl.constexpr, S13: tl.constexpr, W2: tl.constexpr, S2: tl.constexpr, G: tl.constexpr,
        GROUP: tl.constexpr, E8M0: tl.constexpr, HW_E4M3: tl.constexpr, USE_ASM: tl.constexpr,
    ):  # fmt: skip
        """BN gate rows and their up rows of pair p's expert (x: row p // K, odd half XO on); the activation
        row gets even elements first, or (PERM, for a words down) each 8 in the order 0 4 1 5 2 6 3 7."""
        p, b, wbase, rows = _gu_rows(ids_ptr, off_ptr, rec_ptr, BN, INTER)
        x_row = x_ptr + (p // K) * stride_xt
        dot = _rows(wbase + W13 + rows * (D // 2), wbase + S13 + rows * (D // GROUP), x_row, x_row + XO, XS, D // 2,
                    GROUP, E8M0, BKB, F16, ASM, PRE, HW_E4M3, USE_ASM)  # fmt: skip
        gate, up = tl.split(tl.permute(tl.reshape(dot, (2, BN)), (1, 0)))
        g_gate, g_up = UNB, UNB
        if G >= 0:
            gp = (wbase + G).to(tl.pointer_type(tl.float32))
            g_gate, g_up = tl.load(gp) * UNB, tl.load(gp + 1) * UNB
        inv = tl.load(inv_ptr + p // K)
        act = swiglu_tl(gate * (g_gate * inv), up * (g_up * inv), 0.0) * tl.load(rw_ptr + p)
        n = b * BN + tl.arange(0, BN)
        dest = n - n % 8 + 2 * (n % 4) + (n % 8) // 4 if PERM else (n % 2) * (INTER // 2) + n // 2
        tl.store(act_ptr + p * INTER + dest, act)

    @triton.jit
    def _dn_kernel(
        ids_ptr, rec_ptr, off_ptr, act_ptr, out_ptr, BN: tl.constexpr, BKB: tl.constexpr, XS: tl.constexpr,
        F16: tl.constexpr, ASM: tl.constexpr, UNB: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
        W13: tl.constexpr, S13: tl.constexpr, W2: tl.constexpr, S2: tl.constexpr, G: tl.constexpr,
        GROUP: tl.constexpr, E8M0: tl.constexpr, HW_E4M3: tl.constexpr, USE_ASM: tl.constexpr,
    ):  # fmt: skip
        """BN rows of pair p's W2 times its activation row (halves contiguous, or quads for words)."""
        p = tl.program_id(0) // (D // BN)
        wbase = rec_ptr + tl.multiple_of(tl.load(off_ptr + tl.load(ids_ptr + p)), 16)
        rows = (tl.program_id(0) % (D // BN)) * BN + tl.arange(0, BN)
        a = act_ptr + p * (INTER // 4 if XS == 4 else INTER)
        dot = _rows(wbase + W2 + rows[:, None] * (INTER // 2), wbase + S2 + rows[:, None] * (INTER // GROUP), a,
                    a + INTER // 2, XS, INTER // 2, GROUP, E8M0, BKB, F16, ASM, False, HW_E4M3, USE_ASM)  # fmt: skip
        g = UNB
        if G >= 0:
            g = tl.load((wbase + G).to(tl.pointer_type(tl.float32)) + 2) * UNB
        tl.store(out_ptr + p * D + rows, dot * g)

    @triton.jit
    def _loads_kernel(
        ids_ptr, rec_ptr, off_ptr, out_ptr, BN: tl.constexpr, BKB: tl.constexpr, D: tl.constexpr,
        INTER: tl.constexpr, W13: tl.constexpr, S13: tl.constexpr, W2: tl.constexpr, S2: tl.constexpr,
        G: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, HW_E4M3: tl.constexpr, USE_ASM: tl.constexpr,
    ):  # fmt: skip
        """The bytes a gate+up program reads (next chunk loaded first), summed into one int32 per program."""
        p, b, wbase, rows = _gu_rows(ids_ptr, off_ptr, rec_ptr, BN, INTER)
        wrow = (wbase + W13 + rows * (D // 2)).to(tl.pointer_type(tl.int32))
        srow = wbase + S13 + rows * (D // GROUP)
        w, s = _chunk(wrow, srow, 0, D // 2, BKB, GROUP // 2, 4)
        acc, sacc = tl.zeros(w.shape, tl.int32), tl.zeros(s.shape, tl.int32)
        for kb in range(0, D // 2, BKB):
            nw, ns = _chunk(wrow, srow, kb + BKB, D // 2, BKB, GROUP // 2, 4)
            acc += w
            sacc += s.to(tl.int32)
            w, s = nw, ns
        tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0) + tl.sum(tl.sum(sacc, 1), 0))


@dataclass(frozen=True)
class Var:
    """A variant: rows per program (gate+up: half gate, half up), bytes per row per chunk, warps, math, x."""

    rows: int
    nbytes: int
    warps: int = 4
    math: str = "f32"
    x: str = "x2"

    f16 = property(lambda self: self.math != "f32")
    asm = property(lambda self: self.math.startswith(("hfma2", "words")) and not interpreted())
    pre = property(lambda self: self.math.endswith("pre"))
    words = property(lambda self: self.math.startswith("words"))

    def name(self, kind: str = "gate_up") -> str:
        m = self.math + ("(triton)" if self.math.startswith(("hfma2", "words")) and not self.asm else "")
        return f"r{self.rows}x{self.nbytes}B w{self.warps}" + {"loads": "", "down": f" {m}"}.get(kind, f" {m} {self.x}")


def perm8(t: torch.Tensor) -> torch.Tensor:  # each 8 elements in the order 0 4 1 5 2 6 3 7 (the words' x)
    return t.unflatten(-1, (-1, 2, 4)).transpose(-1, -2).flatten(-3)


def halves(t: torch.Tensor) -> torch.Tensor:  # even elements, then odd ones
    return torch.cat([t[..., 0::2], t[..., 1::2]], -1)


class Case:
    """A pool at T tokens: the routings of one graph, x, and float64 references for routes[0]: act_ref [P, I]
    (each pair's weighted silu(gate) * up), out_ref [P, D] (its down output), y_ref [T, D]."""

    def __init__(self, fmt: str, layout, records: torch.Tensor, offsets: torch.Tensor, k: int, t: int, calls: int):
        self.fmt, self.layout, self.records, self.offsets, self.k, self.t = fmt, layout, records, offsets, k, t
        self.routes = bk.routings(t, torch.Generator().manual_seed(t), calls, k)
        self.x = torch.randn(t, layout.dim, generator=torch.Generator().manual_seed(t)).to(bk.DEV, torch.bfloat16)
        self.distinct = sum(r[2] for r in self.routes) / len(self.routes)
        ids, w, _ = self.routes[0]
        acts, outs, offs = [], [], offsets.tolist()
        for p, e in enumerate(ids.flatten().tolist()):
            w1, w3, w2 = layout.dequantize(record_at(records, offs[e], layout.nbytes), torch.float64)
            xt = self.x[p // k].double()
            acts.append(torch.nn.functional.silu(w1 @ xt) * (w3 @ xt) * float(w.flatten()[p]))
            outs.append(w2 @ acts[-1])
        self.act_ref, self.out_ref = torch.stack(acts), torch.stack(outs)
        self.y_ref = self.out_ref.view(t, k, -1).sum(1)
        self.gu_bytes, self.dn_bytes = (sum(layout.part(n).nbytes for n in (w, w + "_scale")) for w in ("w13", "w2"))

    def consts(self, v: Var) -> dict:
        """The record's and the device's compile-time constants, and v's warps."""
        p = {part.name: part.offset for part in self.layout.parts}
        return dict(D=self.layout.dim, INTER=self.layout.inter_dim, W13=p["w13"], S13=p["w13_scale"], W2=p["w2"],
                    S2=p["w2_scale"], G=p.get("scale_2", -1), GROUP=get_format(self.fmt).block[1],
                    E8M0=self.fmt == "mxfp4", HW_E4M3=hw_e4m3(bk.DEV), USE_ASM=not interpreted(),
                    num_warps=v.warps)  # fmt: skip


def prep(x: torch.Tensor, v: Var) -> tuple[torch.Tensor, torch.Tensor]:
    """x as v reads it (fp16 for the fp16 maths, else bf16; pre-scaled per token by 2^s, max |x| in [2^14,
    2^15), for *pre; split in halves, or permuted and viewed as i64 quads), and each token's factor 2^-s."""
    inv = torch.ones(x.shape[0], device=x.device)
    if v.pre:
        s = torch.floor(torch.log2(32768.0 / x.float().abs().amax(1).clamp_min(1e-30)))
        x, inv = x.float() * torch.exp2(s)[:, None], torch.exp2(-s)
    x = x.to(torch.float16 if v.f16 else torch.bfloat16)
    if v.words:
        return perm8(x).contiguous().view(torch.int64), inv
    return (halves(x) if v.x == "split" else x).contiguous(), inv


def launch_gu(c: Case, v: Var, xin, inv, ids, w, act, perm: bool = False) -> None:
    _gu_kernel[(ids.numel() * (c.layout.inter_dim * 2 // v.rows),)](
        xin, ids, w, inv, c.records, c.offsets, act, xin.stride(0), K=ids.shape[1], BN=v.rows // 2, BKB=v.nbytes,
        XS=XS[v.x], XO=c.layout.dim // 2 if v.x == "split" else 1, F16=v.f16, ASM=v.asm, PRE=v.pre,
        UNB=16384.0 if (not v.f16 or v.pre) else 1.0, PERM=perm, **c.consts(v),
    )  # fmt: skip


def launch_dn(c: Case, v: Var, act, ids, out) -> None:
    _dn_kernel[(ids.numel() * (c.layout.dim // v.rows),)](
        ids, c.records, c.offsets, act, out, BN=v.rows, BKB=v.nbytes, XS=4 if v.words else 1, F16=v.f16,
        ASM=v.asm, UNB=1.0 if v.f16 else 16384.0, **c.consts(v),
    )  # fmt: skip


def launch_loads(c: Case, v: Var, ids, out) -> None:
    grid = (ids.numel() * (c.layout.inter_dim * 2 // v.rows),)
    _loads_kernel[grid](ids, c.records, c.offsets, out, BN=v.rows // 2, BKB=v.nbytes, **c.consts(v))


def loads_expected(c: Case, v: Var, ids) -> torch.Tensor:
    """What _loads_kernel stores: per program, its code words and scale bytes summed (int32, wrapping)."""
    wp, sp, blocks, sums = c.layout.part("w13"), c.layout.part("w13_scale"), 2 * c.layout.inter_dim // v.rows, []
    for e in ids.flatten().tolist():
        rec = record_at(c.records, int(c.offsets[e]), c.layout.nbytes)
        words, scales = rec[wp.offset : wp.offset + wp.nbytes].view(torch.int32), rec[sp.offset : sp.offset + sp.nbytes]
        sums.append(sum(t.long().view(2, blocks, -1).sum((0, 2)) for t in (words, scales)))
    return ((torch.cat(sums) + 2**31) % 2**32 - 2**31).to(torch.int32)


class Probe:
    """Runs each call once (checked against the reference), times the case's calls in a graph, keeps rows."""

    def __init__(self, hbm: float):
        self.hbm, self.rows, self.failed = hbm, [], []

    def add(self, c: Case, kind: str, variant: str, call, got, want, read: int, **info) -> None:
        """want: the float64 reference (error: |got - want| / |want|), or int32 sums to match exactly (0 or 1)."""
        err = float(not torch.equal(got.cpu(), want.cpu())) if want.dtype == torch.int32 else float("nan")
        if want.dtype != torch.int32 and got.isfinite().all():
            err = ((got.double() - want).norm() / want.norm()).item()
        row = dict(case=kind, fmt=c.fmt, variant=variant, T=c.t, rel_err=err, **info)
        if not err <= TOL:
            self.failed.append(f"{kind} {c.fmt} {variant} T={c.t}: rel err {err:.2e}")
        if self.hbm:
            s = bk.graph_time([partial(call, r) for r in c.routes])
            gbps = c.distinct * read / s / 1e9
            row.update(us=s * 1e6, GBps=gbps, of_ceiling=gbps / self.hbm)
        self.rows.append(row)
        print(fmt_row(row), flush=True)


def fmt_row(r: dict) -> str:
    rate = f"{r['us']:>8.1f} us {r['GBps']:>6.0f} GB/s {100 * r['of_ceiling']:>5.1f}%" if "us" in r else "-"
    return f"{r['case']:<8} {r['fmt']:<6} {r['variant']:<34} T={r['T']:<2} {rate}  err {r['rel_err']:.1e}"


def baseline(pr: Probe, c: Case) -> None:
    """DecodeMoE, and its two launches alone with the arguments its __call__ gives them."""
    kern, P = DecodeMoE(c.layout, c.k, bk.DEV), c.t * c.k
    cfg, run = kern.config, dict(P_PAD=next_pow2(P), RUN_PAD=next_pow2(c.t))
    bn1, bk1 = cfg.gate_up(c.t)
    gu_grid, dn_grid = (P * (c.layout.inter_dim // bn1),), (P * (c.layout.dim // cfg.bn2),)
    y = kern(c.x, c.routes[0][0], c.routes[0][1], c.records, c.offsets)
    act, out = kern.act[:P].clone(), kern.out[:P].clone()
    whole = lambda r: kern(c.x, r[0], r[1], c.records, c.offsets)  # noqa: E731
    gu = lambda r: _gate_up_kernel[gu_grid](  # noqa: E731  (fp32 products, activations in halves)
        c.x, kern.quads, kern.inv, r[0], r[1], c.records, c.offsets, kern.act, c.t, c.x.stride(0), **run,
        **kern.phase1, BN=bn1, BK=bk1, WORDS=False, HALVES=True)  # fmt: skip
    dn = lambda r: _down_kernel[dn_grid](  # noqa: E731
        r[0], c.records, c.offsets, kern.act, kern.act_inv, kern.out, c.t, **run, **kern.phase2,
        WORDS=False)  # fmt: skip
    pr.add(c, "base", "DecodeMoE (bf16 out)", whole, y, c.y_ref, bk.read_bytes(c.layout))
    gu_name = f"gate_up r{2 * bn1}x{bk1 // 2}B"
    pr.add(c, "base", gu_name + " fp32", gu, act, halves(c.act_ref), c.gu_bytes)
    pr.add(c, "base", f"down r{cfg.bn2}x{cfg.bk2 // 2}B fp32", dn, out, c.out_ref, c.dn_bytes)


def run_loads(pr: Probe, c: Case, v: Var) -> None:
    ids0 = c.routes[0][0]
    out = torch.empty(ids0.numel() * 2 * c.layout.inter_dim // v.rows, dtype=torch.int32, device=bk.DEV)
    launch_loads(c, v, ids0, out)
    pr.add(c, "loads", v.name("loads"), lambda r: launch_loads(c, v, r[0], out), out, loads_expected(c, v, ids0),
           c.gu_bytes, rows=v.rows, nbytes=v.nbytes, warps=v.warps)  # fmt: skip


def run_gu(pr: Probe, c: Case, v: Var) -> None:
    xin, inv = prep(c.x, v)
    act = torch.full((c.t * c.k, c.layout.inter_dim), float("nan"), device=bk.DEV)
    launch_gu(c, v, xin, inv, c.routes[0][0], c.routes[0][1], act)
    call = lambda r: launch_gu(c, v, xin, inv, r[0], r[1], act)  # noqa: E731
    pr.add(c, "gate_up", v.name(), call, act, halves(c.act_ref), c.gu_bytes, **v.__dict__)


def run_dn(pr: Probe, c: Case, v: Var) -> None:
    """Down alone, on the reference activations as v reads them (fp32 or fp16 halves, or fp16 quads)."""
    act = halves(c.act_ref).to(torch.float16 if v.f16 else torch.float32)
    act = perm8(c.act_ref).half().view(torch.int64) if v.words else act
    out = torch.full((c.t * c.k, c.layout.dim), float("nan"), device=bk.DEV)
    launch_dn(c, v, act, c.routes[0][0], out)
    call = lambda r: launch_dn(c, v, act, r[0], out)  # noqa: E731
    pr.add(c, "down", v.name("down"), call, out, c.out_ref, c.dn_bytes, **v.__dict__)


def run_full(pr: Probe, c: Case, gv: Var, dv: Var) -> None:
    act = torch.empty(c.t * c.k, c.layout.inter_dim, device=bk.DEV, dtype=torch.float16 if dv.f16 else None)
    out = torch.empty(c.t * c.k, c.layout.dim, device=bk.DEV)

    def call(r):
        xin, inv = prep(c.x, gv)
        launch_gu(c, gv, xin, inv, r[0], r[1], act, dv.words)
        launch_dn(c, dv, act.view(torch.int64) if dv.words else act, r[0], out)
        return out.view(c.t, c.k, -1).sum(1).to(c.x.dtype)

    pr.add(c, "full", f"{gv.name()} + {dv.name('down')}", call, call(c.routes[0]), c.y_ref, bk.read_bytes(c.layout))


def pick(table: list[dict], default: Var, **match) -> Var:
    """The fastest variant at T = 1 among the rows matching `match` (default when nothing was timed)."""
    rows = [r for r in table if r["T"] == 1 and "us" in r and all(r.get(k) == v for k, v in match.items())]
    r = min(rows, key=lambda r: r["us"], default=None)
    return Var(r["rows"], r["nbytes"], r["warps"], r.get("math", "f32"), r.get("x", "x2")) if r else default


def explore(pr: Probe, cases: list[Case], tilings: list, quick: bool, tiny: bool) -> tuple[Var, Var]:
    """NVFP4: loads probes, gate+up and down variants; returns the fastest gate+up and down (T = 1)."""
    tiles = [tilings[0], tilings[2]] if quick else tilings
    for t, w, c in ((t, w, c) for t in tiles for w in ((4,) if quick or tiny else (4, 8)) for c in cases):
        run_loads(pr, c, Var(*t, w))
    # H1: beside today's tiling, the tilings whose loads ran fastest at T = 1, each with its faster warps
    loads = {t: pick(pr.rows, Var(*t), case="loads", rows=t[0], nbytes=t[1]) for t in tiles}
    us = {t: min([r["us"] for r in pr.rows if r["case"] == "loads" and r["T"] == 1 and "us" in r
                  and (r["rows"], r["nbytes"]) == t], default=0.0) for t in tiles}  # fmt: skip
    chosen = [tiles[0]] + (tiles[2:4] if tiny and not quick else sorted(tiles[1:], key=us.get)[:2])
    for t, (m, x), c in ((t, mx, c) for t in chosen[: 2 if quick else 3] for mx in GU_MATHS for c in cases):
        if not quick or (m, x) in (("f32", "x2"), ("hfma2", "split"), ("words", "perm")):
            run_gu(pr, c, Var(*t, loads[t].warps, m, x))
    dn_tiles = [(DOWN_NOW[0], tilings[0][1], 4)] + [(*t, loads[t].warps) for t in chosen[1:]]
    for (r, b, w), m, c in ((d, m, c) for d in dn_tiles for m in ("f32", "hfma2", "words") for c in cases):
        run_dn(pr, c, Var(r, b, w, m))
    best_gu = pick(pr.rows, Var(*tilings[2], 4, "words", "perm"), case="gate_up")
    return best_gu, pick(pr.rows, Var(16, tilings[2][1], 4, "words"), case="down")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few variants only")
    ap.add_argument("--tiny", action="store_true", help="CPU check under TRITON_INTERPRET=1: a small layout, no timing")
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    a = ap.parse_args()
    k, calls, scale, ts = (4, 2, 8, (1, 2)) if a.tiny else (bk.TOP_K, bk.CALLS, 1, (1, 4))
    if a.tiny:
        assert interpreted(), "--tiny runs on the CPU interpreter: set TRITON_INTERPRET=1"
        bk.DEV, bk.INTER, bk.EXPERTS = torch.device("cpu"), 64, 16  # bench_kernels' pool at a tiny shape
    lim = {} if a.tiny else gpu_ceilings()
    pr, tilings = Probe(lim.get("hbm_read_gbps", 0.0)), [(r, b // scale) for r, b in TILINGS]
    for fmt in ("nvfp4",) if a.quick else ("nvfp4", "mxfp4"):
        layout, records = bk.expert_pool(fmt, torch.Generator(bk.DEV).manual_seed(0), *((448,) if a.tiny else ()))
        offsets = record_offsets(torch.randperm(bk.EXPERTS, device=bk.DEV), records)
        cases = [Case(fmt, layout, records, offsets, k, t, calls) for t in ts]
        for c in cases:
            baseline(pr, c)
        if fmt == "nvfp4":
            best_gu, best_dn = explore(pr, cases, tilings, a.quick, a.tiny)
        for c in cases:
            if fmt != "nvfp4":  # MXFP4: the fastest NVFP4 variants (under --tiny, every math too)
                for v in [best_gu] + ([Var(*tilings[3], 4, m, x) for m, x in GU_MATHS] if a.tiny else []):
                    run_gu(pr, c, v)
                for v in [best_dn] + ([Var(16, tilings[2][1], 4, m) for m in ("f32", "hfma2")] if a.tiny else []):
                    run_dn(pr, c, v)
            run_full(pr, c, best_gu, best_dn)
        del records, cases
    print(f"\nceilings: {json.dumps(lim)}")
    for r in pr.rows:
        print(fmt_row(r))
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else a.out
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "probe_decode.json").write_text(json.dumps({"ceilings": lim, "rows": pr.rows}, indent=1))
    print(f"wrote {out_dir / 'probe_decode.json'}" + "".join(f"\nFAIL {f}" for f in pr.failed))
    return 1 if pr.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
