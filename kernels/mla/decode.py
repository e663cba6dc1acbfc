"""MLA's decode attention core (absorbed query against the latent cache) in two Triton launches.

runtime/models/v3/attention.py's absorbed MLA scores each head's query qn [C] against the cached latent c_kv and
its rope part qp [R] against the shared rotated key k_pe, softmaxes over the span and sums c_kv rows with the weights.
Torch spends ~12 small kernels per layer on it at decode (two split-K gemms, add, scale, mask, softmax, cast,
gemm, cat), far more time than the cache bytes need. Here flash-decoding does it: the span is split over
programs, each a block of query rows ((token, head) pairs of one sequence: tokens of a sequence share its cache
rows) against its positions in tiles, the softmax online in fp32; a second kernel merges the splits (their
running max and sum) and writes lat. One split writes lat directly (one launch).
`mla_decode_ref` is the torch formula. Legend: B batch, T tokens, H heads, C kv_lora_rank, R rope dim,
S the attention span, M = T H query rows of a sequence.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from dsfp4.kernels.backend import cuda_props, interpreted, n_sms, tl, triton
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.layout.formats import next_pow2

# B * T at most: beyond it (prefill) the torch formula's gemms are the right tool
MAX_TOKENS = DECODE_TOKENS
# tl.dot's smallest tile side
MIN_BLOCK_S = 16
# [splits, columns] elements a merge program holds at most (32 fp32 registers a thread at 4 warps)
COMBINE_TILE = 4096
# scores are kept in base-2 units: exp2 is the hardware's exponential
LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class MLADecodeConfig:
    """Tunables. rows: query rows ((token, head) pairs) per program (tl.dot wants >= 16); block_s: positions
    per tile; warps, stages: the split kernel's; waves: programs per SM the split rule aims for; min_tiles:
    tiles per split at least; splits: a fixed split count (0: the rule); skip_masked: skip a tile whose mask
    is -inf for every row (a captured step's span past its position) before reading its cache rows;
    combine_block / combine_warps: latent columns per merge program and its warps."""

    rows: int = 16
    block_s: int = 64
    warps: int = 4
    stages: int = 2
    # faster than one wave at a 4096 span in the H100 probe, the same at 1024 (docs/BENCHMARKS.md)
    waves: int = 2
    min_tiles: int = 1
    splits: int = 0
    skip_masked: bool = True
    combine_block: int = 128
    combine_warps: int = 4


DEFAULT = MLADecodeConfig()


def mla_decode_ref(
    qn: torch.Tensor, qp: torch.Tensor, kv: torch.Tensor, pe: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """qn: [B, T, H, C], qp: [B, T, H, R], kv: [B, S, C], pe: [B, S, R], mask: additive, [T, S] for every
    sequence or [B, T, S] one each (a batch at positions of its own), or None -> lat [B, T, H, C] in qn's dtype.
    The softmax runs in fp32 (fp64 for a float64 evaluation)."""
    scores = torch.einsum("bthc,bsc->bths", qn, kv) + torch.einsum("bthr,bsr->bths", qp, pe)  # [B, T, H, S]
    scores = scores * scale
    if mask is not None:
        scores = scores + mask.unsqueeze(-2)  # [(B,) T, S] -> [(B,) T, 1, S]
    probs = scores.softmax(dim=-1, dtype=torch.promote_types(qn.dtype, torch.float32)).to(qn.dtype)
    # lat: [B, T, H, C]
    return torch.einsum("bths,bsc->bthc", probs, kv)


def fitted(cfg: MLADecodeConfig, device: torch.device, c: int, r: int, elt: int) -> MLADecodeConfig:
    """cfg with positions per tile halved until `stages` cache tiles fit one SM's shared memory (an upper estimate:
    the default's 64 positions of V3's 576 bf16 columns compile to 98 KB on sm_89 against 147 KB estimated). Hopper
    and the A100 (164-228 KB) keep 64; Ampere and Ada consumer GPUs (100 KB) take 32."""
    if device.type != "cuda":
        return cfg
    smem = getattr(cuda_props(device.index or 0), "shared_memory_per_multiprocessor", None)
    block_s, tile = cfg.block_s, (next_pow2(c) + next_pow2(r)) * elt
    while smem is not None and block_s > MIN_BLOCK_S and cfg.stages * block_s * tile > smem:
        block_s //= 2
    return cfg if block_s == cfg.block_s else dataclasses.replace(cfg, block_s=block_s)


def split_plan(s: int, row_blocks: int, n_sms: int, cfg: MLADecodeConfig = DEFAULT) -> tuple[int, int]:
    """(splits, positions per split) for a span of s positions and row_blocks programs per split: enough splits
    that the grid covers the SMs `waves` times, each a whole number of tiles (at least min_tiles), none empty."""
    tiles = triton.cdiv(max(s, 1), cfg.block_s)
    want = cfg.splits or triton.cdiv(n_sms * cfg.waves, row_blocks)
    splits = max(1, min(want, tiles // cfg.min_tiles))
    # tiles per split
    per = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, per), per * cfg.block_s


if triton is not None:
    _LOG2E = tl.constexpr(LOG2E)
    _DOT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _mask_tile(mask_ptr, t, s, row_ok, s_ok, stride_mt, stride_ms, HB: tl.constexpr, HAS_MASK: tl.constexpr):
        """[HB, BS] the additive mask of each row's token at positions s, base 2; -inf past the split."""
        if HAS_MASK:
            ok = row_ok[:, None] & s_ok[None, :]
            add = tl.load(mask_ptr + t[:, None] * stride_mt + s[None, :] * stride_ms, mask=ok, other=float("-inf"))
            return add.to(tl.float32) * _LOG2E
        return tl.where(s_ok[None, :], tl.zeros((HB, s.shape[0]), dtype=tl.float32), float("-inf"))

    @triton.jit
    def _query_rows(ptr, b, t, h, row_ok, cols, stride_b, stride_t, stride_h, N: tl.constexpr, DOT: tl.constexpr):
        """[HB, NP] the query of each row's (token t, head h) in sequence b, in the products' dtype; 0 at columns
        cols >= N and padding rows."""
        ok = row_ok[:, None] & (cols < N)[None, :]
        return tl.load(
            ptr + b * stride_b + (t * stride_t + h * stride_h)[:, None] + cols[None, :], mask=ok, other=0.0
        ).to(DOT)

    @triton.jit
    def _cache_tile(ptr, b, s, s_ok, cols, stride_b, stride_s, N: tl.constexpr, DOT: tl.constexpr):
        """[BS, NP] sequence b's cache rows at positions s, in the products' dtype; 0 past the split (s_ok false)
        and at columns cols >= N."""
        return tl.load(
            ptr + b * stride_b + s[:, None] * stride_s + cols[None, :],
            mask=s_ok[:, None] & (cols < N)[None, :],
            other=0.0,
        ).to(DOT)

    @triton.jit
    def _live_span(
        mask_ptr,
        t,
        row_ok,
        start,
        stop,
        stride_mt,
        stride_ms,
        HB: tl.constexpr,
        BS: tl.constexpr,
        HAS_MASK: tl.constexpr,
    ):
        """[lo, hi): [start, stop) narrowed to the tiles some row sees (a captured step's span past its position
        is -inf): the main loop then reads no cache for the others, and stays free of branches to pipeline."""
        lo, hi = stop, start
        for s0 in range(start, stop, BS):
            s = s0 + tl.arange(0, BS)
            add = _mask_tile(mask_ptr, t, s, row_ok, s < stop, stride_mt, stride_ms, HB, HAS_MASK)
            live = tl.max(tl.max(add, axis=1), axis=0) > float("-inf")
            lo = tl.where(live & (lo == stop), s0, lo)
            hi = tl.where(live, s0 + BS, hi)
        return lo, hi

    @triton.jit
    def _attend_tile(qn, qp, kv, pe, add, m_i, l_i, acc, qk_scale, DOT: tl.constexpr, PRECISION: tl.constexpr):
        """One tile of the online softmax: the rows' base-2 scores against kv, pe (add: the mask) folded into the
        running max m_i [HB], sum l_i [HB] and unnormalized sum of c_kv rows acc [HB, CP] -> the three updated."""
        scores = tl.dot(qn, tl.trans(kv), input_precision=PRECISION)  # [HB, BS] fp32
        scores = tl.dot(qp, tl.trans(pe), scores, input_precision=PRECISION)
        scores = scores * qk_scale + add
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # rows with nothing unmasked yet keep m = -inf: subtract 0 there (not -inf - -inf = NaN)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(scores - m_ref[:, None])  # [HB, BS]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p rounds to the cache's dtype for the tensor cores (the reference rounds its probs likewise)
        acc = tl.dot(p.to(DOT), kv, acc * alpha[:, None], input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _store_split(
        part_ptr,
        ml_ptr,
        lat_ptr,
        acc,
        m_i,
        l_i,
        b,
        sp,
        splits,
        rows,
        row_ok,
        c,
        T: tl.constexpr,
        H: tl.constexpr,
        C: tl.constexpr,
        DIRECT: tl.constexpr,
    ):
        """The split's sum acc [HB, CP] with its running max and sum into its partials, or lat when DIRECT."""
        out_ok = row_ok[:, None] & (c < C)[None, :]
        seq_row = b * T * H + rows  # [HB]: the row's index among all B T H rows
        if DIRECT:
            # padding rows have l = 0
            lat = acc / tl.where(row_ok, l_i, 1.0)[:, None]
            tl.store(lat_ptr + seq_row[:, None] * C + c[None, :], lat.to(lat_ptr.dtype.element_ty), mask=out_ok)
        else:
            part = seq_row * splits + sp  # [HB]
            tl.store(part_ptr + part[:, None] * C + c[None, :], acc, mask=out_ok)
            tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)

    # the span and its splits change at every eager decode step: one compiled variant for all of them
    @triton.jit(do_not_specialize=["S", "chunk", "splits", "stride_mb", "stride_mt"])
    def _split_kernel(
        qn_ptr,
        qp_ptr,
        kv_ptr,
        pe_ptr,
        mask_ptr,
        part_ptr,
        ml_ptr,
        lat_ptr,
        qk_scale,
        S,
        chunk,
        splits,
        stride_qnb,
        stride_qnt,
        stride_qnh,
        stride_qpb,
        stride_qpt,
        stride_qph,
        stride_kvb,
        stride_kvs,
        stride_peb,
        stride_pes,
        stride_mb,
        stride_mt,
        stride_ms,
        T: tl.constexpr,
        H: tl.constexpr,
        C: tl.constexpr,
        R: tl.constexpr,
        CP: tl.constexpr,
        RP: tl.constexpr,
        HB: tl.constexpr,
        BS: tl.constexpr,
        HAS_MASK: tl.constexpr,
        SKIP_MASKED: tl.constexpr,
        DIRECT: tl.constexpr,
        DOT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Rows pid 0 * HB .. of sequence pid 2 against positions pid 1 * chunk ..: the unnormalized sum of c_kv
        rows [HB, C] with its running max and sum (base 2) into the split's partials, or lat when DIRECT."""
        b = tl.program_id(2).to(tl.int64)
        sp = tl.program_id(1)
        # this sequence's [T, S] (stride 0: one mask for all)
        mask_ptr += b * stride_mb
        rows = tl.program_id(0) * HB + tl.arange(0, HB)  # [HB]: row = t H + h
        row_ok = rows < T * H
        t, h = rows // H, rows % H
        c, r = tl.arange(0, CP), tl.arange(0, RP)
        qn = _query_rows(qn_ptr, b, t, h, row_ok, c, stride_qnb, stride_qnt, stride_qnh, C, DOT)  # [HB, CP]
        qp = _query_rows(qp_ptr, b, t, h, row_ok, r, stride_qpb, stride_qpt, stride_qph, R, DOT)  # [HB, RP]
        # running max of the base-2 scores
        m_i = tl.full((HB,), float("-inf"), dtype=tl.float32)
        # running sum of exp2(score - m_i)
        l_i = tl.zeros((HB,), dtype=tl.float32)
        acc = tl.zeros((HB, CP), dtype=tl.float32)
        start = sp * chunk
        stop = tl.minimum(start + chunk, S)
        lo, hi = start, stop
        if SKIP_MASKED:
            lo, hi = _live_span(mask_ptr, t, row_ok, start, stop, stride_mt, stride_ms, HB, BS, HAS_MASK)
        for s0 in range(lo, hi, BS):
            s = s0 + tl.arange(0, BS)
            s_ok = s < stop
            add = _mask_tile(mask_ptr, t, s, row_ok, s_ok, stride_mt, stride_ms, HB, HAS_MASK)  # [HB, BS]
            kv = _cache_tile(kv_ptr, b, s, s_ok, c, stride_kvb, stride_kvs, C, DOT)  # [BS, CP]
            pe = _cache_tile(pe_ptr, b, s, s_ok, r, stride_peb, stride_pes, R, DOT)  # [BS, RP]
            m_i, l_i, acc = _attend_tile(qn, qp, kv, pe, add, m_i, l_i, acc, qk_scale, DOT, PRECISION)
        _store_split(part_ptr, ml_ptr, lat_ptr, acc, m_i, l_i, b, sp, splits, rows, row_ok, c, T, H, C, DIRECT)

    @triton.jit(do_not_specialize=["splits"])
    def _combine_kernel(part_ptr, ml_ptr, lat_ptr, splits, C: tl.constexpr, SP: tl.constexpr, CB: tl.constexpr):
        """Row pid 0, latent columns pid 1 * CB ..: the splits' sums rescaled to their common max, over the sum."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * CB + tl.arange(0, CB)
        j = tl.arange(0, SP)
        j_ok = j < splits
        m = tl.load(ml_ptr + (row * splits + j) * 2, mask=j_ok, other=float("-inf"))  # [SP]
        l_j = tl.load(ml_ptr + (row * splits + j) * 2 + 1, mask=j_ok, other=0.0)
        m_all = tl.max(m, axis=0)
        # splits with every position masked (m = -inf) weigh 0
        w = tl.math.exp2(m - m_all)
        part = tl.load(
            part_ptr + (row * splits + j)[:, None] * C + c[None, :], mask=j_ok[:, None] & (c < C)[None, :], other=0.0
        )
        lat = tl.sum(part * w[:, None], axis=0) / tl.sum(l_j * w, axis=0)  # [CB]
        tl.store(lat_ptr + row * C + c, lat.to(lat_ptr.dtype.element_ty), mask=c < C)


def mla_decode(
    qn: torch.Tensor,
    qp: torch.Tensor,
    kv: torch.Tensor,
    pe: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    cfg: MLADecodeConfig = DEFAULT,
) -> torch.Tensor:
    """mla_decode_ref's lat [B, T, H, C] in qn's dtype, scores and softmax in fp32, for B T <= MAX_TOKENS.
    kv / pe may be slices [:B, :S] of larger cache buffers (read through their strides; rows past S never are);
    every row of the mask must leave a position unmasked. No host sync, no data-dependent allocation: it can
    be captured in a CUDA graph (the splits depend on the shapes only)."""
    b, t, h, c = qn.shape
    s, r = kv.shape[1], pe.shape[2]
    # off CUDA: an H100's SMs
    cfg, sms = fitted(cfg, qn.device, c, r, kv.element_size()), n_sms(qn.device)
    assert b * t <= MAX_TOKENS, f"mla_decode takes up to {MAX_TOKENS} tokens (B T = {b * t})"
    assert qp.shape == (b, t, h, r) and kv.shape == (b, s, c) and pe.shape == (b, s, r), "mla_decode: shapes"
    assert all(x.stride(-1) == 1 for x in (qn, qp, kv, pe)), "mla_decode reads rows of unit stride"
    assert mask is None or mask.shape in ((t, s), (b, t, s)), f"mla_decode: a mask of [(B,) T, S], got {mask.shape}"
    lat = torch.empty(b, t, h, c, dtype=qn.dtype, device=qn.device)
    row_blocks = triton.cdiv(t * h, cfg.rows)
    splits, chunk = split_plan(s, b * row_blocks, sms, cfg)
    direct = splits == 1
    # fp32 products for fp32 caches, and under the interpreter (its bf16 tl.dot is wrong)
    exact = kv.dtype == torch.float32 or interpreted()
    # the split partials: unnormalized sums [B T H, splits, C] and (max, sum) pairs, fp32
    part = qn.new_empty(1 if direct else b * t * h * splits * c, dtype=torch.float32)
    ml = qn.new_empty(1 if direct else b * t * h * splits * 2, dtype=torch.float32)
    # any pointer: HAS_MASK=False never reads it
    m_arg = mask if mask is not None else kv
    m_strides = (0, 0, 0) if mask is None else mask.stride() if mask.dim() == 3 else (0, *mask.stride())
    _split_kernel[(row_blocks, splits, b)](
        qn,
        qp,
        kv,
        pe,
        m_arg,
        part,
        ml,
        lat,
        scale * LOG2E,
        s,
        chunk,
        splits,
        *qn.stride()[:3],
        *qp.stride()[:3],
        kv.stride(0),
        kv.stride(1),
        pe.stride(0),
        pe.stride(1),
        *m_strides,
        T=t,
        H=h,
        C=c,
        R=r,
        CP=next_pow2(c),
        RP=next_pow2(r),
        HB=cfg.rows,
        BS=cfg.block_s,
        HAS_MASK=mask is not None,
        SKIP_MASKED=cfg.skip_masked and mask is not None,
        DIRECT=direct,
        DOT=tl.float32 if exact else _DOT_TYPES[kv.dtype],
        PRECISION="ieee" if exact else "tf32",
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    if not direct:
        # the most splits any span gets at this shape, so that one variant serves a growing span (no recompile)
        sp = next_pow2(split_plan(1 << 30, b * row_blocks, sms, cfg)[0])
        # many splits: fewer columns
        cb = min(cfg.combine_block, next_pow2(c), max(1, COMBINE_TILE // sp))
        _combine_kernel[(b * t * h, triton.cdiv(c, cb))](
            part, ml, lat, splits, C=c, SP=sp, CB=cb, num_warps=cfg.combine_warps
        )
    return lat
