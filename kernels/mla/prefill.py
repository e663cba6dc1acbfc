"""MLA's prefill attention in the decompressed (MHA) form, over key blocks of the latent cache.

The absorbed form (runtime/models/v3/attention.py, mla_decode_ref) scores each head's query against the 576-wide
latent row, (C + R) + C products per query-key pair and head; DeepSeek's reference prefills in the decompressed
form instead, (N + R) + V (320 against 1,088 at V3's sizes), at the cost of expanding the cached keys through
wkv_b, once per key per call. A prefill chunk of T queries pays that back for T above the crossover
(kernels/token_bounds.py DECOMPRESS_TOKENS). Keys are never expanded all at once (V3's 128 heads at 32k keys: 2.7 GB):
`mla_prefill` decompresses block_rows cached rows at a time into k_nope [Sb, H, N] and v [Sb, H, V], attends the
chunk's queries to the block and merges the blocks by their log-sum-exp (flash attention's online softmax, the
output kept normalized in fp32 beside its lse between blocks). Causality is by position: query i of the chunk
sits at start_pos + i and sees the keys at positions up to its own, every earlier chunk's rows included.

The block's attention is a Triton kernel (prefill_jit.py, `mla_prefill_block`) beside its torch formula
(`mla_prefill_block_ref`, fp32 scores). Triton rather than torch's fused scaled_dot_product_attention: the fused
kernels take one key head dim for every head, so k_pe would be broadcast and concatenated into a [Sb, H, 192] copy
per block (the kernel here reads the block's one k_pe row per key for all heads); they return no log-sum-exp to
merge blocks by (only private ops do); their causal flag aligns the diagonal at the top left, and the offset one
(causal_lower_right) goes to the memory-efficient backend or a materialized [T, S] mask, never the flash one.

V4-Flash (runtime/models/v4/attention.py) has no such choice to make: its attention is multi-query over one shared
512-wide K = V vector per token, already decompressed, with no wkv_b to absorb or expand; what it attends (a sliding
window, compressed entries, the indexer's picks, a sink logit) is a mask of its own, not a causal span, so this
kernel does not fit it.
Legend: B batch, T the chunk's tokens, S keys (the cache through the chunk), Sb a block's keys, H heads,
C kv_lora_rank, N nope dim, R rope dim, V value dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dsfp4.kernels.backend import cuda_props, interpreted, tl, triton
from dsfp4.kernels.mla import prefill_jit as jit
from dsfp4.layout.formats import next_pow2

# tl.dot's smallest tile side
MIN_TILE = 16
# the products' dtype for bf16 and fp16 inputs
_DOT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if triton is not None else {}


@dataclass(frozen=True)
class MLAPrefillConfig:
    """Tunables of the block kernel: rows, query rows per program; keys, key rows per tile; warps and stages."""

    rows: int = 128
    keys: int = 64
    warps: int = 8
    stages: int = 3


DEFAULT = MLAPrefillConfig()


def mla_prefill_block_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    k_start: int,
    scale: float,
    o: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """q_nope [T, H, N], q_pe [T, H, R] at positions q_start..; a key block k_nope [Sb, H, N], k_pe [Sb, R] (shared
    by the heads), v [Sb, H, V] at positions k_start..; o [T, H, V] and lse [T, H] (fp32: what earlier blocks gave,
    o normalized, lse -inf where none was seen) extended by this block in place. Scores and softmax in fp32 (fp64
    for a float64 evaluation)."""
    ft = torch.promote_types(q_nope.dtype, torch.float32)
    scores = torch.einsum("thn,shn->ths", q_nope.to(ft), k_nope.to(ft))
    scores = (scores + torch.einsum("thr,sr->ths", q_pe.to(ft), k_pe.to(ft))) * scale  # [T, H, Sb]
    q_pos = q_start + torch.arange(q_nope.shape[0], device=o.device)
    k_pos = k_start + torch.arange(k_nope.shape[0], device=o.device)
    scores.masked_fill_((k_pos[None, :] > q_pos[:, None]).unsqueeze(1), float("-inf"))
    m = torch.maximum(lse, scores.amax(dim=-1))  # [T, H]
    # rows with nothing seen yet: subtract 0 (not -inf - -inf)
    m = m.masked_fill(m == float("-inf"), 0.0)
    # in place: the block's scores are its largest tensor
    p = scores.sub_(m.unsqueeze(-1)).exp_()  # [T, H, Sb]
    # the earlier blocks' weight at the new max
    prior = torch.exp(lse - m)  # [T, H]
    total = prior + p.sum(dim=-1)
    acc = o * prior.unsqueeze(-1) + torch.einsum("ths,shv->thv", p, v.to(ft))  # [T, H, V]
    seen = total > 0
    o.copy_(torch.where(seen.unsqueeze(-1), acc / total.clamp_min(torch.finfo(ft).tiny).unsqueeze(-1), o))
    lse.copy_(torch.where(seen, m + torch.log(total), lse))


def fitted(cfg: MLAPrefillConfig, device: torch.device, q_width: int, k_width: int, elt: int) -> MLAPrefillConfig:
    """cfg with key rows per tile halved until the query tile (q_width: the padded N + R columns) and `stages` key
    tiles (k_width: N + R + V) fit a program's shared memory: what Triton 3.6 allotted on the H200 (its default,
    172 KB: Hopper keeps 64 keys; 100 KB Ada GPUs take 16, the A100 32)."""
    if device.type != "cuda":
        return cfg
    props = cuda_props(device.index or 0)
    smem = getattr(props, "shared_memory_per_block_optin", None) or getattr(
        props, "shared_memory_per_multiprocessor", None
    )
    keys, q_tile = cfg.keys, cfg.rows * q_width * elt
    while smem is not None and keys > MIN_TILE and cfg.stages * keys * k_width * elt + q_tile > smem:
        keys //= 2
    return cfg if keys == cfg.keys else dataclasses.replace(cfg, keys=keys)


def mla_prefill_block(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    k_start: int,
    scale: float,
    o: torch.Tensor,
    lse: torch.Tensor,
    cfg: MLAPrefillConfig = DEFAULT,
) -> None:
    """mla_prefill_block_ref on tensor cores, scores and softmax in fp32 (the probabilities rounded to v's dtype
    for the second product). Every input is read through its strides, the last of unit stride: k_nope and v may be
    views of one decompressed [Sb, H, N + V] block; o and lse are fp32."""
    t, h, n = q_nope.shape
    s, r, vd = k_nope.shape[0], q_pe.shape[2], v.shape[2]
    assert k_nope.shape == (s, h, n) and k_pe.shape == (s, r) and v.shape == (s, h, vd), "mla_prefill_block: shapes"
    assert q_pe.shape == (t, h, r) and o.shape == (t, h, vd) and lse.shape == (t, h), "mla_prefill_block: shapes"
    assert o.dtype == lse.dtype == torch.float32, "mla_prefill_block keeps its state in fp32"
    assert all(x.stride(-1) == 1 for x in (q_nope, q_pe, k_nope, k_pe, v, o, lse)), "unit stride rows"
    pads = [max(MIN_TILE, next_pow2(d)) for d in (n, r, vd)]
    cfg = fitted(cfg, q_nope.device, pads[0] + pads[1], sum(pads), k_nope.element_size())
    # fp32 products for fp32 inputs, and under the interpreter (its bf16 tl.dot is wrong)
    exact = k_nope.dtype == torch.float32 or interpreted()
    jit.block_kernel[(triton.cdiv(t, cfg.rows), h)](
        q_nope,
        q_pe,
        k_nope,
        k_pe,
        v,
        o,
        lse,
        scale * jit.LOG2E,
        t,
        s,
        q_start,
        k_start,
        *q_nope.stride()[:2],
        *q_pe.stride()[:2],
        *k_nope.stride()[:2],
        k_pe.stride(0),
        *v.stride()[:2],
        *o.stride()[:2],
        lse.stride(0),
        N=n,
        R=r,
        V=vd,
        NP=pads[0],
        RP=pads[1],
        VP=pads[2],
        BM=cfg.rows,
        BN=cfg.keys,
        DOT=tl.float32 if exact else _DOT_TYPES[k_nope.dtype],
        PRECISION="ieee" if exact else "tf32",
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )


def mla_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    pe: torch.Tensor,
    wkv_b: torch.Tensor,
    start_pos: int,
    scale: float,
    block_rows: int,
    kernel: bool,
    cfg: MLAPrefillConfig = DEFAULT,
) -> torch.Tensor:
    """The decompressed attention of a prefill chunk: q_nope [B, T, H, N], q_pe [B, T, H, R] (rotated) of tokens at
    positions start_pos.., every sequence's latent cache through the chunk kv [B, S, C], pe [B, S, R], wkv_b
    [H, N + V, C] dense -> o [B, T, H, V] in q's dtype. The cache is expanded block_rows rows at a time; `kernel`:
    the blocks attend by the Triton kernel (else by the torch formula)."""
    b, t, h, n = q_nope.shape
    s, c = kv.shape[1], kv.shape[2]
    vd = wkv_b.shape[1] - n
    w = wkv_b.reshape(h * (n + vd), c)  # [H (N + V), C]
    rows = max(1, min(block_rows, s))
    ft = torch.promote_types(q_nope.dtype, torch.float32)
    # one block's decompressed rows and its k_pe, reused by every block: in device memory where the cache is host
    # memory the device reads in place, so the kernel's programs (each query tile and head) read k_pe there
    buf, pe_buf = kv.new_empty(rows, h * (n + vd)), pe.new_empty(rows, pe.shape[2])  # [Sb, H (N + V)], [Sb, R]
    out = q_nope.new_empty(b, t, h, vd)
    for i in range(b):
        o = torch.zeros(t, h, vd, dtype=ft, device=q_nope.device)  # [T, H, V]
        lse = torch.full((t, h), float("-inf"), dtype=ft, device=q_nope.device)  # [T, H]
        for k0 in range(0, s, rows):
            k1 = min(k0 + rows, s)
            keys = torch.mm(kv[i, k0:k1], w.t(), out=buf[: k1 - k0]).view(k1 - k0, h, n + vd)  # [Sb, H, N + V]
            k_pe = pe_buf[: k1 - k0].copy_(pe[i, k0:k1])  # [Sb, R]
            k_nope, v = keys[..., :n], keys[..., n:]  # [Sb, H, N], [Sb, H, V]
            if kernel:
                mla_prefill_block(q_nope[i], q_pe[i], k_nope, k_pe, v, start_pos, k0, scale, o, lse, cfg)
            else:
                mla_prefill_block_ref(q_nope[i], q_pe[i], k_nope, k_pe, v, start_pos, k0, scale, o, lse)
        out[i] = o
    return out
