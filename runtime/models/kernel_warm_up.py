"""The backbone's Triton kernels compiled at engine start for every variant a prompt can take, so that no request
pays a compile (the MoE kernels warm up themselves: kernels/moe/kernel.py MoEKernel.warm_up).

A kernel compiles once per variant: its constexprs (the tiles the FP8 GEMM plans from the token count and the
matrix's rows, the GEMV per token count) and Triton's specialization of int arguments divisible by 16. A prompt of
any length reaches the kernels in calls of at most a chunk (or an attention group, whose calls plan as a chunk's
do), so one call per distinct variant of up to `chunk` tokens covers them all. Each goes through the attention of
the first dense and the first MoE block (the other blocks share their shapes), the dense block's MLP, the MoE
block's router and shared experts (no record is read), and the head at the last position (eval's and logits'
whole-call head compiles at their first call); it writes cache rows a later prompt overwrites. Where no kernel
runs (CPU, a card on the torch references) nothing is compiled and nothing runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from dsfp4.kernels.backend import FP8Path, card, fp8_path, has_fp8_kernels, use_kernels
from dsfp4.kernels.fp8.gemm import gemm_plan
from dsfp4.kernels.fp8.linear import GEMV_MAX_TOKENS
from dsfp4.kernels.fp8.widened_gemm import gemm_route
from dsfp4.kernels.linear import QuantizedWeight
from dsfp4.kernels.token_bounds import DECOMPRESS_TOKENS
from dsfp4.runtime.models.protocol import Model

# Triton specializes an int argument divisible by this
SPECIALIZED_DIVISOR = 16


def prompt_sizes(chunk: int, variant: Callable[[int], Hashable]) -> list[int]:
    """One token count per distinct variant(t) for calls of 1..chunk tokens (the smallest of each), ascending."""
    sizes: dict[Hashable, int] = {}
    for t in range(1, chunk + 1):
        sizes.setdefault((variant(t), t > DECOMPRESS_TOKENS, t % SPECIALIZED_DIVISOR == 0), t)
    return sorted(sizes.values())


def fp8_rows(model: Model) -> list[int]:
    """The row counts N of the model's FP8 matrices the kernels read as stored (the GEMM's tiles depend on them)."""
    return sorted(
        {
            w.shape[0]
            for m in model.modules()
            for w in vars(m).values()
            if isinstance(w, QuantizedWeight) and w.fp8_on_gpu
        }
    )


def backbone_variant(model: Model) -> Callable[[int], Hashable]:
    """t -> what the FP8 kernels compile for a call of t tokens: the GEMV per count, else the GEMM's tiles for
    every matrix's rows (dtype as the model's activations), or one widening kernel where the by-bits path widens."""
    device = model.device
    if not has_fp8_kernels(device):
        return lambda t: min(t, GEMV_MAX_TOKENS + 1)
    rows, c, by_bits = fp8_rows(model), card(device), fp8_path(device) is FP8Path.BY_BITS
    elt = model.embed_tokens(torch.zeros(1, 1, dtype=torch.long, device=device)).element_size()

    def variant(t: int) -> Hashable:
        if t <= GEMV_MAX_TOKENS:
            return t
        if gemm_route(t, by_bits) == "widened":
            return "widened"
        return tuple(gemm_plan(t, n, c, by_bits, elt) for n in rows)

    return variant


@torch.inference_mode()
def warm_up_backbone(model: Model, chunk: int) -> int:
    """Compile the backbone's kernels for every prompt_sizes call of up to `chunk` tokens -> the calls made (0 where
    the backbone runs no kernel)."""
    if not use_kernels(model.device):
        return 0
    sizes = prompt_sizes(chunk, backbone_variant(model))
    dense = [i for i, b in enumerate(model.layers) if not b.moe][:1]
    moe = [i for i, b in enumerate(model.layers) if b.moe][:1]
    for t in sizes:
        tokens = torch.zeros(1, t, dtype=torch.long, device=model.device)  # [1, T]
        x = model.embed_tokens(tokens)  # [1, T, ...]
        for i in dense + moe:
            device = model.cards.of_layer(i) if model.cards is not None else model.device
            h = model.block_attention(i, x.to(device), 0)
            if i in dense:
                h = model.block_ffn(i, h, tokens.to(device), t)
            else:
                ffn = model.layers[i].ffn
                flat = torch.zeros(t, model.args.dim, dtype=h.dtype, device=device)  # [T, D]
                ffn.gate(flat, tokens.to(device).view(-1))
                if ffn.shared_experts is not None:
                    ffn.shared_experts(flat)
        # the last position's logits, as a prompt's (a whole call's logits would pass the plan's workspace)
        model.finish(h, t, last_only=True)
    return len(sizes)
