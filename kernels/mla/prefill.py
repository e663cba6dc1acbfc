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

FP8 (`fp8=True`, a lossy lever for FP8 tensor cores, sm_89 on): the nope part of the scores and the values go through
e4m3 (e4m3_rows.py: q_nope per query and head row, k_nope per key and head row, v per head and value channel over the
block's keys, fp32 scales), the products in fp32. The rope part stays in q_pe's dtype, as DeepSeek's FP8 MLA cache
keeps it (FlashMLA's for V3.2): 64 dims that carry the positions are a fifth of the products. The probabilities meet
the values as p * 448 in e4m3 (p <= 1 after the running max, so the small ones keep e4m3's 3 mantissa bits rather
than its subnormals); the kernel rounds them per key tile at its running max, the formula at the block's, so the two
agree within e4m3's steps, not bit for bit. mla_prefill rounds q once per call and each expanded key block once.

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

from dsfp4.kernels.backend import FP8Path, cuda_props, fp8_path_for, interpreted, tl, triton
from dsfp4.kernels.mla import prefill_jit as jit
from dsfp4.kernels.mla.e4m3_rows import E4M3, E4M3_MAX, E4M3Rows, as_e4m3, e4m3_rows
from dsfp4.layout.formats import next_pow2

# tl.dot's smallest tile side
MIN_TILE = 16
# and its smallest K for 8-bit operands (Triton's bound on NVIDIA): the nope width and the key tile under fp8
FP8_MIN_K = 32
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
# the FP8 variant's: the H200's fastest of the tiles tried (docs/BENCHMARKS.md, 2026-12-04)
FP8_DEFAULT = MLAPrefillConfig(rows=64, keys=128, warps=4, stages=2)


def default_config(fp8: bool) -> MLAPrefillConfig:
    """The block kernel's tiles where the caller names none: FP8_DEFAULT for the fp8 variant, else DEFAULT."""
    return FP8_DEFAULT if fp8 else DEFAULT


def _scores_ref(
    q_nope: torch.Tensor | E4M3Rows,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor | E4M3Rows,
    k_pe: torch.Tensor,
    scale: float,
    ft: torch.dtype,
    fp8: bool,
) -> torch.Tensor:
    """The block's scaled scores [T, H, Sb] in ft; fp8: the nope part from the e4m3 rows, times both rows' scales."""
    if fp8:
        qn, kn = as_e4m3(q_nope, -1), as_e4m3(k_nope, -1)
        scores = torch.einsum("thn,shn->ths", qn.values.to(ft), kn.values.to(ft))
        scores *= qn.scale.to(ft).unsqueeze(-1) * kn.scale.t().to(ft)  # [T, H, 1] x [H, Sb]
    else:
        scores = torch.einsum("thn,shn->ths", q_nope.to(ft), k_nope.to(ft))
    return (scores + torch.einsum("thr,sr->ths", q_pe.to(ft), k_pe.to(ft))) * scale  # [T, H, Sb]


def _values_e4m3_ref(p: torch.Tensor, v: torch.Tensor | E4M3Rows) -> torch.Tensor:
    """p [T, H, Sb] (consumed) against v's e4m3 rows as the kernel takes them -> [T, H, V]: p * 448 rounded to e4m3
    (here at the block's max, the kernel's at its tile's running max), times v_scale / 448 after the product."""
    vq = as_e4m3(v, 0)
    p.mul_(E4M3_MAX)
    p.copy_(p.to(E4M3))
    return torch.einsum("ths,shv->thv", p, vq.values.to(p.dtype)) * (vq.scale.to(p.dtype) / E4M3_MAX)


def mla_prefill_block_ref(
    q_nope: torch.Tensor | E4M3Rows,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor | E4M3Rows,
    k_pe: torch.Tensor,
    v: torch.Tensor | E4M3Rows,
    q_start: int,
    k_start: int,
    scale: float,
    o: torch.Tensor,
    lse: torch.Tensor,
    fp8: bool = False,
) -> None:
    """q_nope [T, H, N], q_pe [T, H, R] at positions q_start..; a key block k_nope [Sb, H, N], k_pe [Sb, R] (shared
    by the heads), v [Sb, H, V] at positions k_start..; o [T, H, V] and lse [T, H] (fp32: what earlier blocks gave,
    o normalized, lse -inf where none was seen) extended by this block in place. Scores and softmax in fp32 (fp64
    for a float64 evaluation). fp8: the e4m3 variant (the module docstring), its products in fp32 on the rounded
    values; q_nope, k_nope and v as e4m3_rows rounds them (q_nope and k_nope along N, v along the keys), rounded here
    unless they come so."""
    ft = torch.promote_types(q_pe.dtype, torch.float32)
    scores = _scores_ref(q_nope, q_pe, k_nope, k_pe, scale, ft, fp8)  # [T, H, Sb]
    q_pos = q_start + torch.arange(q_pe.shape[0], device=o.device)
    k_pos = k_start + torch.arange(k_pe.shape[0], device=o.device)
    scores.masked_fill_((k_pos[None, :] > q_pos[:, None]).unsqueeze(1), float("-inf"))
    m = torch.maximum(lse, scores.amax(dim=-1))  # [T, H]
    # rows with nothing seen yet: subtract 0 (not -inf - -inf)
    m = m.masked_fill(m == float("-inf"), 0.0)
    # in place: the block's scores are its largest tensor
    p = scores.sub_(m.unsqueeze(-1)).exp_()  # [T, H, Sb]
    # the earlier blocks' weight at the new max
    prior = torch.exp(lse - m)  # [T, H]
    total = prior + p.sum(dim=-1)
    pv = _values_e4m3_ref(p, v) if fp8 else torch.einsum("ths,shv->thv", p, v.to(ft))
    acc = o * prior.unsqueeze(-1) + pv  # [T, H, V]
    seen = total > 0
    o.copy_(torch.where(seen.unsqueeze(-1), acc / total.clamp_min(torch.finfo(ft).tiny).unsqueeze(-1), o))
    lse.copy_(torch.where(seen, m + torch.log(total), lse))


def fitted(
    cfg: MLAPrefillConfig, device: torch.device, q_width: int, k_width: int, elt: int, floor: int = MIN_TILE
) -> MLAPrefillConfig:
    """cfg with key rows per tile halved (not below `floor`) until the query tile (q_width: the padded N + R columns)
    and `stages` key tiles (k_width: N + R + V) of elt bytes a column fit a program's shared memory: what Triton 3.6
    allotted on the H200 (its default, 172 KB: Hopper keeps 64 keys; 100 KB Ada GPUs take 16, the A100 32). Widths of
    mixed dtypes (fp8's) come in bytes, with elt 1."""
    if device.type != "cuda":
        return cfg
    props = cuda_props(device.index or 0)
    smem = getattr(props, "shared_memory_per_block_optin", None) or getattr(
        props, "shared_memory_per_multiprocessor", None
    )
    keys, q_tile = cfg.keys, cfg.rows * q_width * elt
    while smem is not None and keys > floor and cfg.stages * keys * k_width * elt + q_tile > smem:
        keys //= 2
    return cfg if keys == cfg.keys else dataclasses.replace(cfg, keys=keys)


def block_plan(
    cfg: MLAPrefillConfig, device: torch.device, n: int, r: int, vd: int, elt: int, fp8: bool = False
) -> tuple[MLAPrefillConfig, list[int]]:
    """The launch's tiles: cfg fitted to the device's shared memory, and the padded widths [NP, RP, VP] of dims n,
    r, vd. The tiles hold elt bytes a column, or under fp8 the nope and value tiles 1 (e4m3: half of bf16's shared
    memory) beside the rope tiles' elt; there the nope width and the key tile are at least FP8_MIN_K. The fp8 rule
    counts V3's rope tiles at elt bytes a column, an upper bound of what Triton allots (test_mla_prefill_fp8.py
    compiles them for sm_89 and sm_90 to check it)."""
    lo = FP8_MIN_K if fp8 else MIN_TILE
    pads = [max(lo, next_pow2(n)), max(MIN_TILE, next_pow2(r)), max(MIN_TILE, next_pow2(vd))]
    if not fp8:
        return fitted(cfg, device, pads[0] + pads[1], sum(pads), elt), pads
    cfg = cfg if cfg.keys >= FP8_MIN_K else dataclasses.replace(cfg, keys=FP8_MIN_K)
    q_bytes = pads[0] + pads[1] * elt
    return fitted(cfg, device, q_bytes, q_bytes + pads[2], 1, FP8_MIN_K), pads


def fp8_kernel_runs(device: torch.device) -> bool:
    """Whether mla_prefill_block's fp8 variant runs on `device`: CUDA GPUs with FP8 tensor cores (sm_89 on; Triton
    has no fp8 type below), or the CPU under Triton's interpreter."""
    if device.type != "cuda":
        return interpreted()
    # the backend's rule for cards whose kernels take e4m3 natively (a forced by-bits path leaves the MMAs there)
    props = cuda_props(device.index or 0)
    return fp8_path_for((props.major, props.minor), hip=torch.version.hip is not None) is FP8Path.NATIVE


def _operands(
    q_nope: torch.Tensor | E4M3Rows,
    k_nope: torch.Tensor | E4M3Rows,
    v: torch.Tensor | E4M3Rows,
    lse: torch.Tensor,
    fp8: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """[q_nope, k_nope, v] as the kernel reads them, and their scales [qs [T, H], ks [Sb, H], vs [H, V]]: the e4m3
    rows and theirs under fp8 (rounded here unless they come so), else the tensors themselves and lse thrice (the
    kernel reads no scale then)."""
    if not fp8:
        return [q_nope, k_nope, v], [lse] * 3
    rounded = [as_e4m3(q_nope, -1), as_e4m3(k_nope, -1), as_e4m3(v, 0)]
    return [x.values for x in rounded], [x.scale for x in rounded]


def mla_prefill_block(
    q_nope: torch.Tensor | E4M3Rows,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor | E4M3Rows,
    k_pe: torch.Tensor,
    v: torch.Tensor | E4M3Rows,
    q_start: int,
    k_start: int,
    scale: float,
    o: torch.Tensor,
    lse: torch.Tensor,
    cfg: MLAPrefillConfig | None = None,
    fp8: bool = False,
) -> None:
    """mla_prefill_block_ref on tensor cores, scores and softmax in fp32 (the probabilities rounded to v's dtype
    for the second product). Every input is read through its strides, the last of unit stride: k_nope and v may be
    views of one decompressed [Sb, H, N + V] block; o and lse are fp32. fp8: mla_prefill_block_ref(fp8=True)'s
    variant on FP8 tensor cores (fp8_kernel_runs), v's e4m3 rows of any strides (e4m3_rows' keep the keys
    contiguous, as the tensor cores read them); under the interpreter its e4m3 tiles widen to fp32 (the same
    values) for tl.dot. cfg: the tiles, default_config(fp8) unless given."""
    if fp8 and not fp8_kernel_runs(q_pe.device):
        raise ValueError("mla_prefill_block: fp8 takes FP8 tensor cores (sm_89 on) or Triton's interpreter")
    (q_nope, k_nope, v), (qs, ks, vs) = _operands(q_nope, k_nope, v, lse, fp8)
    t, h, n = q_nope.shape
    s, r, vd = k_nope.shape[0], q_pe.shape[2], v.shape[2]
    assert k_nope.shape == (s, h, n) and k_pe.shape == (s, r) and v.shape == (s, h, vd), "mla_prefill_block: shapes"
    assert q_pe.shape == (t, h, r) and o.shape == (t, h, vd) and lse.shape == (t, h), "mla_prefill_block: shapes"
    assert o.dtype == lse.dtype == torch.float32, "mla_prefill_block keeps its state in fp32"
    rows = (q_nope, q_pe, k_nope, k_pe, o, lse) + ((qs, ks, vs) if fp8 else (v,))
    assert all(x.stride(-1) == 1 for x in rows), "unit stride rows"
    assert not fp8 or (qs.shape, ks.shape, vs.shape) == ((t, h), (s, h), (h, vd)), "mla_prefill_block: scales"
    # the products' dtype: fp8 keeps q_pe's for the rope product
    dt = k_pe.dtype if fp8 else k_nope.dtype
    cfg, pads = block_plan(
        cfg or default_config(fp8), q_nope.device, n, r, vd, k_pe.element_size() if fp8 else dt.itemsize, fp8
    )
    # fp32 products for fp32 inputs, and under the interpreter (its bf16 tl.dot is wrong)
    exact = dt == torch.float32 or interpreted()
    dot = tl.float32 if exact else _DOT_TYPES[dt]
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
        *v.stride(),
        *o.stride()[:2],
        lse.stride(0),
        qs,
        ks,
        vs,
        qs.stride(0),
        ks.stride(0),
        vs.stride(0),
        N=n,
        R=r,
        V=vd,
        NP=pads[0],
        RP=pads[1],
        VP=pads[2],
        BM=cfg.rows,
        BN=cfg.keys,
        DOT=dot,
        NV_DOT=(tl.float32 if interpreted() else tl.float8e4nv) if fp8 else dot,
        PRECISION="ieee" if exact else "tf32",
        FP8=fp8,
        WIDE=interpreted(),
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
    cfg: MLAPrefillConfig | None = None,
    fp8: bool = False,
) -> torch.Tensor:
    """The decompressed attention of a prefill chunk: q_nope [B, T, H, N], q_pe [B, T, H, R] (rotated) of tokens at
    positions start_pos.., every sequence's latent cache through the chunk kv [B, S, C], pe [B, S, R], wkv_b
    [H, N + V, C] dense -> o [B, T, H, V] in q's dtype. The cache is expanded block_rows rows at a time; `kernel`:
    the blocks attend by the Triton kernel (else by the torch formula). fp8: the e4m3 variant (the module
    docstring), q_nope rounded once per sequence, each block's k_nope and v once (the kernel where fp8_kernel_runs,
    else a ValueError; the formula anywhere)."""
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
        q = e4m3_rows(q_nope[i], -1) if fp8 else q_nope[i]  # [T, H, N]
        for k0 in range(0, s, rows):
            k1 = min(k0 + rows, s)
            keys = torch.mm(kv[i, k0:k1], w.t(), out=buf[: k1 - k0]).view(k1 - k0, h, n + vd)  # [Sb, H, N + V]
            k_pe = pe_buf[: k1 - k0].copy_(pe[i, k0:k1])  # [Sb, R]
            k_nope, v = keys[..., :n], keys[..., n:]  # [Sb, H, N], [Sb, H, V]
            if fp8:
                # one rounding of the block for all its queries: half its bf16 bytes, through one fp32 copy of a part
                k_nope, v = e4m3_rows(k_nope, -1), e4m3_rows(v, 0)
            if kernel:
                mla_prefill_block(q, q_pe[i], k_nope, k_pe, v, start_pos, k0, scale, o, lse, cfg, fp8)
            else:
                mla_prefill_block_ref(q, q_pe[i], k_nope, k_pe, v, start_pos, k0, scale, o, lse, fp8)
        out[i] = o
    return out
