"""MLA's per-token glue before the attention product, in one launch on CUDA (prefill and decode): rotate the
query's rope dims in place, normalize the latent c_kv and rotate the shared key k_pe straight into their cache rows.

In torch this is ~10 small kernels per layer, which at decode (casts of strided slices, two complex products and
their casts back, the norm, two cache copies), several times the time of the few KB they move.
`mla_cache_ref` is the formula (apply_rotary_emb, rmsnorm_ref, index_copy_), which
runtime/models/v3/attention.py runs off CUDA. Rows must lie within the cache: the engine bounds the context (a
slice assignment would raise, the kernel would write past the buffer).
Legend: B batch, T tokens, H heads, N nope dim, R rope dim, C kv_lora_rank, L cache rows.
"""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import tl, triton
from dsfp4.kernels.rmsnorm import rmsnorm_ref
from dsfp4.kernels.rope import apply_rotary_emb
from dsfp4.layout.formats import next_pow2


def mla_cache_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    freqs_cis: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    kv_cache: torch.Tensor,
    pe_cache: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """q: [B, T, H, N + R], its last R dims rotated in place; kv: [B, T, C + R] (wkv_a's output): the first C
    normalized by weight into kv_cache[:B, rows], the last R rotated into pe_cache[:B, rows]; freqs_cis:
    [T, R/2] complex64 and rows: [T] int64 cache positions, the same for every sequence, or [B, T] and [B, T, R/2]
    each sequence its own (a batch at positions of its own)."""
    b, t, r = q.shape[0], q.shape[1], pe_cache.shape[-1]
    q[..., -r:] = apply_rotary_emb(q[..., -r:], freqs_cis)
    c_kv, k_pe = kv.split([kv.shape[-1] - r, r], dim=-1)  # [B, T, C], [B, T, R]
    seq = torch.arange(b, device=rows.device)[:, None]  # [B, 1]
    rows = rows.expand(b, t)  # [B, T]
    kv_cache[seq, rows] = rmsnorm_ref(c_kv, weight, eps).to(kv_cache.dtype)
    pe_cache[seq, rows] = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis).squeeze(2).to(pe_cache.dtype)


if triton is not None:
    from dsfp4.kernels.rmsnorm import rms_row
    from dsfp4.kernels.rope import rotate_pairs

    @triton.jit
    def _pairs(ptrs, ok):
        """Load [M, 2 HALFP] values as fp32 (even, odd) halves [M, HALFP]: contiguous loads, split in registers."""
        x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        return tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))

    @triton.jit
    def _joined(re, im, dtype: tl.constexpr):
        """The inverse of _pairs: (even, odd) [M, HALFP] -> [M, 2 HALFP] interleaved in `dtype`."""
        x = tl.join(re, im)
        return tl.reshape(x, (x.shape[0], x.shape[1] * 2)).to(dtype)

    @triton.jit(do_not_specialize=["T"])
    def _mla_cache_kernel(
        q_ptr,
        kv_ptr,
        f_ptr,
        w_ptr,
        kvc_ptr,
        pec_ptr,
        rows_ptr,
        T,
        eps,
        stride_rb,
        stride_fb,
        stride_qb,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_ft,
        stride_cb,
        stride_cl,
        stride_pb,
        stride_pl,
        H: tl.constexpr,
        HP: tl.constexpr,
        N: tl.constexpr,
        R: tl.constexpr,
        RP: tl.constexpr,
        C: tl.constexpr,
        CP: tl.constexpr,
        W_FP32: tl.constexpr,
    ):
        """One token (b, t) per program: its H query heads, its latent row and its key row. Every load comes
        before the first store: the compiler cannot tell that the stores miss what is loaded after them, so
        interleaving them would chain one memory latency after another."""
        # b * a cache's batch stride: past 2^31
        b, t = (tl.program_id(0) // T).to(tl.int64), tl.program_id(0) % T
        dims = tl.arange(0, RP)[None, :]  # [1, RP]: the rope dims as a row, for _pairs
        in_r = dims < R
        # freqs_cis as (real, imaginary) fp32 pairs: the token's own row, or its sequence's (stride_fb 0: shared)
        cos, sin = _pairs(f_ptr + b * stride_fb + t * stride_ft + dims, in_r)
        heads = tl.arange(0, HP)[:, None]
        qp = q_ptr + b * stride_qb + t * stride_qt + heads * stride_qh + N + dims  # [HP, RP] rope dims
        q_ok = (heads < H) & in_r
        q_re, q_im = _pairs(qp, q_ok)
        src = kv_ptr + b * stride_kb + t * stride_kt
        cols = tl.arange(0, CP)
        in_c = cols < C
        c_kv = tl.load(src + cols, mask=in_c, other=0.0).to(tl.float32)
        k_re, k_im = _pairs(src + C + dims, in_r)
        row = tl.load(rows_ptr + b * stride_rb + t)
        normed = rms_row(c_kv, w_ptr, cols, in_c, eps, kvc_ptr.dtype.element_ty, C, W_FP32)
        # the query's rope dims rotated where they are; the normed latent and the rotated key into their rows
        q_re, q_im = rotate_pairs(q_re, q_im, cos, sin)
        tl.store(qp, _joined(q_re, q_im, q_ptr.dtype.element_ty), mask=q_ok)
        tl.store(kvc_ptr + b * stride_cb + row * stride_cl + cols, normed, mask=in_c)
        k_re, k_im = rotate_pairs(k_re, k_im, cos, sin)
        tl.store(
            pec_ptr + b * stride_pb + row * stride_pl + dims, _joined(k_re, k_im, pec_ptr.dtype.element_ty), mask=in_r
        )


def mla_cache(
    q: torch.Tensor,
    kv: torch.Tensor,
    freqs_cis: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    kv_cache: torch.Tensor,
    pe_cache: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """mla_cache_ref's effect in one launch, a program per token (the caller takes the reference where Triton
    cannot run)."""
    b, t, h, _ = q.shape
    r, c = pe_cache.shape[-1], kv_cache.shape[-1]
    assert q.stride(-1) == kv.stride(-1) == 1 and kv.shape[-1] == c + r
    assert freqs_cis.shape[-2:] == (t, r // 2) and rows.shape[-1] == t, (
        "mla_cache: freqs_cis [(B,) T, R/2], rows [(B,) T]"
    )
    assert kv_cache.stride(-1) == pe_cache.stride(-1) == 1, "caches of unit stride in their last dim"
    f = torch.view_as_real(freqs_cis)  # [(B,) T, R/2, 2] fp32
    assert f.stride(-2) == 2 and rows.stride(-1) == 1, "freqs_cis: rows of contiguous pairs; rows: contiguous"
    # 0: every sequence at the same positions
    stride_fb = f.stride(0) if f.dim() == 4 else 0
    stride_rb = rows.stride(0) if rows.dim() == 2 else 0
    _mla_cache_kernel[(b * t,)](
        q,
        kv,
        f,
        weight,
        kv_cache,
        pe_cache,
        rows,
        t,
        eps,
        stride_rb,
        stride_fb,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        kv.stride(0),
        kv.stride(1),
        f.stride(-3),
        kv_cache.stride(0),
        kv_cache.stride(1),
        pe_cache.stride(0),
        pe_cache.stride(1),
        H=h,
        HP=next_pow2(h),
        N=q.shape[-1] - r,
        R=r,
        RP=2 * next_pow2(r // 2),
        C=c,
        CP=next_pow2(c),
        W_FP32=weight.dtype == torch.float32,
        num_warps=4,
    )
