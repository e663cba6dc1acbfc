"""The routed experts on the CPU: moe_ref's result (kernels/moe/ref.py, the torch reference) computed by moe.c from the
FP4 records where they lie, without dense copies. kernels/moe/kernel.py picks it for CPU tensors when it builds here
(kernels/cpu/build.py), the reference otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from dsfp4.kernels.cpu.build import CFunction
from dsfp4.kernels.moe.ref import routed
from dsfp4.layout.formats import get_format
from dsfp4.layout.fp4 import e2m1_decode, e8m0_to_float
from dsfp4.layout.record import RecordLayout

SOURCE = Path(__file__).with_name("moe.c")
# the byte offsets expert_ffn takes, in its order
PARTS = ("w13", "w13_scale", "w2", "w2_scale", "scale_2")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
EXPERT_FFN = CFunction(SOURCE, "expert_ffn", [_P, _P, _I, _I, _I, _P, _P, _F, _P, _I, _P, _P, _P, _P, _I])


def available() -> bool:
    """Whether the kernel builds and loads here (a C compiler is on PATH)."""
    return EXPERT_FFN.available()


def why_unavailable() -> str:
    """Why the kernel cannot be built here, in a line; "" when it can."""
    return EXPERT_FFN.why_unavailable()


@functools.lru_cache
def _tables(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e2m1 values [16], every scale byte's value [256]) in fp32, decoded as the reference decodes them."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scales = codes.view(torch.float8_e4m3fn).float() if fmt == "nvfp4" else e8m0_to_float(codes)
    return e2m1_decode(codes[:16]).contiguous(), scales.contiguous()


@functools.lru_cache
def _offsets(layout: RecordLayout) -> torch.Tensor:
    names = {p.name: p.offset for p in layout.parts}
    return torch.tensor([names.get(n, -1) for n in PARTS], dtype=torch.int64)


def moe_host(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    layout: RecordLayout,
    limit: float = 0.0,
    path: str = "native",
) -> torch.Tensor:
    """moe_ref's arguments and result on the CPU (x: [T, D], ids: [T, K], weights: [T, K], records: [S, nbytes] u8,
    offsets: [E] -> y [T, D] in x's dtype), summed in fp32 by the C kernel on the records in place. path: which of
    moe.c's paths (kernels/cpu/build.py PATHS)."""
    if layout.cold:
        raise ValueError("the CPU kernel reads 4-bit records; widen a cold record first (RecordLayout.widen)")
    kernel, (e2m1, scale_of), parts = EXPERT_FFN.get(path), _tables(layout.format), _offsets(layout)
    block = get_format(layout.format).block[1]
    xf = x.float().contiguous()  # [T, D]
    y = torch.zeros_like(xf)
    threads = torch.get_num_threads()
    for record, token, j in routed(ids, records, offsets, layout):
        xs, w = xf[token].contiguous(), weights[token, j].float().contiguous()  # [n, D], [n]
        rows = token.to(torch.int64).contiguous()
        scratch = torch.empty(len(token) * (2 * layout.inter_dim + layout.dim), dtype=torch.float32)
        kernel(
            record.data_ptr(),
            parts.data_ptr(),
            layout.dim,
            layout.inter_dim,
            block,
            e2m1.data_ptr(),
            scale_of.data_ptr(),
            limit,
            xs.data_ptr(),
            len(token),
            rows.data_ptr(),
            w.data_ptr(),
            y.data_ptr(),
            scratch.data_ptr(),
            threads,
        )
    return y.to(x.dtype)
