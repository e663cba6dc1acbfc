"""The decode MoE kernels: a few tokens' routed experts straight from FP4 records, in a few small launches.

  0. (bf16 and fp16 x, words) x scaled per token by a power of two, in fp16, permuted to meet whole code words;
     from 2 tokens on, a program per pair writes the plan: each expert's run (the pairs that chose it) for 1 and 2.
  1. gate+up: a program per (pair, BN1 rows of the expert width). Only the first pair to choose an expert
     works: it reads the expert's rows once for every token that chose it (its run) and writes
     silu(gate) * up * routing weight to an fp32 row per pair, even elements first, so launch 2 loads
     each half contiguously (in order when down takes the words: step 1b prepares them).
  1b. (down on the words) each pair's activation row scaled, fp16 and permuted the way step 0 does x.
  2. down: a program per (pair, BN2 rows of the model dim), the same way: W2 rows times each run pair's
     activation, an fp32 output row per pair.
  3. combine: the sum over a token's K pairs in fp32, in slot order (no atomics, the same bits on every run),
     rounded to x's dtype, plus an optional addend (the shared experts' output) rounded again: a program per
     (token, BN3 columns), so that one token's row still spreads over the SMs.
Either product multiplies in fp32, or in fp16 products on the code words as loaded (fp4/codes.words_sums:
about half the instructions per byte; relative error ~6e-4) when DecodeConfig asks for it, except for fp32
x, the exact runs. A pair's run of one (every run at one token) takes a straight loop over its chunks.
Experts are found on the device through `offsets` (kernels/moe/ref.py), so routing needs no host sync and
the launches can be captured in a CUDA graph. Records in pinned host memory are read over PCIe (zero-copy).
A single persistent launch with a grid-wide barrier between the phases was measured slower on the H100
(docs/BENCHMARKS.md): its fixed programs balance worse than the hardware's scheduling of many small ones. The
programs are decode_jit.py's; this file launches them.
Legend: T tokens, K experts per token, D dim, I expert width, G scale block, P = T * K pairs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dsfp4.kernels.backend import WARP, hw_e4m3, interpreted
from dsfp4.kernels.moe import decode_jit as jit
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.layout.formats import get_format, next_pow2
from dsfp4.layout.record import RecordLayout

# code words per words_sums PTX call
WORD_PAIR = 2
# fp32 elements per 16-byte load: combine gives each thread one such load per pair
LOAD_FP32 = 4
# tokens per call: beyond this, tokens grouped by expert on tensor cores (moe_prefill) win
MAX_TOKENS = DECODE_TOKENS


@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes: BN1 rows of the expert width per gate+up program below wide_from tokens (BN1_WIDE from it on),
    BN2 rows of the model dim per down program, BK1 (BK1_WIDE)/BK2 input elements per step (a power of two, at
    least one scale block); warps per gate+up and per down program. gate_up(t) names the gate+up tile of a call.
    words1/words2: gate+up/down in fp16 products on the code words for bf16 and fp16 x (fp32 x keeps fp32
    products). BN3: columns of the model dim per combine program (a warp per 128)."""

    # the best of sweeps on the H100 (docs/BENCHMARKS.md): gate+up 16 rows x 256 B per step; down 8 rows, each
    # read whole in one step (2048 elements: V3's and V4's expert width; fit() shrinks it for narrower ones)
    bn1: int = 8
    bk1: int = 512
    bn2: int = 8
    bk2: int = 2048
    num_warps: int = 4
    num_warps2: int = 4
    # under half fp32's SASS instructions per code byte on a straight loop (docs/BENCHMARKS.md)
    words1: bool = True
    words2: bool = True
    # combine at one token: V3's 7168 columns in 56 programs of one warp, one 16-byte load per thread and pair
    bn3: int = 128
    # from wide_from tokens on, gate+up reads 32 rows x 512 B per step (each tile serves more tokens): nearer the
    # H100's ceiling from 2 tokens on; 1 token keeps the narrow one (docs/BENCHMARKS.md, 2026-11-23)
    wide_from: int = 2
    bn1_wide: int = 16
    bk1_wide: int = 1024

    def fit(self, layout: RecordLayout) -> DecodeConfig:
        """Shrink the tiles to a small model's shape (every size a power of two dividing it)."""

        def div(b: int, n: int) -> int:
            while n % b:
                b //= 2
            return b

        d, i = layout.dim, layout.inter_dim
        return dataclasses.replace(
            self,
            bn1=div(self.bn1, i),
            bk1=div(self.bk1, d),
            bn2=div(self.bn2, d),
            bk2=div(self.bk2, i),
            bn3=div(self.bn3, d),
            bn1_wide=div(self.bn1_wide, i),
            bk1_wide=div(self.bk1_wide, d),
        )

    def gate_up(self, t: int) -> tuple[int, int]:
        """Gate+up's (rows, elements per step) for a call of t tokens."""
        return (self.bn1_wide, self.bk1_wide) if t >= self.wide_from else (self.bn1, self.bk1)


def combine_ref(out: torch.Tensor, t: int, k: int, dtype: torch.dtype, add: torch.Tensor | None = None) -> torch.Tensor:
    """jit.combine_kernel's result: out [>= T * K, D] fp32 pair rows, each token's K summed in slot order, in
    dtype, plus add [T, D] (in dtype, added in fp32 and rounded: torch's own bf16 and fp16 addition)."""
    rows = out[: t * k].view(t, k, -1)  # [T, K, D]
    acc = rows[:, 0]
    # one add at a time: the kernel's order, not torch.sum's
    for j in range(1, k):
        acc = acc + rows[:, j]
    y = acc.to(dtype)  # [T, D]
    return y if add is None else y + add


def workspace_bytes(layout: RecordLayout, top_k: int) -> int:
    """Device memory a DecodeMoE holds: per pair an fp32 activation row, its fp16 copy and 2^-s for the down
    words, an fp32 output row and its run (i32); per token x in fp16 and its 2^-s."""
    pairs = MAX_TOKENS * top_k
    per_pair = layout.inter_dim * (4 + 2) + 4 + layout.dim * 4 + (1 + MAX_TOKENS) * 4
    return pairs * per_pair + MAX_TOKENS * (layout.dim * 2 + 4)


class DecodeMoE:
    """The decode kernels for one record layout on one device, with their workspaces (workspace_bytes) kept
    across calls, so that a captured graph replays on the same memory."""

    def __init__(
        self,
        layout: RecordLayout,
        top_k: int,
        device: torch.device,
        config: DecodeConfig | None = None,
        limit: float = 0.0,
    ):
        """limit: the SwiGLU clamp (kernels/swiglu.py), 0.0 for none."""
        group = get_format(layout.format).block[1]
        self.layout, self.top_k = layout, top_k
        self.config = c = (config or DecodeConfig()).fit(layout)
        assert min(c.bk1, c.bk1_wide, c.bk2) >= group, f"K steps must hold whole {group}-element scale blocks"
        pairs, d, i = MAX_TOKENS * top_k, layout.dim, layout.inter_dim
        # x as quads that meet whole code words (bf16 and fp16 runs)
        self.words = d % 8 == 0 and i % 8 == 0

        # words_sums' PTX takes two adjacent words per thread (pack=2): a chunk must give every thread two, else
        # the GPU pairs words of different threads (a small model's tiles): fp32 products there
        # rows x k codes a chunk, 8 to a word
        def fits(rows: int, k: int, warps: int) -> bool:
            return self.words and rows * k // 8 >= WORD_PAIR * WARP * warps

        # gate+up's narrow and wide tiles (gate and up: 2 x BN1 rows)
        tiles = (c.gate_up(1), c.gate_up(MAX_TOKENS))
        self.words1 = {tile: c.words1 and fits(2 * tile[0], tile[1], c.num_warps) for tile in tiles}
        self.words2 = c.words2 and fits(c.bn2, c.bk2, c.num_warps2)
        self.xq = torch.empty(MAX_TOKENS, d, dtype=torch.float16, device=device)
        self.inv = torch.empty(MAX_TOKENS, dtype=torch.float32, device=device)
        self.quads = self.xq.view(torch.int64)  # [MAX_TOKENS, D / 4]: what gate+up reads of xq
        self.act = torch.empty(pairs, i, dtype=torch.float32, device=device)
        # act as the down words read it
        self.act_q = torch.empty(pairs, i, dtype=torch.float16, device=device)
        self.act_inv = torch.empty(pairs, dtype=torch.float32, device=device)
        self.act_quads = self.act_q.view(torch.int64)
        self.out = torch.empty(pairs, d, dtype=torch.float32, device=device)
        # _plan's runs
        self.plan = torch.empty(pairs, 1 + MAX_TOKENS, dtype=torch.int32, device=device)
        p = {part.name: part.offset for part in layout.parts}
        common = dict(
            K=top_k,
            D=d,
            INTER=i,
            G=p.get("scale_2", -1),
            GROUP=group,
            E8M0=layout.format == "mxfp4",
            USE_ASM=not interpreted(),
            HW_E4M3=hw_e4m3(device),
        )
        self.phase1 = dict(common, W13=p["w13"], S13=p["w13_scale"], LIMIT=float(limit), num_warps=c.num_warps)
        self.phase2 = dict(common, W2=p["w2"], S2=p["w2_scale"], BN=c.bn2, BK=c.bk2, num_warps=c.num_warps2)

    def __call__(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        records: torch.Tensor,
        offsets: torch.Tensor,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [T, D], ids: [T, K], weights: [T, K], records: [S, nbytes] u8, offsets: [E] i64, add: None or
        [T, D] in x's dtype -> y [T, D] in x's dtype (the routed sum rounded, then plus add rounded)."""
        t, k = x.shape[0], self.top_k
        assert 0 < t <= MAX_TOKENS and ids.shape == (t, k), f"decode takes 1..{MAX_TOKENS} tokens of top-{k} ids"
        assert x.shape[1] == self.layout.dim and x.stride(1) == 1 and records.shape[1] == self.layout.nbytes
        assert records.data_ptr() % 16 == 0, "records: a 16-byte aligned u8 slot pool"
        ids, weights, offsets = ids.contiguous(), weights.float().contiguous(), offsets.contiguous()
        run = dict(RUN_PAD=next_pow2(t))
        c, d, i = self.config, self.layout.dim, self.layout.inter_dim
        # fp32 runs (the exact ones) keep fp32 products
        exact = x.dtype == torch.float32
        bn1, bk1 = c.gate_up(t)
        words1, words2 = self.words1[bn1, bk1] and not exact, self.words2 and not exact
        # one token needs no plan: every pair leads its own run
        rows, plan = t if words1 else 0, t > 1
        if rows or plan:
            jit.prep_kernel[(rows + plan * t * k,)](
                x,
                x.stride(0),
                self.xq,
                self.inv,
                rows,
                ids,
                self.plan,
                t * k,
                D=d,
                BD=next_pow2(d),
                P_PAD=next_pow2(t * k),
                **run,
            )
        jit.gate_up_kernel[(t * k * (i // bn1),)](
            x,
            self.quads,
            self.inv,
            ids,
            self.plan,
            weights,
            records,
            offsets,
            self.act,
            x.stride(0),
            **run,
            **self.phase1,
            BN=bn1,
            BK=bk1,
            WORDS=words1,
            HALVES=not words2,
        )
        # absent experts' pairs prepare whatever their rows hold: down never reads them
        if words2:
            jit.act_prep_kernel[(t * k,)](self.act, self.act_q, self.act_inv, INTER=i, BI=next_pow2(i))
        jit.down_kernel[(t * k * (d // c.bn2),)](
            ids,
            self.plan,
            records,
            offsets,
            self.act_quads if words2 else self.act,
            self.act_inv,
            self.out,
            **run,
            **self.phase2,
            WORDS=words2,
        )
        return self.combine(t, x.dtype, add)

    def combine(self, t: int, dtype: torch.dtype, add: torch.Tensor | None = None) -> torch.Tensor:
        """Launch 3 on the first t tokens' pair rows in `out` -> y [T, D] in dtype (combine_ref). y is allocated
        here, as torch ops do: a graph capture keeps its memory."""
        d = self.layout.dim
        if add is not None:
            assert add.shape == (t, d) and add.dtype == dtype and add.stride(1) == 1, "add: [T, D] in x's dtype"
        y = torch.empty(t, d, dtype=dtype, device=self.out.device)  # [T, D]
        bd = self.config.bn3
        jit.combine_kernel[(t, d // bd)](
            self.out,
            y if add is None else add,
            y,
            0 if add is None else add.stride(0),
            K=self.top_k,
            D=d,
            BD=bd,
            ADD=add is not None,
            EMULATE_RNE=interpreted() and dtype == torch.bfloat16,
            num_warps=max(1, bd // (LOAD_FP32 * WARP)),
        )
        return y
