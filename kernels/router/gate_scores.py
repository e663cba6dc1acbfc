"""The MoE router's scores in one launch at decode: logits = x @ W^T in fp32, then the score function. torch spends
three launches per MoE layer on it (x cast to fp32, cuBLAS's fp32 GEMV at about a third of HBM bandwidth, the
sigmoid), and the GEMV's weight (E x D fp32: 7.3 MB in V3) is the only read that matters.

`gate_scores_ref` is the formula (runtime/models/moe.py's expert_scores). The kernel reads x in its own dtype and
converts it in registers, reads each weight row once for all T tokens, accumulates in fp32 and applies sigmoid or
sqrt(softplus) before the one store.

Tiles: a program takes BLOCK_E rows and the whole of D, in CHUNKS = cdiv(D, BLOCK_D) steps of [BLOCK_E, BLOCK_D].
E is only 256, so rows are split over programs rather than D over a second pass: BLOCK_E = 1 gives 256 programs
(two per H100 SM), each loading its row in 16-byte pieces. Every chunk of the row is loaded before the first
product, so the whole matrix is in flight at once (the read is latency-bound at this size); that keeps
BLOCK_E * D / (32 * num_warps) fp32 per thread in registers, and each token adds a [BLOCK_E, BLOCK_D]
accumulator. Each token's products are summed lane-wise across the chunks and reduced once at the end: the
order is fixed by the tiles, so results are deterministic and a token's scores do not depend on the others.
Legend: T tokens, E experts, D model dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsfp4.kernels.backend import tl, triton
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.layout.formats import next_pow2

# softmax needs the whole row of E: it stays with the reference
KERNEL_SCORES = ("sigmoid", "sqrtsoftplus")
# decode token counts (MTP included); prefill's T goes to cuBLAS, which wins there
MAX_TOKENS = DECODE_TOKENS
# torch's F.softplus default: above it softplus(z) returns z
SOFTPLUS_THRESHOLD = 20.0
# the kernel's offsets are int32
INDEX_LIMIT = 2**31


@dataclass(frozen=True)
class GateTiles:
    """Rows per program, columns per step (a power of two; shrunk to next_pow2(D) for narrow models), warps."""

    # 256 programs at E = 256
    block_e: int = 1
    # 4 fp32 (one 16-byte load) per thread and step with 8 warps
    block_d: int = 1024
    # 8 rather than 4: at T = 16 the 16 accumulators and the row fit in registers
    num_warps: int = 8


def gate_scores_ref(x: torch.Tensor, weight: torch.Tensor, score_func: str) -> torch.Tensor:
    """x: [T, D], weight: [E, D] fp32 -> every expert's score [T, E], computed in fp32."""
    logits = F.linear(x.float(), weight)  # [T, E]
    if score_func == "sigmoid":
        return logits.sigmoid()
    if score_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.softmax(dim=-1)


if triton is not None:
    _THRESHOLD = tl.constexpr(SOFTPLUS_THRESHOLD)

    @triton.jit
    def _log1p(e):
        """log(1 + e) for e >= 0 to a few ulps with a plain log (Goldberg's correction: the rounding of 1 + e is
        divided back out); libdevice's log1p is not available under the interpreter."""
        u = 1.0 + e
        small = u == 1.0
        return tl.where(small, e, tl.log(u) * (e / tl.where(small, 1.0, u - 1.0)))

    @triton.jit
    def _gate_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        E,
        stride_xt,
        stride_we,
        T: tl.constexpr,
        D: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_D: tl.constexpr,
        SOFTPLUS: tl.constexpr,
    ):
        """out[t, rows] = score(x[t] . W[rows]) for the program's BLOCK_E rows, every token t < T."""
        CHUNKS: tl.constexpr = (D + BLOCK_D - 1) // BLOCK_D
        rows = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE]
        cols = tl.arange(0, BLOCK_D)  # [BD]
        w_rows = w_ptr + rows[:, None] * stride_we  # [BE, 1]
        ws = ()
        # the whole row first: every load issued before any product waits
        for c in tl.static_range(CHUNKS):
            ok = (rows[:, None] < E) & (c * BLOCK_D + cols[None, :] < D)  # [BE, BD]
            ws = ws + (tl.load(w_rows + c * BLOCK_D + cols[None, :], mask=ok, other=0.0),)
        # per token: lane-wise partial sums
        accs = (tl.zeros((BLOCK_E, BLOCK_D), dtype=tl.float32),) * T
        for c in tl.static_range(CHUNKS):
            k = c * BLOCK_D + cols  # [BD]
            new = ()
            for t in tl.static_range(T):
                x = tl.load(x_ptr + t * stride_xt + k, mask=k < D, other=0.0).to(tl.float32)  # [BD], L2-resident
                new = new + (accs[t] + ws[c] * x[None, :],)
            accs = new
        for t in tl.static_range(T):
            z = tl.sum(accs[t], axis=1)  # [BE] logits
            # torch's softplus: z itself above the threshold (exp would overflow past ~88)
            if SOFTPLUS:
                soft = tl.where(z > _THRESHOLD, z, _log1p(tl.exp(tl.minimum(z, _THRESHOLD))))
                s = tl.sqrt_rn(soft)
            else:
                # exp of -|z| only: no overflow to inf for very negative logits
                e = tl.exp(-tl.abs(z))
                s = tl.where(z >= 0, 1.0, e) / (1.0 + e)
            tl.store(out_ptr + t * E + rows, s, mask=rows < E)


def can_score(x: torch.Tensor, weight: torch.Tensor, score_func: str) -> str | None:
    """None when the kernel takes this call, else why the reference must: x [T, D] bf16/fp32 with 1 <= T <= 16 and
    unit stride in D, weight [E, D] fp32 with unit stride in D, sigmoid or sqrtsoftplus (where the kernels run at all
    is backend.use_kernels' rule, which the caller applies)."""
    if score_func not in KERNEL_SCORES:
        return f"score_func {score_func!r} (the kernel does {', '.join(KERNEL_SCORES)})"
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_TOKENS:
        return f"x of shape {tuple(x.shape)} (the kernel takes [T, D] with 1 <= T <= {MAX_TOKENS})"
    if x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != torch.float32:
        return f"x {x.dtype}, weight {weight.dtype} (the kernel takes bf16 or fp32 x and an fp32 weight)"
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.device != x.device:
        return f"weight of shape {tuple(weight.shape)} on {weight.device} for x {tuple(x.shape)} on {x.device}"
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return "x or weight without unit stride in D"
    if weight.shape[0] * weight.stride(0) >= INDEX_LIMIT or x.shape[0] * x.stride(0) >= INDEX_LIMIT:
        return "tensors past int32 offsets"
    return None


def gate_scores(x: torch.Tensor, weight: torch.Tensor, score_func: str, tiles: GateTiles | None = None) -> torch.Tensor:
    """gate_scores_ref's values; x: [T, D] bf16/fp32, weight: [E, D] fp32 -> [T, E] fp32. One launch when can_score
    holds (decode: T <= 16, sigmoid or sqrtsoftplus); otherwise (softmax, T > 16) the torch reference computes it.
    tiles: GateTiles() unless given (scripts/bench_kernels.py --only gate times others)."""
    tiles = tiles or GateTiles()
    if can_score(x, weight, score_func) is not None:
        return gate_scores_ref(x, weight, score_func)
    (t, d), e = x.shape, weight.shape[0]
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    block_d = min(tiles.block_d, next_pow2(d))
    _gate_kernel[(triton.cdiv(e, tiles.block_e),)](
        x,
        weight,
        out,
        e,
        x.stride(0),
        weight.stride(0),
        T=t,
        D=d,
        BLOCK_E=tiles.block_e,
        BLOCK_D=block_d,
        SOFTPLUS=score_func == "sqrtsoftplus",
        num_warps=tiles.num_warps,
    )
    return out
