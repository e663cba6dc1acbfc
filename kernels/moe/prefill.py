"""The prefill MoE kernel: (token, slot) pairs grouped by expert on the device, then two grouped FP4 GEMMs
on tensor cores, straight from the expert records (the formula and the record convention: ref.py).

  1. `align_by_expert` (torch, fixed-size outputs, no host sync): pairs sorted by expert, each expert's run
     padded to whole blocks of block_m + tail_m rows, and the expert of every block (vLLM's
     moe_align_block_size). The tail rows are a second, narrower MMA on the same decoded weights, skipped
     while empty, so an expert a few rows over block_m does not decode its weights twice.
  2. gate+up: a program per (block, BN columns of the expert width) computes [2 BN weight rows, block pairs]
     = W x^T: the weights are the MMA's left operand, decoded in registers (wgmma reads that operand from
     registers on Hopper, so decoded weights never pass through shared memory), the gathered activations
     the right one. Gate and up rows alternate by 8, so a thread holds both halves of the rows it owns, and
     silu(gate) * up * routing weight is stored per pair row.
  3. down: a program per (block, BN columns of the model dim) writes one output row per pair; the K rows of
     a token are then summed in slot order (deterministic, no atomics).
FP4 tiles are decoded to bf16 with the block scale in one bf16 product (NVFP4; fp4/codes.E4M3_LIFT), both
nibbles of a byte side by side, so activations keep their natural column order (prefill_jit.py's programs).
`moe_ref` (ref.py) is the torch reference. Legend: T tokens, K experts per token, E routed experts, D dim, I expert
width, G scale block, P = T * K pairs, L padded rows, B blocks of block_m + tail_m rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from dsfp4.errors import FormatError
from dsfp4.kernels.backend import REFERENCE_SMEM, card, hw_e4m3, interpreted, tl
from dsfp4.kernels.fp4.codes import E4M3_LIFT_UNBIAS
from dsfp4.kernels.moe import prefill_jit as jit
from dsfp4.kernels.moe.ref import record_at
from dsfp4.kernels.swiglu import swiglu
from dsfp4.layout.formats import get_format
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.record_offsets import ABSENT

# tl.dot needs 16 rows; a [2 BN, 128] fp32 accumulator per program
BLOCK_M_RANGE = (16, 128)
# a block holds 1.25x the mean rows per expert, so most experts fit in one
BLOCK_M_HEADROOM = 1.25
# a block's tail holds block_m / 4 rows (at least 16): the rows past a power of two
TAIL_SHARE = 4
# one warpgroup: its MMA takes 64 decoded weight rows (2 BN of gate+up, BN of down) from registers
NUM_WARPS = 4
# (bn_up, bk_up, bn_down, bk_down, stages_up, stages_down) by format and block_m, chosen by H100 sweeps
# (docs/BENCHMARKS.md). A program re-reads its block's activations from L2 for every BN columns, which bounds big
# blocks: 64 gate+up columns (two MMAs of 64 rows) and 128 down columns per program from 64 rows on. Smaller
# blocks keep narrow tiles, which give more programs to fill the SMs. Stages as swept per block size: NVFP4 takes 3
# up to 64 main rows (4 was slower at 32 and 64) and 2 for gate+up at 128, where 3 left one program an SM
_NARROW_NV, _WIDE = (32, 128, 64, 128, 3, 3), (64, 64, 128, 64, 3, 3)
_NARROW_MX = (32, 64, 64, 64, 4, 4)
TILES = {
    "nvfp4": {16: _NARROW_NV, 32: _NARROW_NV, 64: _WIDE, 128: (64, 64, 128, 64, 2, 3)},
    "mxfp4": {16: _NARROW_MX, 32: _NARROW_MX, 64: _WIDE, 128: _WIDE},
}
# Triton 3.6 on an H100 summed wrongly (a few NaN or off outputs, varying by run) with K steps of 32 elements and
# 3 or 4 stages (docs/BENCHMARKS.md, runs 38, 39, 45); 2 were right. Steps below 64 elements (dims that 64 does not
# divide) take 2 stages
SAFE_BK = 64
# stages the shared-memory rule keeps at least (fewer pipeline nothing)
MIN_STAGES = 2


def max_blocks(n_pairs: int, n_experts: int, block_rows: int) -> int:
    """Blocks of block_rows rows (PrefillBlocks.rows) in the worst case: at most min(E, P) experts have pairs,
    and each pads by < block_rows rows."""
    return (n_pairs + min(n_experts, n_pairs) * (block_rows - 1)) // block_rows


def align_by_expert(
    ids: torch.Tensor, n_experts: int, block_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids: [T, K] int in [0, E) -> (sorted_pairs [B * block_rows] i32, block_experts [B] i32, n_padded [1] i32).

    sorted_pairs lists the pairs p = t * K + j by expert (stable: token order within an expert), each
    expert's run padded to a multiple of block_rows with the sentinel P; block_experts holds each block's
    expert, -1 past the n_padded used rows. B = max_blocks(P, E, block_rows) depends on shapes only, so
    nothing waits for the device and the call can be captured in a CUDA graph."""
    flat = ids.reshape(-1).long()  # [P]
    n_pairs, dev = flat.numel(), flat.device
    n_blocks = max_blocks(n_pairs, n_experts, block_rows)
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_rows - 1) // block_rows * block_rows  # [E]
    ends = padded.cumsum(0)  # [E] end of each expert's padded run
    order = torch.sort(flat, stable=True).indices  # [P] pairs by expert
    expert = flat[order]
    # position in its run
    rank = torch.arange(n_pairs, device=dev) - (counts.cumsum(0) - counts)[expert]
    sorted_pairs = torch.full((n_blocks * block_rows,), n_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, ends[expert] - padded[expert] + rank, order.int())
    starts = torch.arange(n_blocks, device=dev) * block_rows  # [B] first row of each block
    # the expert whose run covers the row
    block_experts = torch.searchsorted(ends, starts, right=True)
    block_experts = torch.where(starts < ends[-1], block_experts, -1).int()
    return sorted_pairs, block_experts, ends[-1:].int()


@dataclass(frozen=True)
class PrefillBlocks:
    """Tile sizes: block_m + tail_m pair rows per block (one expert each), the tail a second, narrower MMA on
    the same decoded weights; bn_up columns of gate and of up per program, bk_up model-dim elements per step;
    bn_down, bk_down the same for down over the expert width; stages_up, stages_down the kernels' pipelines."""

    block_m: int
    tail_m: int
    bn_up: int
    bk_up: int
    bn_down: int
    bk_down: int
    stages_up: int = 2
    stages_down: int = 2

    @property
    def rows(self) -> int:
        return self.block_m + self.tail_m


def tail_rows(block_m: int) -> int:
    return max(BLOCK_M_RANGE[0], block_m // TAIL_SHARE)


def stage_bytes(rows: int, bn: int, bk: int, group: int) -> int:
    """Shared memory of one K step of a program: its rows' activations [rows, bk] in bf16, bn weight rows of bk packed
    FP4 codes and their scale bytes. `stages` of them bound what Triton 3.9 allots the kernels (sm_90 and sm_86,
    tests/kernels/test_fp8_tiles.py; 70 KB at most with TILES, on Hopper)."""
    return rows * bk * 2 + bn * bk // 2 + bn * bk // group


def fit_stages(stages: int, step: int, smem: int) -> int:
    """stages, fewer (down to MIN_STAGES) while `stages` steps of `step` bytes pass `smem`."""
    while stages > MIN_STAGES and stages * step > smem:
        stages -= 1
    return stages


# asked per MoE layer and chunk, with the same few arguments
@functools.lru_cache
def prefill_blocks(n_pairs: int, n_experts: int, layout: RecordLayout, smem: int = REFERENCE_SMEM) -> PrefillBlocks:
    """block_m: the smallest power of two whose block (with its tail) holds BLOCK_M_HEADROOM x the mean rows
    per expert, within BLOCK_M_RANGE (DeepSeek-V3, 256 experts, top-8: 16 + 16 rows at 512 tokens, 64 + 16 at
    2048, 128 + 32 from 4096 on). A uniform routing gives an expert mean +- sqrt(mean) rows: a power of two
    alone would pad half the experts into a second block and decode their weights twice. BN, BK: TILES', halved
    until they divide the matrix (BN down to 16, BK down to one scale block); stages fewer where `smem` (a program's
    shared memory on the card) does not hold them."""
    lo, hi = BLOCK_M_RANGE
    want = math.ceil(BLOCK_M_HEADROOM * n_pairs / n_experts)
    block_m = lo
    while block_m < hi and block_m + tail_rows(block_m) < want:
        block_m *= 2

    # the largest power of two <= want that divides n
    def fit(want: int, n: int, least: int) -> int:
        b = want
        while n % b and b > least:
            b //= 2
        if n % b:
            raise FormatError(f"moe_prefill needs expert dims that are multiples of {least}, got {n}")
        return b

    group = get_format(layout.format).block[1]
    bn_up, bk_up, bn_down, bk_down, st_up, st_down = TILES[layout.format][block_m]
    d, i = layout.dim, layout.inter_dim
    bn_up, bn_down = fit(bn_up, i, BLOCK_M_RANGE[0]), fit(bn_down, d, BLOCK_M_RANGE[0])
    bk_up, bk_down = fit(bk_up, d, group), fit(bk_down, i, group)
    st_up, st_down = (st if bk >= SAFE_BK else 2 for st, bk in ((st_up, bk_up), (st_down, bk_down)))
    rows = block_m + tail_rows(block_m)
    st_up = fit_stages(st_up, stage_bytes(rows, 2 * bn_up, bk_up, group), smem)
    st_down = fit_stages(st_down, stage_bytes(rows, bn_down, bk_down, group), smem)
    return PrefillBlocks(block_m, tail_rows(block_m), bn_up, bk_up, bn_down, bk_down, st_up, st_down)


def _workspace(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch memory the kernels fully overwrite (the tests swap in a NaN-filled allocation)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _grid(n_cols: int, block_experts: torch.Tensor) -> tuple[int, int]:
    """Column blocks vary fastest: the programs running at once share a few blocks of rows, whose gathered
    activations then stay in L2 across the column blocks (and a block's expert weights are read once)."""
    assert block_experts.numel() < 2**16, "too many blocks of rows for the grid's second dimension"
    return n_cols, block_experts.numel()


def _constants(layout: RecordLayout, blocks: PrefillBlocks, dtype: torch.dtype, device: torch.device) -> dict:
    group = get_format(layout.format).block[1]
    assert blocks.bk_up % group == 0 and blocks.bk_down % group == 0, f"K steps must hold whole {group}-blocks"
    nvfp4 = layout.format == "nvfp4"
    return dict(
        G=layout.part("scale_2").offset if nvfp4 else -1,
        GROUP=group,
        E8M0=not nvfp4,
        BM=blocks.block_m,
        BT=blocks.tail_m,
        HW_E4M3=hw_e4m3(device),
        USE_ASM=not interpreted(),
        UNBIAS=E4M3_LIFT_UNBIAS if nvfp4 else 1.0,
        # the interpreter's tl.dot multiplies bf16 bit patterns as integers: it gets exact fp32 operands
        DOT=tl.float32 if dtype == torch.float32 or interpreted() else tl.bfloat16,
        EMULATE_RNE=interpreted() and dtype == torch.bfloat16,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
    )


def gate_up(
    x: torch.Tensor,
    weights: torch.Tensor,
    pairs: torch.Tensor,
    block_experts: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    layout: RecordLayout,
    blocks: PrefillBlocks,
    limit: float = 0.0,
) -> torch.Tensor:
    """x: [T, D], weights: [T, K], pairs and block_experts from align_by_expert -> act [L, I] in x's dtype.
    Rows of unused blocks and of left-out experts are not written. limit: the SwiGLU clamp (kernels/swiglu.py),
    0.0 for none."""
    t, k = weights.shape
    i = layout.inter_dim
    act = _workspace((pairs.numel(), i), x.dtype, x.device)
    jit.gate_up_kernel[_grid(i // blocks.bn_up, block_experts)](
        x,
        weights,
        pairs,
        block_experts,
        records,
        offsets,
        act,
        t * k,
        TOP_K=k,
        D=layout.dim,
        INTER=i,
        W13=layout.part("w13").offset,
        S13=layout.part("w13_scale").offset,
        BN=blocks.bn_up,
        BK=blocks.bk_up,
        LIMIT=float(limit),
        num_stages=blocks.stages_up,
        **_constants(layout, blocks, x.dtype, x.device),
    )
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
    jit.down_kernel[_grid(d // blocks.bn_down, block_experts)](
        act,
        pairs,
        block_experts,
        records,
        offsets,
        out,
        n_pairs,
        D=d,
        INTER=layout.inter_dim,
        W2=layout.part("w2").offset,
        S2=layout.part("w2_scale").offset,
        BN=blocks.bn_down,
        BK=blocks.bk_down,
        num_stages=blocks.stages_down,
        **_constants(layout, blocks, act.dtype, act.device),
    )
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
    x: torch.Tensor,
    weights: torch.Tensor,
    pairs: torch.Tensor,
    block_experts: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    layout: RecordLayout,
    limit: float = 0.0,
) -> torch.Tensor:
    """Torch reference of gate_up (device slots only) in x's dtype; the rows it does not define are zero."""
    k = weights.shape[1]
    act = torch.zeros(pairs.numel(), layout.inter_dim, dtype=x.dtype, device=x.device)
    for e, rows, p in _experts(pairs, block_experts, offsets, weights.numel()):
        w1, w3, _ = _dense(records, offsets[e].item(), layout, x.dtype)
        xe = x[p // k]  # [n, D]
        act[rows] = swiglu(xe @ w1.T, xe @ w3.T, limit) * weights.reshape(-1)[p, None].to(x.dtype)
    return act


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
    out = torch.zeros(n_pairs, layout.dim, dtype=act.dtype, device=act.device)
    for e, rows, p in _experts(pairs, block_experts, offsets, n_pairs):
        out[p] = act[rows] @ _dense(records, offsets[e].item(), layout, act.dtype)[2].T
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
    blocks = blocks or prefill_blocks(t * k, n_experts, layout, card(x.device).smem)
    pairs, block_experts, _ = align_by_expert(ids, n_experts, blocks.rows)
    where = (pairs, block_experts, records, offsets.contiguous(), layout, blocks)
    act = gate_up(x.contiguous(), weights.contiguous(), *where, limit)
    out = down(act, t * k, *where)
    # each token's pairs in slot order: the same bits on every run
    return out.view(t, k, d).sum(1)
