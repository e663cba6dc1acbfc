"""The routed-expert interface the MoE layer calls (the formula and the record convention: ref.py).

`MoEKernel` runs the decode kernel for up to MAX_TOKENS tokens and the prefill kernel above it, on CUDA
with Triton; on the CPU, the C kernel of kernels/cpu where it builds (a C compiler on PATH), else the torch reference.
Where backend.fp4_mma says (Blackwell, or DSFP4_FP4_MMA=1), the prefill takes its FP4 tensor-core variant
(prefill_mma.py; on the CPU its torch reference); decode stays as it is.
"""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import fp4_mma, use_kernels
from dsfp4.kernels.cpu import moe as host_moe
from dsfp4.kernels.moe.decode import MAX_TOKENS, DecodeMoE
from dsfp4.kernels.moe.decode import workspace_bytes as decode_workspace_bytes
from dsfp4.kernels.moe.prefill import max_blocks, moe_prefill, prefill_blocks
from dsfp4.kernels.moe.prefill_mma import moe_prefill_mma, moe_w4a8_ref, takes
from dsfp4.kernels.moe.prefill_mma import workspace_bytes as mma_workspace_bytes
from dsfp4.kernels.moe.ref import moe_ref
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.record_offsets import ABSENT


class MoEKernel:
    """moe_ref's result for one record layout: the decode kernel for up to MAX_TOKENS tokens and the
    prefill kernel above, on CUDA with Triton; on the CPU the C kernel where it builds; the reference elsewhere.
    Holds the decode workspaces."""

    def __init__(self, layout: RecordLayout, top_k: int, device: torch.device, limit: float = 0.0):
        """limit: the SwiGLU clamp (kernels/swiglu.py; DeepSeek-V4's swiglu_limit), 0.0 for none."""
        self.layout, self.top_k, self.limit = layout, top_k, limit
        self.triton = use_kernels(torch.device(device))
        self.host = torch.device(device).type == "cpu" and host_moe.available()
        # the FP4 tensor-core prefill (W4A8), where the one rule picks it and the records can take it
        self.mma = fp4_mma(device, layout.format) and takes(layout)
        if self.triton:
            self.decode = DecodeMoE(layout, top_k, device, limit=limit)

    def __call__(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        records: torch.Tensor,
        offsets: torch.Tensor,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [T, D], ids: [T, K], weights: [T, K], records: [S, nbytes], offsets: [E], add: None or [T, D] in
        x's dtype (the shared experts' output) -> y [T, D]: the routed experts' sum in x's dtype, plus add."""
        # the decode kernel adds it in its final launch
        if self.triton and x.shape[0] <= MAX_TOKENS:
            return self.decode(x, ids, weights, records, offsets, add)
        # prefill only, as on the GPU, where decode is the decode kernel's
        if self.mma and x.shape[0] <= MAX_TOKENS:
            y = self.unquantized(x, ids, weights, records, offsets)
        else:
            y = self.prefill(x, ids, weights, records, offsets)
        # y: [T, D]
        return y if add is None else y + add

    def prefill(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, records: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """The prefill path at any token count (arguments as __call__'s, ids [T, K'] of any K'): a streamed wave's
        compacted calls (waves.py) take it for their pairs, however few, in place of decode's top-k workspaces."""
        if self.mma:
            mma = moe_prefill_mma if self.triton else moe_w4a8_ref
            return mma(x, ids, weights, records, offsets, self.layout, limit=self.limit)
        return self.unquantized(x, ids, weights, records, offsets)

    def unquantized(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, records: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """The activations as they are (no MXFP8 round): the C kernel, the reference, or Triton's grouped GEMMs."""
        if self.host:
            return host_moe.moe_host(x, ids, weights, records, offsets, self.layout, self.limit)
        if not self.triton:
            return moe_ref(x, ids, weights, records, offsets, self.layout, self.limit)
        return moe_prefill(x, ids, weights, records, offsets, self.layout, limit=self.limit)

    def warm_up(self, dtype: torch.dtype, records: torch.Tensor, n_experts: int, max_tokens: int) -> None:
        """Compile every kernel variant a call of up to max_tokens tokens can take (each decode token count,
        the prefill kernels' row blocks) before the first token is timed and before any graph capture (a streamed
        wave's compacted calls take others: waves.warm_up_waves). No expert is read: all are left out."""
        if not self.triton:
            return
        offsets = torch.full((n_experts,), ABSENT, dtype=torch.long, device=records.device)
        # one token count per compiled variant: the kernels' constexprs, and Triton's
        sizes: dict = {}
        # specialization of int arguments divisible by 16
        for t in range(1, max_tokens + 1):
            pairs = t * self.top_k
            shape = (t,) if t <= MAX_TOKENS else prefill_blocks(pairs, n_experts, self.layout)
            sizes.setdefault((shape, t % 16 == 0, pairs % 16 == 0), t)
        for t in sizes.values():
            x = torch.zeros(t, self.layout.dim, dtype=dtype, device=records.device)
            ids = torch.arange(t * self.top_k, device=records.device).view(t, self.top_k) % n_experts
            # decode's last launch takes the shared experts' too
            adds = (None, x) if t <= MAX_TOKENS else (None,)
            for add in adds:
                self(x, ids, torch.zeros(t, self.top_k, device=records.device), records, offsets, add)


def workspace_bytes(
    layout: RecordLayout, top_k: int, n_experts: int, tokens: int, dtype: torch.dtype, fp4_mma: bool = False
) -> int:
    """Device memory the kernels hold for a call of `tokens` tokens: the decode workspaces (kept), and above
    MAX_TOKENS the prefill's padded expert rows, per-pair outputs, result and its sum with the shared experts';
    with `fp4_mma` (backend.fp4_mma's answer) the FP4 tensor-core prefill's MXFP8 activations too."""
    elt = torch.empty((), dtype=dtype).element_size()
    decode = decode_workspace_bytes(layout, top_k)
    if tokens <= MAX_TOKENS:
        return decode
    pairs = tokens * top_k
    block_rows = prefill_blocks(pairs, n_experts, layout).rows
    rows = max_blocks(pairs, n_experts, block_rows) * block_rows
    mma = mma_workspace_bytes(layout, top_k, n_experts, tokens) if fp4_mma and takes(layout) else 0
    return decode + mma + elt * (rows * layout.inter_dim + pairs * layout.dim + 2 * tokens * layout.dim)
