"""The prefill MoE kernel: (token, slot) pairs grouped by expert on the device, then two grouped FP4 GEMMs
on tensor cores, straight from the expert records (the formula and the record convention: moe_ref.py).

  1. `align_by_expert` (torch, fixed-size outputs, no host sync): pairs sorted by expert, each expert's run
     padded to whole blocks of BLOCK_M rows, and the expert of every block (vLLM's moe_align_block_size).
  2. gate+up: a program per (block, BN columns of the expert width). FP4 tiles are decoded in registers with
     the block scale folded in (exact in bf16), gate and up rows run through `tl.dot` in the same program,
     and silu(gate) * up * routing weight is stored per block row, even columns first, so that step 3 loads
     contiguous runs.
  3. down: a program per (block, BN columns of the model dim) writes one output row per pair; the K rows of
     a token are then summed in slot order (deterministic, no atomics).
Activations are split once per call into even and odd columns: byte j of a packed row multiplies x[2j]
(low nibble) and x[2j+1] (high nibble), so each K step runs two dots on contiguous loads and no weight is
re-packed. `moe_ref` (moe_ref.py) is the torch reference. Legend: T tokens, K experts per token, E routed
experts, D dim, I expert width, G scale block, P = T * K pairs, L padded rows, B blocks of BLOCK_M rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from dsfp4.errors import FormatError
from dsfp4.kernels.fp4_decode import E2M1_UNBIAS, interpreted, triton
from dsfp4.kernels.moe_ref import ABSENT, record_at
from dsfp4.kernels.swiglu import swiglu
from dsfp4.layout.formats import next_pow2
from dsfp4.layout.fp4 import MXFP4_BLOCK, NVFP4_BLOCK
from dsfp4.layout.record import RecordLayout

BLOCK_M_RANGE = (16, 128)  # tl.dot needs 16 rows; two [128, BN] fp32 accumulators fill the registers
BLOCK_M_HEADROOM = 1.25  # a block holds 1.25x the mean rows per expert, so most experts fit in one
BN_UP_CHOICES = (64, 32, 16)  # columns of gate and of up per program (two accumulators)
BN_DOWN_CHOICES = (64, 32, 16)
BK_CHOICES = (128, 64, 32)  # input elements per step; a dot's K is half of it (one nibble each)
# Two pipeline stages keep a block_m=128 program at ~90 KB of shared memory and <= 128 registers a thread
# (Triton's sm_90 build), so two fit on an SM and one's FP4 decode can overlap the other's MMAs. Untuned.
NUM_STAGES = 2


def max_blocks(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Blocks in the worst case: at most min(E, P) experts have pairs, and each pads by < block_m rows."""
    return (n_pairs + min(n_experts, n_pairs) * (block_m - 1)) // block_m


def align_by_expert(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids: [T, K] int in [0, E) -> (sorted_pairs [B * block_m] i32, block_experts [B] i32, n_padded [1] i32).

    sorted_pairs lists the pairs p = t * K + j by expert (stable: token order within an expert), each
    expert's run padded to a multiple of block_m with the sentinel P; block_experts holds each block's
    expert, -1 past the n_padded used rows. B = max_blocks(P, E, block_m) depends on shapes only, so
    nothing waits for the device and the call can be captured in a CUDA graph."""
    flat = ids.reshape(-1).long()  # [P]
    n_pairs, dev = flat.numel(), flat.device
    n_blocks = max_blocks(n_pairs, n_experts, block_m)
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = padded.cumsum(0)  # [E] end of each expert's padded run
    order = torch.sort(flat, stable=True).indices  # [P] pairs by expert
    expert = flat[order]
    rank = torch.arange(n_pairs, device=dev) - (counts.cumsum(0) - counts)[expert]  # position in its run
    sorted_pairs = torch.full((n_blocks * block_m,), n_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, ends[expert] - padded[expert] + rank, order.int())
    starts = torch.arange(n_blocks, device=dev) * block_m  # [B] first row of each block
    block_experts = torch.searchsorted(ends, starts, right=True)  # the expert whose run covers the row
    block_experts = torch.where(starts < ends[-1], block_experts, -1).int()
    return sorted_pairs, block_experts, ends[-1:].int()


@dataclass(frozen=True)
class PrefillBlocks:
    """Tile sizes: block_m pair rows per block (one expert each); bn_up columns of gate and of up per
    program, bk_up model-dim elements per step; bn_down, bk_down the same for down over the expert width."""

    block_m: int
    bn_up: int
    bk_up: int
    bn_down: int
    bk_down: int

    @property
    def num_warps(self) -> int:
        return 8 if self.block_m >= 128 else 4


@functools.lru_cache  # asked per MoE layer and chunk, with the same few arguments
def prefill_blocks(n_pairs: int, n_experts: int, layout: RecordLayout) -> PrefillBlocks:
    """block_m: the smallest power of two holding BLOCK_M_HEADROOM x the mean rows per expert, within
    BLOCK_M_RANGE (DeepSeek-V3, 256 experts, top-8: 32 at 512 tokens, 128 from 2048 on). BN, BK: the largest
    choices that divide the matrix."""
    lo, hi = BLOCK_M_RANGE
    want = math.ceil(BLOCK_M_HEADROOM * n_pairs / n_experts)
    block_m = min(hi, max(lo, next_pow2(want)))

    def fit(choices: tuple[int, ...], n: int) -> int:
        if n % choices[-1]:
            raise FormatError(f"moe_prefill needs expert dims that are multiples of {choices[-1]}, got {n}")
        return next(b for b in choices if n % b == 0)

    d, i = layout.dim, layout.inter_dim
    return PrefillBlocks(
        block_m, fit(BN_UP_CHOICES, i), fit(BK_CHOICES, d), fit(BN_DOWN_CHOICES, d), fit(BK_CHOICES, i)
    )


if triton is not None:
    import triton.language as tl

    from dsfp4.kernels.fp4_decode import block_scale, e2m1_halves, rounded
    from dsfp4.kernels.swiglu import swiglu_tl

    _ABSENT = tl.constexpr(ABSENT)
    _UNBIAS = tl.constexpr(E2M1_UNBIAS)

    @triton.jit
    def _split_tile(ptr, rows, mask, kb, K: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr):
        """Columns 2kb..2kb+BK of `rows` of a [R, K] matrix stored even columns first -> (even, odd) [BM, BK/2]
        in DOT."""
        cols = kb + tl.arange(0, BK // 2)
        p = ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
        even = tl.load(p, mask=mask[:, None], other=0.0)
        return even.to(DOT), tl.load(p + K // 2, mask=mask[:, None], other=0.0).to(DOT)

    @triton.jit
    def _fp4_tile(
        w_ptr, s_ptr, rows, kb,
        K: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, USE_ASM: tl.constexpr,
        DOT: tl.constexpr,
    ):  # fmt: skip
        """Columns 2kb..2kb+BK of `rows` of an FP4 matrix [N, K] (codes [N, K/2], scale bytes [N, K/G]) ->
        (even, odd) [BN, BK/2] in DOT: e2m1 * block scale * 2^-14, exact in bf16 (<= 6 significant bits)."""
        BN: tl.constexpr = rows.shape[0]
        packed = tl.load(w_ptr + rows[:, None] * (K // 2) + (kb + tl.arange(0, BK // 2))[None, :])
        sb = tl.load(s_ptr + rows[:, None] * (K // GROUP) + (kb // (GROUP // 2) + tl.arange(0, BK // GROUP))[None, :])
        scale = block_scale(sb, E8M0)[:, :, None]  # [BN, BK/G, 1]: byte j lies in group 2j / G
        lo, hi = e2m1_halves(packed, USE_ASM)  # [BN, BK/2] fp32 each
        lo = tl.reshape(tl.reshape(lo, (BN, BK // GROUP, GROUP // 2)) * scale, (BN, BK // 2))
        hi = tl.reshape(tl.reshape(hi, (BN, BK // GROUP, GROUP // 2)) * scale, (BN, BK // 2))
        return lo.to(DOT), hi.to(DOT)

    @triton.jit
    def _gate_up_kernel(
        x_ptr, rw_ptr, pairs_ptr, experts_ptr, rec_ptr, off_ptr, act_ptr, n_pairs,
        TOP_K: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr, W13: tl.constexpr, S13: tl.constexpr,
        G: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        USE_ASM: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, EMULATE_RNE: tl.constexpr,
        LIMIT: tl.constexpr,
    ):  # fmt: skip
        """act[row] = swiglu(x W1^T, x W3^T) * routing weight for one column block (pid 0) of one block of
        rows (pid 1); x [T, D] and act [L, INTER] hold even columns first."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        e = tl.load(experts_ptr + pid_m)
        if e < 0:  # past the used rows
            return
        off = tl.load(off_ptr + e)
        if off == _ABSENT:  # the down kernel writes these pairs' zeros
            return
        wbase = rec_ptr + tl.multiple_of(off, 16)
        rows = pid_m * BM + tl.arange(0, BM)
        pairs = tl.load(pairs_ptr + rows)  # [BM]
        valid = pairs < n_pairs
        tokens = pairs // TOP_K
        # tile column c holds expert column n0 + 2c (first half) or n0 + 2(c - BN/2) + 1: even, then odd
        c = tl.arange(0, BN)
        wrows = pid_n * BN + (c % (BN // 2)) * 2 + c // (BN // 2)
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, D // 2, BK // 2):  # packed bytes: the loop counts in them, so loads stay aligned
            xe, xo = _split_tile(x_ptr, tokens, valid, kb, D, BK, DOT)  # [BM, BK/2] each
            ge, go = _fp4_tile(wbase + W13, wbase + S13, wrows, kb, D, BK, GROUP, E8M0, USE_ASM, DOT)
            acc_g = tl.dot(xe, tl.trans(ge), acc_g, input_precision=PRECISION)
            acc_g = tl.dot(xo, tl.trans(go), acc_g, input_precision=PRECISION)
            ue, uo = _fp4_tile(wbase + W13, wbase + S13, wrows + INTER, kb, D, BK, GROUP, E8M0, USE_ASM, DOT)
            acc_u = tl.dot(xe, tl.trans(ue), acc_u, input_precision=PRECISION)
            acc_u = tl.dot(xo, tl.trans(uo), acc_u, input_precision=PRECISION)
        g_gate, g_up = _UNBIAS, _UNBIAS
        if G >= 0:  # NVFP4 global scales of w1 and w3
            gp = (wbase + G).to(tl.pointer_type(tl.float32))
            g_gate, g_up = tl.load(gp) * _UNBIAS, tl.load(gp + 1) * _UNBIAS
        gate, up = acc_g * g_gate, acc_u * g_up
        rw = tl.load(rw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)  # padding rows come out 0
        h = tl.reshape(swiglu_tl(gate, up, LIMIT) * rw[:, None], (BM, 2, BN // 2))
        # [BM, 2, BN/2]: the even half goes to act[:, n0/2 ...], the odd half to act[:, INTER/2 + n0/2 ...]
        dest = (
            rows.to(tl.int64)[:, None, None] * INTER
            + tl.arange(0, 2)[None, :, None] * (INTER // 2)
            + (pid_n * (BN // 2) + tl.arange(0, BN // 2))[None, None, :]
        )
        tl.store(act_ptr + dest, rounded(h, act_ptr.dtype.element_ty, EMULATE_RNE))

    @triton.jit
    def _down_kernel(
        act_ptr, pairs_ptr, experts_ptr, rec_ptr, off_ptr, out_ptr, n_pairs,
        D: tl.constexpr, INTER: tl.constexpr, W2: tl.constexpr, S2: tl.constexpr, G: tl.constexpr,
        GROUP: tl.constexpr, E8M0: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        USE_ASM: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, EMULATE_RNE: tl.constexpr,
    ):  # fmt: skip
        """out[pair] = act[row] W2^T for one column block (pid 0) of one block of rows (pid 1); zeros for
        the pairs of a left-out expert, so every pair's row is written."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        e = tl.load(experts_ptr + pid_m)
        if e < 0:
            return
        rows = pid_m * BM + tl.arange(0, BM)
        pairs = tl.load(pairs_ptr + rows)
        valid = pairs < n_pairs
        cols = pid_n * BN + tl.arange(0, BN)
        out = out_ptr + pairs.to(tl.int64)[:, None] * D + cols[None, :]
        DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        off = tl.load(off_ptr + e)
        if off == _ABSENT:
            tl.store(out, tl.zeros((BM, BN), dtype=DTYPE), mask=valid[:, None])
            return
        wbase = rec_ptr + tl.multiple_of(off, 16)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, INTER // 2, BK // 2):
            ae, ao = _split_tile(act_ptr, rows, valid, kb, INTER, BK, DOT)
            we, wo = _fp4_tile(wbase + W2, wbase + S2, cols, kb, INTER, BK, GROUP, E8M0, USE_ASM, DOT)
            acc = tl.dot(ae, tl.trans(we), acc, input_precision=PRECISION)
            acc = tl.dot(ao, tl.trans(wo), acc, input_precision=PRECISION)
        scale = _UNBIAS
        if G >= 0:  # NVFP4 global scale of w2
            scale = tl.load((wbase + G).to(tl.pointer_type(tl.float32)) + 2) * _UNBIAS
        tl.store(out, rounded(acc * scale, DTYPE, EMULATE_RNE), mask=valid[:, None])


def _workspace(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch memory the kernels fully overwrite (the tests swap in a NaN-filled allocation)."""
    return torch.empty(shape, dtype=dtype, device=device)


def split_columns(a: torch.Tensor) -> torch.Tensor:
    """a: [R, N] -> [R, N]: even columns, then odd (the order both kernels load and store)."""
    return torch.cat([a[:, 0::2], a[:, 1::2]], dim=1)


def merge_columns(s: torch.Tensor) -> torch.Tensor:
    """split_columns' inverse."""
    return torch.stack(s.chunk(2, dim=1), dim=-1).flatten(1)


def _grid(n_cols: int, block_experts: torch.Tensor) -> tuple[int, int]:
    """Column blocks vary fastest: the programs running at once share a few blocks of rows, whose gathered
    activations then stay in L2 across the column blocks (and a block's expert weights are read once)."""
    assert block_experts.numel() < 2**16, "too many blocks of rows for the grid's second dimension"
    return n_cols, block_experts.numel()


def _constants(layout: RecordLayout, blocks: PrefillBlocks, dtype: torch.dtype) -> dict:
    group = NVFP4_BLOCK if layout.format == "nvfp4" else MXFP4_BLOCK
    assert blocks.bk_up % group == 0 and blocks.bk_down % group == 0, f"K steps must hold whole {group}-blocks"
    return dict(
        G=layout.part("scale_2").offset if layout.format == "nvfp4" else -1, GROUP=group,
        E8M0=layout.format == "mxfp4", BM=blocks.block_m, USE_ASM=not interpreted(),
        # the interpreter's tl.dot multiplies bf16 bit patterns as integers: it gets exact fp32 operands
        DOT=tl.float32 if dtype == torch.float32 or interpreted() else tl.bfloat16,
        EMULATE_RNE=interpreted() and dtype == torch.bfloat16,
        PRECISION="ieee" if dtype == torch.float32 else "tf32", num_warps=blocks.num_warps, num_stages=NUM_STAGES,
    )  # fmt: skip


def gate_up(
    xs: torch.Tensor,
    weights: torch.Tensor,
    pairs: torch.Tensor,
    block_experts: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    layout: RecordLayout,
    blocks: PrefillBlocks,
    limit: float = 0.0,
) -> torch.Tensor:
    """xs: split_columns(x) [T, D], weights: [T, K], pairs and block_experts from align_by_expert ->
    act [L, I] in x's dtype, even columns first. Rows of unused blocks and of left-out experts are not written.
    limit: the SwiGLU clamp (kernels/swiglu.py), 0.0 for none."""
    t, k = weights.shape
    i = layout.inter_dim
    act = _workspace((pairs.numel(), i), xs.dtype, xs.device)
    _gate_up_kernel[_grid(i // blocks.bn_up, block_experts)](
        xs, weights, pairs, block_experts, records, offsets, act, t * k,
        TOP_K=k, D=layout.dim, INTER=i, W13=layout.part("w13").offset, S13=layout.part("w13_scale").offset,
        BN=blocks.bn_up, BK=blocks.bk_up, LIMIT=float(limit), **_constants(layout, blocks, xs.dtype),
    )  # fmt: skip
    return act


def down(
    act: torch.Tensor,
    n_pairs: int,
    pairs: torch.Tensor,
    block_experts: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    layout: RecordLayout,
    blocks: PrefillBlocks,
) -> torch.Tensor:
    """act: [L, I] from gate_up -> out [P, D] in act's dtype, one row per pair (zeros for left-out experts)."""
    d = layout.dim
    out = _workspace((n_pairs, d), act.dtype, act.device)
    _down_kernel[_grid(d // blocks.bn_down, block_experts)](
        act, pairs, block_experts, records, offsets, out, n_pairs,
        D=d, INTER=layout.inter_dim, W2=layout.part("w2").offset, S2=layout.part("w2_scale").offset,
        BN=blocks.bn_down, BK=blocks.bk_down, **_constants(layout, blocks, act.dtype),
    )  # fmt: skip
    return out


def _experts(pairs: torch.Tensor, block_experts: torch.Tensor, offsets: torch.Tensor, n_pairs: int):
    """(expert, its rows of the padded order, their pairs) for every present expert with pairs."""
    row_e = block_experts.long().repeat_interleave(pairs.numel() // block_experts.numel())  # [L]
    for e in row_e.unique().tolist():
        if e >= 0 and offsets[e].item() != ABSENT:
            rows = ((row_e == e) & (pairs < n_pairs)).nonzero()[:, 0]
            yield e, rows, pairs[rows].long()


def _dense(records: torch.Tensor, offset: int, layout: RecordLayout, dtype: torch.dtype):
    return layout.dequantize(record_at(records, offset, layout.nbytes), dtype=dtype)


def gate_up_ref(
    xs: torch.Tensor,
    weights: torch.Tensor,
    pairs: torch.Tensor,
    block_experts: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    layout: RecordLayout,
    limit: float = 0.0,
) -> torch.Tensor:
    """Torch reference of gate_up (device slots only) in xs' dtype; the rows it does not define are zero."""
    x, k = merge_columns(xs), weights.shape[1]
    act = torch.zeros(pairs.numel(), layout.inter_dim, dtype=x.dtype, device=x.device)
    for e, rows, p in _experts(pairs, block_experts, offsets, weights.numel()):
        w1, w3, _ = _dense(records, offsets[e].item(), layout, x.dtype)
        xe = x[p // k]  # [n, D]
        act[rows] = swiglu(xe @ w1.T, xe @ w3.T, limit) * weights.reshape(-1)[p, None].to(x.dtype)
    return split_columns(act)


def down_ref(
    act: torch.Tensor,
    n_pairs: int,
    pairs: torch.Tensor,
    block_experts: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    layout: RecordLayout,
) -> torch.Tensor:
    """Torch reference of down (device slots only) in act's dtype."""
    a = merge_columns(act)
    out = torch.zeros(n_pairs, layout.dim, dtype=a.dtype, device=a.device)
    for e, rows, p in _experts(pairs, block_experts, offsets, n_pairs):
        out[p] = a[rows] @ _dense(records, offsets[e].item(), layout, a.dtype)[2].T
    return out


def moe_prefill(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    layout: RecordLayout,
    blocks: PrefillBlocks | None = None,
    limit: float = 0.0,
) -> torch.Tensor:
    """moe_ref's result from the grouped FP4 GEMMs. x: [T, D] bf16 or fp32, ids: [T, K] int, weights: [T, K]
    float, records: u8 slot pool, offsets: [E] int64 (multiples of 16, or ABSENT) -> y [T, D] in x's dtype.
    `blocks` overrides prefill_blocks' tile sizes; limit: the SwiGLU clamp (kernels/swiglu.py)."""
    t, d = x.shape
    k, n_experts = ids.shape[1], offsets.numel()
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"moe_prefill computes in bf16 or fp32, not {x.dtype} (fp16 cannot hold every e8m0 scale)")
    assert d == layout.dim and ids.shape == weights.shape == (t, k), "x, ids, weights must be [T, D], [T, K], [T, K]"
    assert records.dtype == torch.uint8 and records.data_ptr() % 16 == 0, "records: a 16-byte aligned u8 slot pool"
    assert offsets.dtype == torch.int64, "offsets: int64 byte offsets from records' address"
    blocks = blocks or prefill_blocks(t * k, n_experts, layout)
    pairs, block_experts, _ = align_by_expert(ids, n_experts, blocks.block_m)
    where = (pairs, block_experts, records, offsets.contiguous(), layout, blocks)
    act = gate_up(split_columns(x), weights.contiguous(), *where, limit)
    out = down(act, t * k, *where)
    return out.view(t, k, d).sum(1)  # each token's pairs in slot order: the same bits on every run
