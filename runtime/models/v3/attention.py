"""Multi-head latent attention (MLA) with the compressed latent cache, in the absorbed form or, for long prefill
chunks, the decompressed one.

The cache holds, per token and layer, the normalized latent c_kv (kv_lora_rank values) and the rotated
shared key k_pe (qk_rope_head_dim values). Decode and short chunks fold wkv_b into the query and the output
instead of expanding keys and values per head (checkpoint-spec c.5); a chunk of more than DECOMPRESS_TOKENS
tokens a sequence expands the cached rows a key block at a time and attends per head with 192-wide keys and
128-wide values (V3's), a third of the absorbed form's products per pair (kernels/mla/prefill.py).
Legend: B batch, T new tokens, S cached positions, H heads, C kv_lora_rank, R qk_rope_head_dim,
N qk_nope_head_dim, V v_head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from dsfp4.kernels.backend import use_kernels
from dsfp4.kernels.linear import linear
from dsfp4.kernels.mla.absorb import absorb_keys, absorb_values
from dsfp4.kernels.mla.cache import mla_cache, mla_cache_ref
from dsfp4.kernels.mla.decode import mla_decode, mla_decode_ref
from dsfp4.kernels.mla.prefill import mla_prefill
from dsfp4.kernels.token_bounds import DECODE_TOKENS, DECOMPRESS_TOKENS
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.models.norm import RMSNorm
from dsfp4.runtime.models.position import DevicePosition
from dsfp4.runtime.models.rope import softmax_scale
from dsfp4.runtime.models.weights import Weights
from dsfp4.runtime.plan.limits import SCORE_ELEMENTS


class MLA(nn.Module):
    def __init__(
        self, args: ModelArgs, layer: int, w: Weights, max_batch: int, max_len: int, fp8_attention: bool = False
    ):
        super().__init__()
        # run --fp8-attention: the decompressed prefill's products in e4m3 (kernels/mla/prefill.py fp8)
        self.fp8_attention = fp8_attention
        p, a = f"layers.{layer}.attn.", args
        self.n_heads, self.nope, self.rope, self.v = a.n_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.kv_lora_rank = a.kv_lora_rank
        q_out = a.n_heads * a.qk_head_dim
        self.q_lora = a.q_lora_rank > 0
        if self.q_lora:
            self.wq_a = w.matrix(p + "wq_a", (a.q_lora_rank, a.dim))
            self.q_norm = RMSNorm(w.plain(p + "q_norm.weight", (a.q_lora_rank,)), a.norm_eps)
            self.wq_b = w.matrix(p + "wq_b", (q_out, a.q_lora_rank))
        else:
            self.wq = w.matrix(p + "wq", (q_out, a.dim))
        self.wkv_a = w.matrix(p + "wkv_a", (a.kv_lora_rank + a.qk_rope_head_dim, a.dim))
        self.kv_norm = RMSNorm(w.plain(p + "kv_norm.weight", (a.kv_lora_rank,)), a.norm_eps)
        self.wkv_b = w.matrix(p + "wkv_b", (a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank))
        # decode reads its FP8 blocks (kernels/mla/absorb.py)
        self.absorb_fp8 = self.wkv_b.fp8_on_gpu
        self.wo = w.matrix(p + "wo", (a.dim, a.n_heads * a.v_head_dim))
        self.scale = softmax_scale(a)
        # on the device, or in pinned RAM read in place where the plan keeps this layer's caches there
        self.register_buffer("kv_cache", w.cache(layer, (max_batch, max_len, a.kv_lora_rank)), persistent=False)
        self.register_buffer("pe_cache", w.cache(layer, (max_batch, max_len, a.qk_rope_head_dim)), persistent=False)

    def forward(
        self, x: torch.Tensor, start_pos: int | DevicePosition, freqs_cis: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # x: [B, T, D]
        b, t, _ = x.shape
        q = linear(self.q_norm(linear(x, self.wq_a)), self.wq_b) if self.q_lora else linear(x, self.wq)
        q = q.view(b, t, self.n_heads, self.nope + self.rope)
        kernels, decode = use_kernels(x), b * t <= DECODE_TOKENS
        # a token per sequence, each at its own position and cache slot
        if isinstance(start_pos, DevicePosition):
            # rows: [B, 1]
            end, slot, rows = start_pos.span, start_pos.slot, start_pos.pos.view(b, 1)
        else:
            end, slot, rows = start_pos + t, 0, torch.arange(start_pos, start_pos + t, device=x.device)  # [T]
        kv_cache, pe_cache = self.kv_cache[slot : slot + b], self.pe_cache[slot : slot + b]  # [B, L, C], [B, L, R]
        # q's rope dims rotated in place; the normed latent and rotated key written at the tokens' cache rows
        kv = linear(x, self.wkv_a)  # [B, T, C + R]
        write = mla_cache if kernels else mla_cache_ref
        write(q, kv, freqs_cis, self.kv_norm.weight, self.kv_norm.eps, kv_cache, pe_cache, rows)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)  # [B, T, H, N], [B, T, H, R]
        kv_all, pe_all = kv_cache[:, :end], pe_cache[:, :end]  # [B, S, C], [B, S, R]
        if isinstance(start_pos, int) and attends_decompressed(t):
            # a long prefill chunk, causal by position (the mask is positions()' for start_pos)
            wkv_b = self.dense_wkv_b(x.dtype)
            o = decompressed_attention(
                q_nope, q_pe, kv_all, pe_all, wkv_b, start_pos, self.scale, kernels, self.fp8_attention
            )
        elif decode and self.absorb_fp8:
            # decode multiplies by wkv_b's FP8 blocks (kernels/mla/absorb.py)
            h, (q8, s8) = self.n_heads, self.wkv_b.parts
            q_lat = absorb_keys(q_nope.reshape(b * t, h, -1), q8, s8, self.nope).view(b, t, h, -1)  # [B, T, H, C]
            lat = mla_decode(q_lat, q_pe, kv_all, pe_all, self.scale, mask)  # [B, T, H, C]
            o = absorb_values(lat.reshape(b * t, h, -1), q8, s8, self.nope).view(b, t, h, -1)
        else:
            # wkv_b dequantized once per call, as DeepSeek's reference does, for products on tensor cores
            wkv_b = self.dense_wkv_b(x.dtype)
            o = absorbed_attention(q_nope, q_pe, kv_all, pe_all, wkv_b, self.scale, mask, kernels and decode)
        # o: [B, T, H, V]
        return linear(o.flatten(2), self.wo)

    def dense_wkv_b(self, dtype: torch.dtype) -> torch.Tensor:
        """wkv_b dequantized, head by head: [H, N + V, C], W_UK then W_UV."""
        return self.wkv_b.dequantize(dtype).view(self.n_heads, self.nope + self.v, self.kv_lora_rank)


def attends_decompressed(t: int) -> bool:
    """Whether a prefill chunk of t tokens attends through decompressed keys, causal by position (no [T, S] mask)."""
    return t > DECOMPRESS_TOKENS


def absorbed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    pe: torch.Tensor,
    wkv_b: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    kernel: bool,
) -> torch.Tensor:
    """The absorbed form on the dense wkv_b [H, N + V, C]: q_nope [B, T, H, N], q_pe [B, T, H, R] (rotated), the
    latent cache kv [B, S, C], pe [B, S, R], mask [(B,) T, S] or None -> o [B, T, H, V]. `kernel`: flash-decoding
    (B T <= DECODE_TOKENS), else the torch formula in query chunks."""
    n = q_nope.shape[-1]
    # absorb W_UK: [B, T, H, C]
    q_lat = torch.einsum("bthn,hnc->bthc", q_nope, wkv_b[:, :n])
    lat = mla_decode(q_lat, q_pe, kv, pe, scale, mask) if kernel else attend_latent(q_lat, q_pe, kv, pe, scale, mask)
    # W_UV: [B, T, H, V]
    return torch.einsum("bthc,hvc->bthv", lat, wkv_b[:, n:])


def attend_latent(
    q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, pe: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """mla_decode_ref over query chunks, so that a long prompt never holds all [B, T, H, S] scores at once:
    q_lat [B, T, H, C], q_pe [B, T, H, R], kv [B, S, C], pe [B, S, R], mask [(B,) T, S] or None -> [B, T, H, C]."""
    b, t, h, _ = q_lat.shape
    step = max(1, SCORE_ELEMENTS // (b * h * kv.shape[1]))
    out = []
    for t0 in range(0, t, step):
        chunk = slice(t0, t0 + step)
        m = None if mask is None else mask[..., chunk, :]
        out.append(mla_decode_ref(q_lat[:, chunk], q_pe[:, chunk], kv, pe, scale, m))
    return torch.cat(out, dim=1)


def decompressed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    pe: torch.Tensor,
    wkv_b: torch.Tensor,
    start_pos: int,
    scale: float,
    kernel: bool,
    fp8: bool = False,
) -> torch.Tensor:
    """The decompressed form on the dense wkv_b [H, N + V, C] for a prefill chunk at start_pos: q_nope [B, T, H, N],
    q_pe [B, T, H, R] (rotated), the latent cache through the chunk kv [B, S, C], pe [B, S, R] -> o [B, T, H, V].
    `kernel`: the key blocks attend by the Triton kernel, else by the torch formula; `fp8`: in e4m3 (lossy)."""
    t, h, n = q_nope.shape[1:]
    # a key block's k_nope and v hold at most SCORE_ELEMENTS; the torch formula's [T, H, Sb] scores too
    width = wkv_b.shape[1] if kernel else max(wkv_b.shape[1], t)
    rows = max(1, SCORE_ELEMENTS // (h * width))
    return mla_prefill(q_nope, q_pe, kv, pe, wkv_b, start_pos, scale, rows, kernel, fp8=fp8)
