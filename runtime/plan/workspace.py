"""Transient device memory of a forward, which the plan's workspace holds: dense copies of backbone matrices, the
activations of the family's forward, logits, the routed-expert kernels' workspaces; and how many tokens a layer-wise
pass's feed-forward and its attention take at once within it (prefill_group, attention_group)."""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import FP8Path, fp4_mma, fp8_path
from dsfp4.kernels.fp8.widened_gemm import gemm_route, widened_bytes
from dsfp4.kernels.moe.kernel import workspace_bytes as moe_workspace
from dsfp4.layout.formats import FORMATS, shape_numel
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.plan.limits import LOGIT_ROWS, MTP_BATCH, SCORE_ELEMENTS

FP32 = 4
# torch's CUDA caching allocator reserves whole 2 MiB and 20 MiB segments
ALLOCATOR_SLACK = 64 << 20
# matrices the device path multiplies as a dense copy (V3's absorbed attention at prefill, V4's grouped output
# projection); every other quantized matrix is read as stored by the kernels (kernels/linear.py)
DENSE_COPIES = ("attn.wkv_b", "attn.wo_a")


def dequant_bytes(manifest: Manifest, dtype: torch.dtype, kernels: bool, fp8_kernels: bool) -> int:
    """The most a dense copy of one backbone matrix holds at once. The torch reference (`kernels` False, or fp32 runs,
    whose products take the reference) dequantizes every matrix it multiplies, through two fp32 copies, then the
    result; so does FP8 without `fp8_kernels` (kernels/backend.py has_fp8_kernels: False where the device's FP8 path
    is the reference, e.g. below sm_80; True on sm_80/86, whose kernels convert e4m3 by bits, as on sm_89 on, which
    convert it in hardware: no dense fp32 copy there). The kernels read matrices as stored except
    DENSE_COPIES: FP8 blocks in one Triton pass (the result, and a contiguous copy of a slice of it for the product),
    other formats as the reference does."""
    elt = torch.empty((), dtype=dtype).element_size()
    reference = not kernels or dtype == torch.float32
    most = 0
    for name, t in manifest.tensors.items():
        fp8 = t.format == "fp8_e4m3_b128"
        if FORMATS[t.format].scale is None or not (reference or name.endswith(DENSE_COPIES) or fp8 and not fp8_kernels):
            continue
        fp8_pass = not reference and fp8_kernels and t.format == "fp8_e4m3_b128"
        most = max(most, shape_numel(t.shape) * (2 * elt if fp8_pass else 2 * FP32 + elt))
    return most


def widened_gemm_bytes(manifest: Manifest, device: torch.device, dtype: torch.dtype, t: int, fp8_kernels: bool) -> int:
    """What the by-bits path's widened prefill GEMM (kernels/fp8/widened_gemm.py) holds at once for a call of t
    tokens: 0 on other paths, for fp32 runs (the reference) and for calls the Triton GEMM takes."""
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if not (cuda and fp8_kernels and dtype != torch.float32 and fp8_path(device) is FP8Path.BY_BITS):
        return 0
    if gemm_route(t, by_bits=True) != "widened":
        return 0
    shapes = [tuple(x.shape) for x in manifest.tensors.values() if x.format == "fp8_e4m3_b128" and len(x.shape) == 2]
    return widened_bytes(shapes, t, torch.empty((), dtype=dtype).element_size())


def activation_bytes(a: ModelArgs, t: int, max_context: int, elt: int, fp8_attention: bool = False) -> int:
    """Transient tensors of one forward of t tokens (upper estimates of what lives at once), by the family's rule
    (layout/family.py), attention scores held in chunks of SCORE_ELEMENTS; fp8_attention: with its e4m3 copies."""
    return a.family_spec.activations(a, t, max_context, elt, SCORE_ELEMENTS, fp8_attention)


def forward_tokens(prefill_chunk: int, max_context: int, with_mtp: bool) -> int:
    """Tokens of the largest forward: a prefill chunk; with MTP also a verify step's 2 and a batch of MTP entries."""
    return min(max(prefill_chunk, MTP_BATCH if with_mtp else 1), max_context)


def group_token_bytes(a: ModelArgs, elt: int) -> int:
    """Device memory a token of a layer-wise pass's feed-forward group holds while the group's experts stream in: its
    residual stream(s), with their fp32 mixing where there are several (V4's mHC), the normed input, the shared
    experts' output, the routed sum in fp32 and its rounding, the router's fp32 scores."""
    streams = max(1, a.hc_mult)
    residual = streams * a.dim * (elt + 2 * FP32 * (streams > 1))
    return residual + a.dim * (3 * elt + FP32) + 2 * a.n_routed_experts * FP32


def prefill_group(a: ModelArgs, chunk: int, max_context: int, elt: int) -> int:
    """Tokens a layer-wise pass's feed-forward takes at once (runtime/generate/layer_pass.py), a whole number of
    chunks: what a chunk's forward holds in activations (attention's scores among them, which the feed-forward half
    does not use) holds of a group's tokens, a chunk's share left to the kernels' pieces; at least a chunk, at most
    the context."""
    t = min(chunk, max_context)
    chunks = activation_bytes(a, t, max_context, elt) // (t * group_token_bytes(a, elt)) - 1
    return min(t * max(1, chunks), max_context)


def attention_group(
    a: ModelArgs, chunk: int, max_context: int, elt: int, kernels: bool, fp8_attention: bool = False
) -> int:
    """Tokens of one sequence a layer-wise pass's attention takes at once, a whole number of chunks: what a chunk's
    forward holds in activations holds of the family's attention half (its fixed bytes first), so that each call
    brings the cached keys to the attended form once for all its tokens; a chunk where the family attends a chunk at a
    time; at most the context. fp8_attention: the attention's FP8 variant, whose e4m3 copies both sides count."""
    t = min(chunk, max_context)
    if a.family_spec.attention_bytes is None:
        return t
    fixed, token = a.family_spec.attention_bytes(a, max_context, elt, SCORE_ELEMENTS, kernels, fp8_attention)
    chunks = (activation_bytes(a, t, max_context, elt, fp8_attention) - fixed) // (t * token)
    return min(t * max(1, chunks), max_context)


def workspace_bytes(
    manifest: Manifest,
    device: torch.device,
    dtype: torch.dtype,
    t: int,
    max_context: int,
    kernels: bool,
    fp8_kernels: bool,
    fp8_attention: bool = False,
) -> int:
    """Transient device memory of a forward of t tokens: dense copies of backbone matrices (and the by-bits path's
    widened pieces), activations (fp8_attention: with the FP8 attention's e4m3 copies), logits, the routed-expert
    kernels' workspaces, the staging buffer cold records are widened from (store/transfers.py) and the CUDA
    allocator's slack."""
    a, elt = manifest.args, torch.empty((), dtype=dtype).element_size()
    workspace = dequant_bytes(manifest, dtype, kernels, fp8_kernels)
    workspace += activation_bytes(a, t, max_context, elt, fp8_attention)
    workspace += widened_gemm_bytes(manifest, device, dtype, t, fp8_kernels) if kernels else 0
    workspace += a.vocab_size * FP32 * 2 * LOGIT_ROWS
    if manifest.record:
        # the FP4 tensor-core prefill's activations where this machine's card takes it
        mma = device.type == "cuda" and torch.cuda.is_available() and fp4_mma(device, manifest.record.format)
        workspace += moe_workspace(manifest.record, a.n_activated_experts, a.n_routed_experts, t, dtype, mma)
    # 0 when no record is cold
    workspace += manifest.cold_nbytes()
    return workspace + (ALLOCATOR_SLACK if device.type == "cuda" else 0)
