"""FP8 block-scaled linear on the CPU: kernels/linear.py's linear_ref result (dequantize, then one matmul) computed by
fp8.c from the stored e4m3 bytes and block scales, without a dense copy. kernels/linear.py picks it for CPU tensors
where it builds here (kernels/cpu/build.py), the reference otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from dsfp4.kernels.cpu.build import CFunction

SOURCE = Path(__file__).with_name("fp8.c")
_P, _I = ctypes.c_void_p, ctypes.c_int
FP8_LINEAR = CFunction(SOURCE, "fp8_linear", [_P, _P, _I, _I, _P, _P, _I, _P, _I])


@functools.lru_cache
def _e4m3() -> torch.Tensor:
    """Every e4m3 byte's value [256] in fp32, decoded as the reference decodes it."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().contiguous()


def fp8_linear_host(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, path: str = "native") -> torch.Tensor:
    """x: [..., K], q: [N, K] e4m3, scale: [ceil(N / 128), ceil(K / 128)] fp32 -> [..., N] in x's dtype, summed in fp32.
    path: which of fp8.c's paths (kernels/cpu/build.py PATHS)."""
    xf = x.reshape(-1, x.shape[-1]).float().contiguous()  # [T, K]
    qb, s = q.contiguous().view(torch.uint8), scale.float().contiguous()
    n, k = qb.shape
    y = torch.empty(xf.shape[0], n, dtype=torch.float32)  # [T, N]
    FP8_LINEAR.get(path)(
        qb.data_ptr(),
        s.data_ptr(),
        n,
        k,
        _e4m3().data_ptr(),
        xf.data_ptr(),
        xf.shape[0],
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y.reshape(*x.shape[:-1], n).to(x.dtype)
